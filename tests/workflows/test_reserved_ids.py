"""Reserved stream ids (Issue 43): `pfx.` is the workers' own (the prefix store's entries), and an
`ms.` id is its principal's. A start of a `pfx.` id, sealed by anyone, and a start whose input no
key of the workers opens (in clear, or under a key they do not hold) fails its run at the first
workflow task, typed and non-retryable, before any activity is scheduled and with nothing written
to the store; the workers count it (`mamba_stream_refused_requests{kind="open"}`).

Before: an operator's sealed start of `pfx.x` scheduled `open_stream`, which the activity refused;
no start refusal was counted; and a start input under an unknown key failed the run in the SDK,
before the stream's code ran, uncounted."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.common import Priority
from temporalio.exceptions import ApplicationError
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.worker import Worker

from mamba_stream.activities import HISTOGRAM_BUCKETS, StreamMetrics
from mamba_stream.activities._prefix import PREFIX_STREAM_PREFIX
from mamba_stream.activities._segments import SEGMENT_STREAM_PREFIX
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.workflows import (
    BULK_PRIORITY_LEVEL,
    DEFAULT_PRIORITY_LEVEL,
    ChatInput,
    OpenStreamInput,
    StreamClient,
    catalogue,
    new_stream_id,
    stream_priority,
)
from mamba_stream.workflows._model_stream import RESERVED_ID_PREFIXES
from tests.workflows.conftest import Stack, make_stack
from tests.workflows.test_metrics import Meter, free_port

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: a start is refused at its first workflow task: this is ample, and far less than a retried one
PROMPTLY_S = 20.0
START = {"principal": "alice", "model_id": "tiny-mamba2"}  # what a keyless client sends, in clear JSON


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


class World:
    """A stack whose workers report their metrics on a Prometheus endpoint (`Meter`)."""

    def __init__(self, stack: Stack, meter: Meter) -> None:
        self.stack, self.meter = stack, meter
        self.root = Path(stack.store_url.removeprefix("file://"))
        self.before = _files(self.root)
        self.store_before = sorted(stack.acts.store.stream_ids())

    async def client(self, keyring: Keyring | None) -> Client:
        """A client holding `keyring` (None: a plain Temporal client, no keys: its payloads in clear)."""
        plugins = [MambaStreamPlugin(keyring=keyring)] if keyring is not None else []
        return await Client.connect(self.stack.address, plugins=plugins)

    async def refused(self, client: Client, wid: str, arg: object, reason: str, *,
                      workflow: str = "MambaStream", priority: Priority = Priority.default) -> ApplicationError:
        """Start `workflow` as `wid` with `arg` (and `priority`) from `client`: the run ends Failed,
        promptly, typed `reason` and non-retryable, at its first workflow task, having scheduled
        nothing. Returns the failure, as the workers' keys read it."""
        await client.start_workflow(workflow, arg, id=wid, task_queue=self.stack.queue, priority=priority)
        handle = self.stack.client.get_workflow_handle(wid)  # the workers' keys read the failure's details
        with pytest.raises(WorkflowFailureError) as err:
            await asyncio.wait_for(handle.result(), PROMPTLY_S)
        cause = err.value.cause
        assert isinstance(cause, ApplicationError), cause
        assert (cause.type, cause.non_retryable) == (reason, True), (cause.type, cause.message)
        assert reason in catalogue()
        assert (await handle.describe()).status.name == "FAILED"
        events = [e async for e in handle.fetch_history_events()]
        kinds = [e.event_type for e in events]
        assert EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED not in kinds
        assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in kinds  # failed the run, not its task
        assert not [e for e in events if e.HasField("marker_recorded_event_attributes")
                    and e.marker_recorded_event_attributes.marker_name == "core_local_activity"]
        # the run's first workflow task decided it: one task, then the failure
        assert kinds.count(EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED) == 1
        assert kinds[-1] == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED
        self.wrote_nothing()
        return cause

    def wrote_nothing(self) -> None:
        assert sorted(self.stack.acts.store.stream_ids()) == self.store_before
        assert _files(self.root) == self.before
        assert self.stack.acts.prefixes.usage().entries == 0

    async def counted(self, reason: str, n: int = 1) -> None:
        """The workers counted `n` refused starts of `reason` (and no other refusal)."""
        deadline = asyncio.get_running_loop().time() + PROMPTLY_S
        while self.meter.delta("mamba_stream_refused_requests", kind="open", reason=reason) < n:
            assert asyncio.get_running_loop().time() < deadline, "the refusal was not counted"
            await asyncio.sleep(0.1)
        assert self.meter.delta("mamba_stream_refused_requests", kind="open", reason=reason) == n
        assert self.meter.delta("mamba_stream_refused_requests") == n


