"""Chunks as local activities: on the worker that holds the workflow (and the stream's hot state),
exactly once through every crash of that worker, the regular path for long chunks and for a
failed local attempt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType

from mamba_stream.activities import StreamActivities
from mamba_stream.state_codec.codec import plaintext_checksum
from tests.workflows.conftest import FAST, Stack, eventually, make_stack
from tests.workflows.test_stream_workflow import FailOnce, digest, local

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[2]


async def _events(stack: Stack, sid: str) -> list:
    return [e async for e in stack.client.get_workflow_handle(sid).fetch_history_events()]


def _activities_scheduled(events: list) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


def _local_markers(events: list) -> int:
    return sum(1 for e in events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
               and e.marker_recorded_event_attributes.marker_name == "core_local_activity")


async def test_short_chunks_run_locally_long_ones_take_the_regular_path(stack: Stack):
    model = local("tiny-mamba2")
    tokens = list(range(1, 41))
    opts = FAST.model_copy(update={"local_max_tokens": 8})
    sid = await stack.streams.open("alice", "tiny-mamba2", options=opts)
    results = []
    for piece in (tokens[:3], tokens[3:4], tokens[4:20], tokens[20:28], tokens[28:]):
        results.append(await stack.streams.advance(sid, "alice", tokens=piece))
    gen = await stack.streams.generate(sid, "alice", 6, seed=3, temperature=0.8)  # 6 <= 8: local
    long_gen = await stack.streams.generate(sid, "alice", 9, seed=4, temperature=0.8)  # 9 > 8: regular
    truth = model.advance(model.initial_state(), tokens + gen.tokens + long_gen.tokens)
    assert [r.n_tokens for r in results] == [3, 1, 16, 8, 12]
    assert results[2].output_digest == digest(truth.logits[4:20])
    assert long_gen.receipt.checksum == plaintext_checksum(truth.state.tensors)
    stats = await stack.streams.stats(sid)
    assert (stats.local_chunks, stats.local_fallbacks, stats.chunks) == (4, 0, 7)
    events = await _events(stack, sid)
    scheduled = _activities_scheduled(events)
    # open, then the 16- and 12-token advances and the 9-token generate; the rest are markers
    assert scheduled == ["open_stream", "advance_chunk", "advance_chunk", "generate_tokens"]
    assert _local_markers(events) == 4


class FailLocallyOnce(FailOnce):
    """A local attempt of chunk 2 fails after `edge` (a bug, a lost disk, nobody knows): once."""

    edge = "written"

    def _fails_here(self) -> bool:
        from temporalio import activity

        return activity.info().is_local


class FailLocallyAfterRecord(FailLocallyOnce):
    edge = "recorded"


@pytest.mark.parametrize("cls", [FailLocallyOnce, FailLocallyAfterRecord], ids=["after-write", "after-record"])
async def test_a_failed_local_attempt_takes_the_regular_path_and_commits_once(temporal_env, tmp_path, cls):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=cls)
    async with stack.exits:
        model = local("tiny-mamba2")
        tokens = list(range(60, 90))
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        results = [await stack.streams.advance(sid, "alice", tokens=tokens[i : i + 10]) for i in (0, 10, 20)]
        truth = model.advance(model.initial_state(), tokens)
        assert stack.acts.failed == {2}
        assert results[1].output_digest == digest(truth.logits[10:20])
        assert results[-1].receipt.checksum == plaintext_checksum(truth.state.tensors)
        stats = await stack.streams.stats(sid)
        assert (stats.local_chunks, stats.local_fallbacks, stats.chunks) == (2, 1, 3)
        if cls is FailLocallyAfterRecord:
            assert stack.acts.runs[2] == 1  # the regular attempt found the record: no second advance
        keys = stack.acts.store.list_stream(stream_id=sid)
        assert sum(1 for k in keys if ".c2." in k and not k.endswith(".out")) == 1
        assert _activities_scheduled(await _events(stack, sid)) == ["open_stream", "advance_chunk"]


@pytest.mark.parametrize("edge", ["computed", "written", "recorded", "returned"])
async def test_worker_killed_at_a_local_commit_edge_another_worker_finishes(temporal_env, tmp_path, edge):
    """SIGKILL of the worker that holds the workflow and runs its chunk locally: (a) after the
    kernel, (b) after the checkpoint write, (c) after the result record, (d) after the local
    activity returned to the workflow, before the workflow task that records it completes."""
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        keyfile, ready = tmp_path / "keyring.json", tmp_path / "ready"
        stack.keyring.save(keyfile)
        proc = subprocess.Popen([sys.executable, "-m", "tests.workflows._crash_worker", stack.address, stack.queue,
                                 stack.store_url, str(keyfile), edge, "2", str(ready), "local"], cwd=ROOT)
        try:
            await eventually(lambda: _exists(ready), timeout=90)
            model = local("tiny-mamba2")
            tokens = list(range(100, 130))
            sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
            r1 = await stack.streams.advance(sid, "alice", tokens=tokens[:10])  # the doomed worker holds it
            assert (await stack.streams.stats(sid)).local_chunks == 1
            rescuer = await stack.worker()  # workflows and activities, as every worker is
            r2 = await stack.streams.advance(sid, "alice", tokens=tokens[10:20])  # the doomed worker dies
            assert proc.wait(timeout=30) == -9
            r3 = await stack.streams.advance(sid, "alice", tokens=tokens[20:])
            truth = model.advance(model.initial_state(), tokens)
            assert r1.output_digest == digest(truth.logits[:10])
            assert r2.output_digest == digest(truth.logits[10:20]) and r2.position == 20
            assert r3.receipt.position == 30
            assert r3.receipt.checksum == plaintext_checksum(truth.state.tensors)
            stats = await stack.streams.stats(sid)
            assert stats.chunks == 3 and stats.chunk_seq == 3 and stats.local_chunks == 3
            assert rescuer.metrics.migration_count >= 1  # the rescuer did not hold the state: it read it
            keys = stack.acts.store.list_stream(stream_id=sid)
            assert sum(1 for k in keys if ".c2." in k and not k.endswith(".out")) == 1
            events = await _events(stack, sid)
            assert _local_markers(events) == 3  # chunk 2 recorded once, by the rescuer
            assert _activities_scheduled(events) == ["open_stream"]
        finally:
            if proc.poll() is None:
                proc.kill()


async def _exists(path: Path) -> bool:
    return path.exists()


class BusyEngine(StreamActivities):
    """An engine that reports a pace at which no chunk fits a local attempt (a saturated worker)."""

    def engine(self, model):
        eng = super().engine(model)
        eng.expected_seconds = lambda rounds: 60.0 * rounds
        return eng


async def test_a_busy_engine_declines_local_attempts_and_the_chunk_goes_the_regular_way(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=BusyEngine)
    async with stack.exits:
        model = local("tiny-mamba2")
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        r = await stack.streams.advance(sid, "alice", tokens=[4, 5, 6])
        g = await stack.streams.generate(sid, "alice", 3, seed=9)
        truth = model.advance(model.initial_state(), [4, 5, 6, *g.tokens])
        assert r.output_digest == digest(truth.logits[:3])
        assert g.receipt.checksum == plaintext_checksum(truth.state.tensors)
        stats = await stack.streams.stats(sid)
        assert (stats.local_chunks, stats.local_fallbacks, stats.chunks) == (0, 2, 2)
        events = await _events(stack, sid)
        assert _activities_scheduled(events) == ["open_stream", "advance_chunk", "generate_tokens"]
        assert _local_markers(events) == 2  # the declines, recorded


async def test_a_chunks_own_permanent_failure_on_the_local_path_is_final(stack: Stack):
    """A local attempt that fails for the chunk's own reason (its input checkpoint is gone:
    `CheckpointNotFound`, non-retryable) is the chunk's answer: it is not run again on the worker
    queue or the shared one, the stream keeps its worker binding, and nothing is lost: with the
    checkpoint back, the next chunk commits as if nothing had failed."""
    from temporalio.client import WorkflowUpdateFailedError

    model = local("tiny-mamba2")
    sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
    first = await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
    key = first.receipt.state_key
    blob = stack.acts.store.get(key=key, owner=stack.acts.commits.owner("alice"))
    before = await stack.streams.stats(sid)
    assert before.local_chunks == 1 and before.migrations == 0
    stack.acts.store.delete(key=key, stream_id=sid, owner=stack.acts.commits.owner("alice"))
    stack.acts.release_stream(sid)  # the next chunk must fetch the lost checkpoint
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await stack.streams.advance(sid, "alice", tokens=[4, 5])
    assert err.value.cause.type == "CheckpointNotFound"
    stats = await stack.streams.stats(sid)
    assert (stats.local_fallbacks, stats.migrations, stats.local_chunks, stats.chunk_seq) == (0, 0, 1, 1), stats
    events = await _events(stack, sid)
    assert _activities_scheduled(events) == ["open_stream"]  # the chunks ran locally, and only there
    assert _local_markers(events) == 2
    stack.acts.store.put_if_absent(key=key, data=blob, stream_id=sid, owner=stack.acts.commits.owner("alice"))
    # (other tokens: the same request again is the same update, whose outcome is the failure)
    again = await stack.streams.advance(sid, "alice", tokens=[4, 6])
    truth = model.advance(model.initial_state(), [1, 2, 3, 4, 6])
    assert again.chunk_seq == 2 and again.output_digest == digest(truth.logits[3:])
    assert again.receipt.checksum == plaintext_checksum(truth.state.tensors)
    stats = await stack.streams.stats(sid)
    assert (stats.local_fallbacks, stats.migrations, stats.local_chunks) == (0, 0, 2)
    assert _activities_scheduled(await _events(stack, sid)) == ["open_stream"]
