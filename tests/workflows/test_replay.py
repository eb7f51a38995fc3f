"""The replay pass every Temporal test ends with (conftest `replay`) catches workflow code that no
longer makes the decisions its history recorded."""

from __future__ import annotations

import time

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType

from mamba_stream.activities import StreamActivities
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import ModelStream
from mamba_stream.workflows._model_stream import LOCAL_PAUSE_CHUNKS
from tests.workflows.conftest import FAST, Stack, failed_tasks, histories, make_stack, replay
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_the_replay_pass_fails_when_the_code_takes_another_path_than_history(stack: Stack, monkeypatch):
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])  # short: a local activity (a marker)
    await stack.streams.advance(sid, "alice", tokens=[4])
    runs = await histories(stack.client, stack.queue)
    assert len(runs) == 1 and not failed_tasks(runs[0])
    assert await replay(stack.client, stack.queue, stack.keyring) == 1  # the code that recorded it replays it

    # the same history, replayed by code that would send these chunks the regular way
    original = ModelStream._run_chunk

    async def regular(self, name, arg, result_type, size, chunk_seq, *, local=True):
        return await original(self, name, arg, result_type, size, chunk_seq, local=False)

    monkeypatch.setattr(ModelStream, "_run_chunk", regular)
    with pytest.raises(AssertionError, match=r"does not replay.*[Nn]ondetermin"):
        await replay(stack.client, stack.queue, stack.keyring)
    monkeypatch.undo()  # the stack's own replay at exit runs the real code


class SlowLocally(StreamActivities):
    """A local attempt of chunk 2 outlives its deadline (a worker too loaded to run it in time)."""

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name == "admitted" and chunk_seq == 2 and activity.info().is_local:
            time.sleep(FAST.local_deadline_s + 0.5)


async def test_a_local_attempt_that_timed_out_replays_and_the_stream_goes_the_regular_way(temporal_env, tmp_path):
    """The nondeterminism seen under load (TMPRL1100 "Update machine does not handle this event:
    ActivityTaskScheduled"): live, the SDK hands a timed-out local activity over as an ActivityError
    wrapping a TimeoutError, and the workflow took the regular path; replayed from the marker it
    arrives as a bare TimeoutError, which the workflow did not catch, so the replay failed the
    update instead. Both shapes must take the regular path."""
    s = await make_stack(temporal_env, tmp_path, acts_cls=SlowLocally)
    async with s.exits:
        sid = await s.streams.open("alice", "tiny-mamba2", options=FAST)
        tokens = [[5, 6], [7, 8, 9], [10], [11, 12]]
        for t in tokens:
            last = await s.streams.advance(sid, "alice", tokens=t)
        stats = await s.streams.stats(sid)
        assert stats.local_fallbacks == 1 and stats.regular_until == 2 + LOCAL_PAUSE_CHUNKS
        assert stats.local_chunks == 1  # chunk 1; chunk 2 fell back, 3 and 4 were paused
        [run] = await histories(s.client, s.queue)
        assert not failed_tasks(run)
        markers = [e for e in run.events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                   and e.marker_recorded_event_attributes.marker_name == "core_local_activity"]
        assert len(markers) == 2  # chunk 1's, and chunk 2's timed-out attempt
        assert markers[1].marker_recorded_event_attributes.failure.HasField("timeout_failure_info")
        assert await replay(s.client, s.queue, s.keyring) == 1
        model = local("tiny-mamba2")
        truth = model.advance(model.initial_state(), [t for chunk in tokens for t in chunk])
        assert last.receipt.checksum == plaintext_checksum(truth.state.tensors)