@pytest_asyncio.fixture
async def world(temporal_env, tmp_path) -> AsyncIterator[World]:
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(
        bind_address=f"127.0.0.1:{port}", histogram_bucket_overrides=HISTOGRAM_BUCKETS)))
    stack.acts = stack.new_activities(metrics=StreamMetrics(runtime.metric_meter))
    async with stack.exits:
        client = await Client.connect(stack.address, runtime=runtime,
                                      plugins=[MambaStreamPlugin(keyring=stack.keyring, activities=stack.acts)])
        pool = concurrent.futures.ThreadPoolExecutor(4)
        stack.exits.callback(pool.shutdown)
        await stack.exits.enter_async_context(Worker(client, task_queue=stack.queue, activity_executor=pool))
        yield World(stack, Meter(port))


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def test_the_reserved_prefixes_are_the_prefix_stores_and_the_kv_segments():
    assert RESERVED_ID_PREFIXES == (PREFIX_STREAM_PREFIX, SEGMENT_STREAM_PREFIX) == ("pfx.", "seg.")


@pytest.mark.parametrize("prefix", ["pfx.", "seg."])
async def test_a_keyless_start_of_a_reserved_id_fails_typed_at_once_and_is_counted(world: World, prefix):
    keyless = await world.client(None)
    await world.refused(keyless, _id(prefix + "x"), START, "ReservedStreamId")
    await world.counted("ReservedStreamId")


async def test_a_principals_sealed_start_of_a_prefix_id_fails_typed_at_once_and_is_counted(world: World):
    alice = await world.client(world.stack.keyring.for_principal("alice"))
    wid = _id("pfx.y")
    await world.refused(alice, wid, OpenStreamInput(**START), "ReservedStreamId")
    # alice reads the refusal's type (in clear), though not its details (under the workers' key)
    with pytest.raises(WorkflowFailureError) as err:
        await alice.get_workflow_handle(wid).result()
    assert (err.value.cause.type, err.value.cause.non_retryable) == ("ReservedStreamId", True)
    await world.counted("ReservedStreamId")


async def test_the_operators_sealed_start_of_a_prefix_id_fails_typed_at_once_and_is_counted(world: World):
    """The prefix namespace is the workers' own: not even the operator's key starts a stream there
    (before, this one scheduled `open_stream`, and the activity refused it)."""
    await world.refused(world.stack.client, _id("pfx.z"), OpenStreamInput(**START), "ReservedStreamId")
    await world.counted("ReservedStreamId")


async def test_a_keyless_start_of_a_principals_id_fails_typed_at_once_and_is_counted(world: World):
    keyless = await world.client(None)
    wid = new_stream_id(world.stack.keyring.principal_tag("alice"))
    await world.refused(keyless, wid, START, "UnsealedRequest")
    await world.counted("UnsealedRequest")


async def test_a_start_under_a_key_the_workers_do_not_hold_fails_typed_at_once_and_is_counted(world: World):
    stranger = await world.client(Keyring.generate())  # another deployment's keys
    wid = new_stream_id(world.stack.keyring.principal_tag("alice"))
    await world.refused(stranger, wid, OpenStreamInput(**START), "UnknownKeyId")
    await world.counted("UnknownKeyId")
    world.meter.mark()
    # a prefix id is refused for what it is, whatever its input
    await world.refused(stranger, _id("pfx.u"), OpenStreamInput(**START), "ReservedStreamId")
    await world.counted("ReservedStreamId")


