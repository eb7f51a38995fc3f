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
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from mamba_stream import MambaStreamPlugin
from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import Keyring, plaintext_checksum
from mamba_stream.workflows import STREAM_WORKFLOW_TYPE
from tests.workflows import conftest as workflow_fixtures
from tests.workflows.conftest import address, make_stack

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
from mamba_stream import ClientConfig, MambaStreamPlugin


async def main() -> None:
    client = await Client.connect(ClientConfig().target, plugins=[MambaStreamPlugin.for_worker()])
    async with Worker(client, task_queue=os.environ["QUEUE"], workflows=[workflows.Greeter],
                      activities=[activities.greeting]):
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
from workflows import Greeter


async def main() -> None:
    client = await Client.connect(os.environ["TEMPORAL_ADDRESS"], plugins=[MambaStreamPlugin()])
    out = await client.execute_workflow(Greeter.run, sys.argv[1], id=sys.argv[2], task_queue=os.environ["QUEUE"])
    print(json.dumps(out))


asyncio.run(main())
'''


def _env(temporal_env, tmp_path: Path, queue: str, model: str = "tiny-mamba2") -> dict[str, str]:
    """A worker's and a client's environment: the test's server, a keyring, a store and a home of
    their own, the one model served; nothing of this checkout on the path (the installed package)."""
    ring = Keyring.generate()
    ring.save(tmp_path / "keyring.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TEMPORAL_", "MAMBA_STREAM_"))}
    env.pop("PYTHONPATH", None)
    env.update(TEMPORAL_ADDRESS=address(temporal_env), QUEUE=queue, MAMBA_STREAM_KEYRING=str(tmp_path / "keyring.json"),
               MAMBA_STREAM_STORE=f"file://{tmp_path / 'states'}", MAMBA_STREAM_HOME=str(tmp_path / "home"),
               MAMBA_STREAM_MODELS=model, MAMBA_STREAM_SWEEP_S="0")
    return env


async def _run_project(project: Path, files: dict[str, str], env: dict[str, str], starter: list[str],
                       ready: bool = True) -> tuple[str, str]:
    """Write the project, start its worker.py, run its starter; (the worker's first line, the
    starter's stdout)."""
    project.mkdir()
    for name, text in files.items():
        (project / name).write_text(text.lstrip())
    worker = await asyncio.to_thread(subprocess.Popen, [sys.executable, "worker.py"], cwd=project, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        if ready:
            line = await asyncio.wait_for(asyncio.to_thread(worker.stdout.readline), 120)
            assert line, (worker.poll(), worker.stderr.read() if worker.poll() is not None else "")
        try:
            out = await asyncio.to_thread(subprocess.run, [sys.executable, *starter], cwd=project, env=env,
                                          capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as exc:
            worker.terminate()
            raise AssertionError(f"the starter ran past 120 s; the worker's stderr:\n"
                                 f"{(await asyncio.to_thread(worker.communicate, None, 30))[1][-6000:]}") from exc
        assert out.returncode == 0, (out.stderr, worker.poll())
        return line, out.stdout
    finally:
        worker.terminate()
        await asyncio.to_thread(worker.wait, 30)


async def test_a_project_laid_out_like_temporals_samples_imports_the_package_and_runs_an_agent(
        temporal_env, tmp_path):
    project = tmp_path / "my-agent"
    env = _env(temporal_env, tmp_path, f"sample-{uuid.uuid4().hex[:8]}")
    line, out = await _run_project(project, {"workflows.py": WORKFLOWS, "activities.py": ACTIVITIES,
                                             "worker.py": WORKER, "starter.py": STARTER},
                                   env, ["starter.py", "Ada", f"greeter-{uuid.uuid4().hex[:8]}"])
    # the project's own modules, not the library's
    assert line.split() == ["ready", str(project / "workflows.py"), str(project / "activities.py")]
    got = json.loads(out)
    m = load_model("tiny-mamba2")  # what the worker serves: the default backend (exact on a CPU)
    tokens = m.transform.encode("Hello, Ada! ")
    assert got == {"text": "Hello, Ada! ", "position": len(tokens),
                   "checksum": plaintext_checksum(m.advance(m.initial_state(), tokens).state.tensors)}


def _readme_files(section: str = "### Your own agent") -> dict[str, str]:
    """The files of the README's `section`: each a python block whose first line names it."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index(section)
    section = readme[start:readme.index("\n### ", start + len(section))]
    blocks = re.findall(r"```python\n# (\w+\.py)\n(.*?)```", section, re.DOTALL)
    return {name: body for name, body in blocks}


async def test_the_readmes_own_agent_is_three_files_in_at_most_40_lines():
    files = _readme_files()
    assert sorted(files) == ["starter.py", "worker.py", "workflows.py"]
    lines = sum(1 for body in files.values() for line in body.splitlines() if line.strip())
    assert lines <= 40, lines


async def test_the_readmes_own_agent_runs_and_answers_as_a_stream_fed_the_same(temporal_env, tmp_path):
    queue, wid = f"readme-{uuid.uuid4().hex[:8]}", f"assistant-{uuid.uuid4().hex[:8]}"
    files = {name: body.replace('"my-agents"', repr(queue)).replace('"assistant-1"', repr(wid))
             for name, body in _readme_files().items()}
    # what the README's agent does: its model, prompt and generate, as the README has them
    [model] = re.findall(r'ModelStream\.open\("alice", "([\w-]+)"\)', files["workflows.py"])
    [prompt] = re.findall(r'Assistant\.run, "([^"]*)"', files["starter.py"])
    [(n, seed)] = re.findall(r"stream\.generate\((\d+), seed=(\d+)\)", files["workflows.py"])
    env = _env(temporal_env, tmp_path, queue, model)
    _, out = await _run_project(tmp_path / "readme-agent", files, env, ["starter.py"], ready=False)
    # the same chunks on the library's own stream workflow, on the same model and backend
    stack = await make_stack(temporal_env, tmp_path / "stack", backend="auto", start_worker=False)
    async with stack.exits:
        await stack.worker(stack.new_activities(models=[model], backend="auto"))
        s = stack.streams
        sid = await s.open("alice", model)
        await s.advance(sid, "alice", text=prompt)
        same = await s.generate(sid, "alice", int(n), seed=int(seed))
    assert out == same.text + "\n"
    # its state was destroyed with it: the project's store holds nothing
    assert [p for p in (tmp_path / "states" / "objects").rglob("*") if p.is_file()] == []


OPENAI_AGENTS = "### Agents with the OpenAI Agents SDK"


PYDANTIC_AI = "### Agents with Pydantic AI"


@pytest.mark.parametrize("section", [OPENAI_AGENTS, PYDANTIC_AI])
async def test_the_readmes_agents_run_their_turns_on_one_stream(temporal_env, tmp_path, section):
    """The README's OpenAI Agents SDK and Pydantic AI projects, as they are there (Pydantic AI's
    starter is the OpenAI one's): two turns end on one conversation stream of the principal, fed
    twice and sampled twice (no fork, no second stream); the workflow's history holds none of
    the conversation's text."""
    queue = f"readme-agents-{uuid.uuid4().hex[:8]}"
    files = {"starter.py": _readme_files(OPENAI_AGENTS)["starter.py"], **_readme_files(section)}
    files = {name: body.replace('"my-agents"', repr(queue)) for name, body in files.items()}
    assert sorted(files) == ["starter.py", "worker.py", "workflows.py"]
    assert sum(1 for body in files.values() for line in body.splitlines() if line.strip()) <= 40
    model = next(m for m in re.findall(r'(?:model=|MambaModel\()"([\w-]+)"', files["workflows.py"]))
    [questions] = re.findall(r"Assistant\.run, (\[.*?\]),", files["starter.py"])
    env = _env(temporal_env, tmp_path, queue, model)
    _, out = await _run_project(tmp_path / "readme-agent", files, env, ["starter.py"], ready=False)
    assert len(out.splitlines()) >= len(json.loads(questions))  # a reply a turn (a reply may hold newlines)
    client = await Client.connect(address(temporal_env), plugins=[
        MambaStreamPlugin(keyring=Keyring.load_or_generate(tmp_path / "keyring.json"))])
    streams = [wf.id async for wf in client.list_workflows(
        f"TaskQueue = '{queue}' AND WorkflowType = '{STREAM_WORKFLOW_TYPE}'")]
    agents = [wf.id async for wf in client.list_workflows(f"TaskQueue = '{queue}' AND WorkflowType = 'Assistant'")]
    assert len(streams) == 1 and len(agents) == 1
    # `mamba-stream list` shows the conversation among the queue's streams, as any other
    listed = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mamba_stream.cli", "list", "--task-queue",
                                                      queue, "--json"], env=env, capture_output=True, text=True,
                                     timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert streams[0] in [row["stream_id"] for row in json.loads(listed.stdout)]
    # the worker is gone: its chunks are read from the stream's history
    names = [e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
             async for e in client.get_workflow_handle(streams[0]).fetch_history_events()
             if e.HasField("workflow_execution_update_accepted_event_attributes")]
    assert [n for n in names if n in ("advance", "generate")] == ["advance", "generate"] * len(json.loads(questions))
    history = b"".join(e.SerializeToString() for e in
                       (await (await Client.connect(address(temporal_env))).get_workflow_handle(agents[0])
                        .fetch_history()).events)
    for text in (*json.loads(questions), "Answer briefly."):
        assert text.encode() not in history, text
