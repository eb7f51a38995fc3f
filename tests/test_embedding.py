"""A project of one's own, laid out like Temporal's samples (its own `workflows.py`, `activities.py`,
`worker.py` and a starter), imports mamba_stream beside its modules and runs an agent that owns a
stream (issue 44, item 1). Before the package, the library's top-level `workflows` and `activities`
collided with the project's: `from plugin import MambaStreamPlugin` raised ImportError.

Each file runs for real, in its own process, from the project's directory, against the test's
Temporal dev server; the agent's receipt is checked against the state of its text fed locally."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import pytest

from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import Keyring, plaintext_checksum
from tests.workflows import conftest as workflow_fixtures
from tests.workflows.conftest import address

pytestmark = pytest.mark.asyncio(loop_scope="session")
temporal_env = workflow_fixtures.temporal_env

WORKFLOWS = '''
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities import greeting
    from mamba_stream import ModelStream, StreamOwner


@workflow.defn
class Greeter(StreamOwner):
    @workflow.run
    async def run(self, name: str) -> dict:
        text = await workflow.execute_activity(greeting, name, start_to_close_timeout=timedelta(seconds=30))
        stream = await ModelStream.open("alice", "tiny-mamba2")
        res = await stream.advance(text=text)
        await stream.dispose()
        return {"text": text, "position": res.position, "checksum": res.receipt.checksum}
'''

ACTIVITIES = '''
from temporalio import activity


@activity.defn
async def greeting(name: str) -> str:
    return f"Hello, {name}! "
'''

WORKER = '''
import asyncio
import os

from temporalio.client import Client
from temporalio.worker import Worker

import activities
import workflows
from mamba_stream import MambaStreamPlugin
from mamba_stream.activities import ModelRegistry, StreamActivities, open_store
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.worker import worker_slots


async def main() -> None:
    queue = os.environ["QUEUE"]
    ring = Keyring.from_file(os.environ["KEYRING"])
    acts = StreamActivities(models=ModelRegistry(["tiny-mamba2"], backend="reference"),
                            store=open_store(os.environ["STORE"]), keyring=ring, worker_queue=queue + "@1")
    client = await Client.connect(os.environ["ADDRESS"], plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    async with Worker(client, task_queue=queue, workflows=[workflows.Greeter], activities=[activities.greeting],
                      **worker_slots(workflows=True)), \\
            Worker(client, task_queue=acts.worker_queue, **worker_slots(workflows=False)):
        print("ready", workflows.__file__, activities.__file__, flush=True)
        await asyncio.Event().wait()


asyncio.run(main())
'''

STARTER = '''
import asyncio
import json
import os
import sys

from temporalio.client import Client

from mamba_stream import MambaStreamPlugin
from mamba_stream.state_codec.keyring import Keyring
from workflows import Greeter


async def main() -> None:
    client = await Client.connect(os.environ["ADDRESS"],
                                  plugins=[MambaStreamPlugin(keyring=Keyring.from_file(os.environ["KEYRING"]))])
    out = await client.execute_workflow(Greeter.run, sys.argv[1], id=sys.argv[2], task_queue=os.environ["QUEUE"])
    print(json.dumps(out))


asyncio.run(main())
'''


async def test_a_project_laid_out_like_temporals_samples_imports_the_package_and_runs_an_agent(
        temporal_env, tmp_path):
    project = tmp_path / "my-agent"
    project.mkdir()
    for name, text in (("workflows.py", WORKFLOWS), ("activities.py", ACTIVITIES), ("worker.py", WORKER),
                       ("starter.py", STARTER)):
        (project / name).write_text(text.lstrip())
    ring = Keyring.generate()
    ring.save(tmp_path / "keyring.json")
    env = {**os.environ, "ADDRESS": address(temporal_env), "QUEUE": f"sample-{uuid.uuid4().hex[:8]}",
           "KEYRING": str(tmp_path / "keyring.json"), "STORE": f"file://{tmp_path / 'states'}"}
    env.pop("PYTHONPATH", None)  # the installed package only: nothing of this checkout on the path
    worker = await asyncio.to_thread(subprocess.Popen, [sys.executable, "worker.py"], cwd=project, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(worker.stdout.readline), 120)
        assert line.split() == ["ready", str(project / "workflows.py"), str(project / "activities.py")], \
            (line, worker.poll(), worker.stderr.read() if worker.poll() is not None else "")
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "starter.py", "Ada", "greeter-1"],
                                      cwd=project, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    m = load_model("tiny-mamba2", backend="reference")
    tokens = m.transform.encode("Hello, Ada! ")
    assert got == {"text": "Hello, Ada! ", "position": len(tokens),
                   "checksum": plaintext_checksum(m.advance(m.initial_state(), tokens).state.tensors)}