async def test_a_keyless_start_of_an_ordinary_id_fails_typed_at_once_and_is_counted(world: World):
    keyless = await world.client(None)
    await world.refused(keyless, _id("plain-"), START, "UnsealedRequest")
    await world.counted("UnsealedRequest")


async def test_an_agent_started_on_a_prefix_id_opens_no_stream(world: World):
    """No workflow's stream runs in the prefix namespace: a workflow that owns its stream (the
    example agent) fails typed where it opens it, before the open activity."""
    await world.refused(world.stack.client, _id("pfx.a"), ChatInput(**START), "ReservedStreamId",
                        workflow="ChatAgent")


async def test_a_stream_still_opens_and_serves_beside_the_refusals(world: World):
    keyless = await world.client(None)
    await world.refused(keyless, _id("pfx.x"), START, "ReservedStreamId")
    await world.counted("ReservedStreamId")
    streams = world.stack.streams
    sid = await streams.open("alice", "tiny-mamba2")
    out = await streams.advance(sid, "alice", tokens=[1, 2, 3])
    assert out.position == 3
    await streams.cancel(sid)
    assert world.meter.delta("mamba_stream_refused_requests") == 1


@pytest.mark.parametrize("how", ["another principal's key", "a weight of its own", "a level above the default"])
async def test_a_start_of_another_priority_than_its_principals_key_fails_typed_at_once_and_is_counted(
        world: World, how: str):
    """Issue 50: a stream's workflow tasks are dispatched by its start's priority, which the client
    sets. Alice's client, with her keys, starting her own stream under bob's fairness key would
    take bob's turns on the task queues; with a weight or a priority level of its own, everyone's.
    Refused at the first workflow task, typed, with nothing written; the details say what was
    given and what a stream's priority is ([level, fairness key, weight])."""
    ring = world.stack.keyring
    alice = await world.client(ring.for_principal("alice"))
    wid = new_stream_id(ring.principal_tag("alice"))
    own = stream_priority(wid)
    assert own.fairness_key == ring.principal_tag("alice")
    priority = {"another principal's key": Priority(fairness_key=ring.principal_tag("bob")),
                "a weight of its own": dataclasses.replace(own, fairness_weight=50.0),
                "a level above the default": dataclasses.replace(own, priority_key=DEFAULT_PRIORITY_LEVEL - 1)}[how]
    cause = await world.refused(alice, wid, OpenStreamInput(**START), "PriorityMismatch", priority=priority)
    details = cause.details[0]
    assert details["field"] == "priority" and details["expected"] == [DEFAULT_PRIORITY_LEVEL, own.fairness_key, None]
    assert details["actual"] == [priority.priority_key, priority.fairness_key, priority.fairness_weight]
    await world.counted("PriorityMismatch")


@pytest.mark.parametrize("priority", ["the stream's own", "none", "the bulk level"])
async def test_a_start_with_its_principals_key_or_none_opens(world: World, priority: str):
    """The control of the test above: the same start from alice's client, under her own key (as
    `StreamClient.open` sends it), with no priority at all, or at the bulk level below the default
    (where a worker moves a burst of streams, and continue-as-new keeps them), opens and serves."""
    ring = world.stack.keyring
    alice = await world.client(ring.for_principal("alice"))
    wid = new_stream_id(ring.principal_tag("alice"))
    given = {"the stream's own": stream_priority(wid), "none": Priority.default,
             "the bulk level": dataclasses.replace(stream_priority(wid), priority_key=BULK_PRIORITY_LEVEL)}[priority]
    await alice.start_workflow("MambaStream", OpenStreamInput(**START), id=wid, task_queue=world.stack.queue,
                               priority=given)
    streams = StreamClient(alice, task_queue=world.stack.queue)
    assert (await streams.advance(wid, "alice", tokens=[1, 2, 3])).position == 3
    assert (await alice.get_workflow_handle(wid).describe()).raw_description.workflow_execution_info.priority \
        .fairness_key == (given.fairness_key or "")
    await streams.cancel(wid)
    assert world.meter.delta("mamba_stream_refused_requests") == 0
