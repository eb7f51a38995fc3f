"""Bounded carry (Issue 15, finding 5): what crosses continue-as-new is bounded by bytes, so large
generates never make a run's first event too large for the server; older results cross as digests
and a repeated id is answered from the store's record."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from temporalio.client import WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment

from mamba_stream.workflows import StreamOptions
from tests.workflows.conftest import FAST, _start, eventually, make_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

BLOB_LIMIT = 40_000


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def small_blobs() -> AsyncIterator[WorkflowEnvironment]:
    """A server that refuses payloads over 40 kB (2 MiB by default) and suggests continue-as-new often."""
    env = await _start(["--dynamic-config-value", f"limit.blobSize.error={BLOB_LIMIT}",
                        "--dynamic-config-value", "limit.blobSize.warn=20000",
                        "--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=40"])
    yield env
    await env.shutdown()


async def _first_event_bytes(stack, sid: str) -> int:
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    started = events[0].workflow_execution_started_event_attributes
    return sum(len(p.data) for p in started.input.payloads)


async def test_large_generates_cross_continue_as_new_and_repeated_ids_are_still_answered(small_blobs, tmp_path):
    stack = await make_stack(small_blobs, tmp_path, backend="exact")
    async with stack.exits:
        sid, results = await _sixteen_generates(stack, carry_bytes=8192, checkpoints_kept=64)
        stats = await stack.streams.stats(sid)
        assert stats.chunks == 17 and stats.generated_tokens == 16 * 300
        # at most twice the carry's budget of results, plus the receipt, stats and options
        assert await _first_event_bytes(stack, sid) < 2 * 8192 + 8192
        # the oldest generate crossed as a digest: answered from its record, equal to the first answer
        again = await stack.streams.generate(sid, "alice", 300, seed=0, chunk_seq=2)
        assert again.duplicate and again.model_copy(update={"duplicate": False}) == results[0]
        newest = await stack.streams.generate(sid, "alice", 300, seed=15, chunk_seq=17)
        assert newest.model_copy(update={"duplicate": False}) == results[-1]
        # other content under a carried sequence is still a conflict
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await stack.streams.generate(sid, "alice", 300, seed=99, chunk_seq=2)
        assert err.value.cause.type == "ConflictingChunk"


async def test_a_repeated_id_whose_record_is_gone_is_refused_typed(small_blobs, tmp_path):
    stack = await make_stack(small_blobs, tmp_path, backend="exact")
    async with stack.exits:
        # digests of all 17 chunks fit the carry's second 8 kB (a 4 kB carry kept the newest dozen
        # or so: whether chunk 2's survived depended on where the continue-as-new fell, so the
        # answer was ResultExpired or, with the digest gone too, ChunkSequenceMismatch)
        sid, (first, *_) = await _sixteen_generates(stack, carry_bytes=8192, checkpoints_kept=2)
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await stack.streams.generate(sid, "alice", 300, seed=0, chunk_seq=first.chunk_seq)
        assert err.value.cause.type == "ResultExpired"
        nxt = await stack.streams.advance(sid, "alice", tokens=[1, 2])
        assert nxt.chunk_seq == 18


async def _sixteen_generates(stack, **options) -> tuple[str, list]:
    """A stream fed a prompt, then sixteen 300-token generates (about 4 kB of results each: 64 kB
    would not fit one payload), through at least two continue-as-new."""
    sid = await stack.streams.open("alice", "tiny-mamba2", options=StreamOptions(**{**FAST.model_dump(), **options}))
    await stack.streams.advance(sid, "alice", text="once upon a time")
    results = []
    for i in range(16):
        # a carry that does not fit fails the new run's workflow tasks: the stream would hang here
        results.append(await asyncio.wait_for(stack.streams.generate(sid, "alice", 300, seed=i), 30))
    await eventually(lambda: _continued(stack, sid, 2))
    return sid, results


async def _continued(stack, sid: str, n: int):
    s = await stack.streams.stats(sid)
    return s if s.continued_as_new >= n else None
