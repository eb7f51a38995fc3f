"""A reset signal from the wrong principal changes nothing and never reaches a worker (Issue 19,
mutant 6). The reset activity refuses a wrong principal too, so the state would be safe without
the workflow's own check; this is defence in depth, seen in history: no reset activity is
scheduled, neither as a regular activity nor as a local one (`advance`/`generate` may become
local activities, and reset with them)."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from mamba_stream.workflows._models import ResetRequest
from mamba_stream.workflows._stream import MambaStreamWorkflow
from mamba_stream.workflows.contract import ACTIVITY_RESET
from tests.workflows.conftest import Stack, eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

#: the marker the Temporal SDK core records for a local activity's result
LOCAL_ACTIVITY_MARKER = "core_local_activity"


async def _events(handle: WorkflowHandle) -> list[HistoryEvent]:
    return [e async for e in handle.fetch_history_events()]


async def activities_named(client: Client, events: list[HistoryEvent], name: str) -> list[tuple[int, str]]:
    """(event id, "scheduled" | "local") of every activity called `name` in the history: regular
    ones by their ActivityTaskScheduled event, local ones by their marker, whose `data` payload
    names the activity type (JSON written by the SDK core; run through the codec in case a
    later SDK encodes it)."""
    found = []
    for e in events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            if e.activity_task_scheduled_event_attributes.activity_type.name == name:
                found.append((e.event_id, "scheduled"))
        elif e.HasField("marker_recorded_event_attributes"):
            attrs = e.marker_recorded_event_attributes
            if attrs.marker_name != LOCAL_ACTIVITY_MARKER or "data" not in attrs.details:
                continue
            payloads = list(attrs.details["data"].payloads)
            codec = client.data_converter.payload_codec
            if codec is not None:
                payloads = await codec.decode(payloads)
            for p in payloads:
                data = json.loads(p.data)
                if name in (data.get("activity_type"), data.get("activityType")):
                    found.append((e.event_id, "local"))
    return found


# --- the detector sees a real local activity ----------------------------------------------------


@activity.defn(name=ACTIVITY_RESET)
async def _stand_in_reset(stream_id: str) -> str:
    return stream_id


@workflow.defn(name="Issue19LocalResetProbe")
class _LocalResetProbe:
    @workflow.run
    async def run(self, stream_id: str) -> str:
        return await workflow.execute_local_activity(
            ACTIVITY_RESET, stream_id, result_type=str, start_to_close_timeout=timedelta(seconds=10))


async def test_a_reset_run_as_a_local_activity_is_found_in_history(stack: Stack):
    """The marker branch of the detector on a real history, so that it cannot silently find
    nothing: a stand-in activity named like the reset activity, run as a local activity."""
    client = await Client.connect(stack.address)
    queue = f"{stack.queue}-probe"
    async with Worker(client, task_queue=queue, workflows=[_LocalResetProbe], activities=[_stand_in_reset],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        wid = f"probe-{uuid.uuid4().hex[:10]}"
        assert await client.execute_workflow(_LocalResetProbe.run, "s-1", id=wid, task_queue=queue) == "s-1"
    events = await _events(client.get_workflow_handle(wid))
    found = await activities_named(client, events, ACTIVITY_RESET)
    assert [kind for _, kind in found] == ["local"]
    assert await activities_named(client, events, "advance_chunk") == []


# --- the stream --------------------------------------------------------------------------------


async def test_a_reset_from_another_principal_schedules_no_reset_activity(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2")
    before = await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
    handle = stack.streams.handle(sid)

    await handle.signal(MambaStreamWorkflow.reset, ResetRequest(principal="mallory"))
    stats = await eventually(lambda: _rejected(stack, sid, 1))
    assert (stats.epoch, stats.resets, stats.position, stats.chunk_seq) == (0, 0, 3, 1)
    assert await handle.query(MambaStreamWorkflow.receipt) == before.receipt
    events = await _events(handle)
    assert any(e.HasField("workflow_execution_signaled_event_attributes") for e in events)  # it did arrive
    assert await activities_named(stack.client, events, ACTIVITY_RESET) == []

    # the owner's reset, the control: the same detector sees its activity, exactly one
    await stack.streams.reset(sid, "alice")
    stats = await eventually(lambda: _epoch(stack, sid, 1))
    assert (stats.resets, stats.rejected_resets, stats.position) == (1, 1, 0)
    found = await activities_named(stack.client, await _events(handle), ACTIVITY_RESET)
    assert [kind for _, kind in found] == ["scheduled"]


async def _rejected(stack: Stack, sid: str, n: int):
    s = await stack.streams.stats(sid)
    return s if s.rejected_resets >= n else None


async def _epoch(stack: Stack, sid: str, epoch: int):
    s = await stack.streams.stats(sid)
    return s if s.epoch == epoch else None
