"""Issue 15's findings, against the real dev server: nothing a caller or a fault does leaves a
stream that can never make progress, or a chunk silently dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.client import WorkflowUpdateFailedError

from mamba_stream.activities import StoreUnavailable, StreamActivities
from mamba_stream.activities._guards import UNTYPED_ATTEMPTS
from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import GenerateRequest
from tests.workflows.conftest import FAST, Stack, eventually, make_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")


def reason(exc: BaseException) -> str | None:
    return getattr(getattr(exc, "cause", None), "type", None)


async def accepted_updates(stack: Stack, sid: str) -> int:
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    return sum(1 for e in events if e.HasField("workflow_execution_update_accepted_event_attributes"))


async def test_two_writers_of_one_sequence_with_other_content_one_is_refused_typed(stack: Stack):
    """Finding 3: both writers were told `chunk_seq 2, duplicate=false`; one chunk was never applied."""
    model = load_model("tiny-mamba2", backend="reference")
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", tokens=[1, 2], chunk_seq=1)
    outs = await asyncio.gather(stack.streams.advance(sid, "alice", tokens=[3, 4, 5], chunk_seq=2),
                                stack.streams.advance(sid, "alice", tokens=[6], chunk_seq=2), return_exceptions=True)
    won = [o for o in outs if not isinstance(o, BaseException)]
    lost = [o for o in outs if isinstance(o, BaseException)]
    assert len(won) == 1 and len(lost) == 1, outs
    assert isinstance(lost[0], WorkflowUpdateFailedError) and reason(lost[0]) == "ConflictingChunk"
    applied = [3, 4, 5] if won[0].n_tokens == 3 else [6]
    truth = model.advance(model.initial_state(), [1, 2, *applied])
    assert won[0].receipt.checksum == plaintext_checksum(truth.state.tensors)
    # the loser's chunk is refused, not lost silently: sent again it is still refused, and the stream goes on
    loser = [6] if applied == [3, 4, 5] else [3, 4, 5]
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await stack.streams.advance(sid, "alice", tokens=loser, chunk_seq=2)
    assert reason(err.value) == "ConflictingChunk"
    nxt = await stack.streams.advance(sid, "alice", tokens=loser)
    assert nxt.chunk_seq == 3
    full = model.advance(model.initial_state(), [1, 2, *applied, *loser])
    assert nxt.receipt.checksum == plaintext_checksum(full.state.tensors)


@pytest.mark.parametrize("body", [
    {"principal": "alice", "chunk_seq": 2, "tokens": ["7"]},
    {"principal": "alice", "chunk_seq": 2, "tokens": [True]},
    {"principal": "alice", "chunk_seq": True, "tokens": [7]},
    {"principal": "alice", "chunk_seq": 2, "tokens": [7], "top_k": 5.5},
    {"principal": "alice", "chunk_seq": 2 ** 70, "tokens": [7]},
], ids=["string-token", "bool-token", "bool-seq", "float-top-k", "huge-seq"])
async def test_coerced_input_is_refused_typed_and_non_retryable(temporal_env, tmp_path, body):
    """Finding 4: "tokens": ["7"], [true] and "chunk_seq": true were accepted."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2")
        await stack.streams.advance(sid, "alice", tokens=[1], chunk_seq=1)
        before = await accepted_updates(stack, sid)
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await stack.streams.handle(sid).execute_update("advance", _Json(body), id="raw-1")
        assert reason(err.value) == "InvalidRequest" and err.value.cause.non_retryable
        assert await accepted_updates(stack, sid) == before
        assert (await stack.streams.stats(sid)).position == 1


class _Json(dict):
    """A plain dict: the pydantic converter writes it as the JSON it is, coercible values and all."""


async def test_an_out_of_range_seed_is_refused_before_history_and_the_stream_goes_on(stack: Stack):
    """Finding 4: seed=2**70 raised an untyped ValueError in torch, retried without limit."""
    with pytest.raises(ValidationError):  # the client refuses to build it
        GenerateRequest(principal="alice", chunk_seq=2, max_tokens=2, seed=2 ** 70)
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", tokens=[1, 2], chunk_seq=1)
    before = await accepted_updates(stack, sid)
    raw = {"principal": "alice", "chunk_seq": 2, "max_tokens": 2, "seed": 2 ** 70}
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await stack.streams.handle(sid).execute_update("generate", _Json(raw), id="raw-seed")
    assert reason(err.value) == "InvalidRequest" and err.value.cause.non_retryable
    assert await accepted_updates(stack, sid) == before
    out = await stack.streams.generate(sid, "alice", 2, seed=2 ** 63 - 1)
    assert out.chunk_seq == 2 and len(out.tokens) == 2


class BuggyOnce(StreamActivities):
    """Chunk 2 fails with an exception nobody foresaw until `fixed`."""

    fixed = False
    attempts = 0

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name == "admitted" and chunk_seq == 2 and not type(self).fixed:
            type(self).attempts += 1
            raise RuntimeError("a sampler bug")


async def test_an_untyped_failure_fails_the_chunk_typed_after_bounded_attempts_and_the_next_attempt_passes(
        temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=BuggyOnce)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        await stack.streams.advance(sid, "alice", tokens=[1, 2], chunk_seq=1)
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await asyncio.wait_for(stack.streams.generate(sid, "alice", 2, seed=5), 60)
        assert reason(err.value) == "InternalError" and "a sampler bug" in err.value.cause.message
        # a local try, one on the worker holding the state's queue, then the shared queue's bounded attempts
        assert BuggyOnce.attempts == 2 + UNTYPED_ATTEMPTS
        assert (await stack.streams.stats(sid)).local_fallbacks == 1
        # the failed id keeps its failure; the same chunk as a next attempt goes through once fixed
        BuggyOnce.fixed = True
        with pytest.raises(WorkflowUpdateFailedError):
            await stack.streams.generate(sid, "alice", 2, seed=5)
        out = await stack.streams.generate(sid, "alice", 2, seed=5, attempt=1)
        assert out.chunk_seq == 2 and (await stack.streams.stats(sid)).position == 4


class StoreDown(StreamActivities):
    """Every advance meets a store that is down: retried, forever, behind the stream's lock."""

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name == "admitted":
            raise StoreUnavailable("the store is down")


async def test_cancel_completes_within_seconds_while_a_handler_is_stuck(temporal_env, tmp_path):
    """Finding 4: `temporal workflow cancel` never completed behind a retrying activity."""
    stack = await make_stack(temporal_env, tmp_path, acts_cls=StoreDown)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        root = Path(stack.store_url.removeprefix("file://"))
        assert stack.acts.store.list_stream(stream_id=sid)
        stuck = asyncio.create_task(stack.streams.advance(sid, "alice", tokens=[1, 2], chunk_seq=1))
        await eventually(lambda: _attempts(stack, sid, 2))
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(stack.streams.cancel(sid), 20)
        assert asyncio.get_running_loop().time() - t0 < 10
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await asyncio.wait_for(stuck, 10)
        assert reason(err.value) == "StreamCancelled"
        assert stack.acts.store.list_stream(stream_id=sid) == []
        assert (await stack.streams.handle(sid).describe()).status.name == "CANCELED"
        assert root.exists()


async def _attempts(stack: Stack, sid: str, n: int) -> bool:
    desc = await stack.streams.handle(sid).describe()
    return any(a.attempt >= n for a in desc.raw_description.pending_activities)
