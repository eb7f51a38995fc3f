"""A client's chunk is one request when the client knows where its stream is (issue 44, item 3):
no stats query before the update; a wrong guess (another client's chunks came between, a reset)
is refused by the stream, storing nothing, and sent once more after asking; a chunk left in
flight (a Ctrl-C'd generate) is not a conflict for the next one that names no sequence."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest
from temporalio.client import (
    Client,
    Interceptor,
    OutboundInterceptor,
    QueryWorkflowInput,
    StartWorkflowUpdateInput,
)

from mamba_stream.workflows import StreamClient
from tests.workflows.conftest import Stack, eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")


class _Counting(Interceptor):
    """Counts the client's update and query requests, by kind."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        counting = self

        class _Out(OutboundInterceptor):
            async def start_workflow_update(self, input: StartWorkflowUpdateInput) -> Any:
                counting.calls[f"update {input.update}"] += 1
                return await super().start_workflow_update(input)

            async def query_workflow(self, input: QueryWorkflowInput) -> Any:
                counting.calls[f"query {input.query}"] += 1
                return await super().query_workflow(input)

        return _Out(next)


def _counted(stack: Stack) -> tuple[StreamClient, _Counting]:
    counting = _Counting()
    client = Client(**{**stack.client.config(), "interceptors": [counting]})
    return StreamClient(client, stack.queue), counting


async def test_a_warm_advance_is_one_update_and_a_stale_guess_is_sent_once_more(stack: Stack):
    mine, counting = _counted(stack)
    sid = await mine.open("alice", "tiny-mamba2")
    first = await mine.advance(sid, "alice", tokens=[1, 2, 3])
    assert first.chunk_seq == 1
    counting.calls.clear()
    second = await mine.advance(sid, "alice", tokens=[4, 5])
    assert second.chunk_seq == 2
    assert counting.calls == {"update advance": 1}  # warm: no stats query first

    # another client's chunk comes between: the guess (3) is taken, refused, and sent again as 4
    other = StreamClient(stack.client, stack.queue)
    assert (await other.advance(sid, "alice", tokens=[6])).chunk_seq == 3
    counting.calls.clear()
    third = await mine.advance(sid, "alice", tokens=[7, 8])
    assert third.chunk_seq == 4
    assert counting.calls == {"update advance": 2, "query stats": 1}
    stats = await mine.stats(sid)
    assert (stats.chunk_seq, stats.tokens) == (4, 8)  # each chunk once: nothing stored twice or lost

    # the same content as the chunk the other client committed under the guessed sequence would
    # be answered with that chunk's result: a reset makes the guess's epoch stale instead
    await other.reset(sid, "alice")

    async def reset_done() -> bool:
        return (await other.stats(sid)).epoch == 1

    await eventually(reset_done)
    counting.calls.clear()
    again = await mine.advance(sid, "alice", tokens=[9])
    assert again.receipt.epoch == 1 and again.receipt.position == 1
    assert counting.calls["update advance"] == 2 and counting.calls["query stats"] == 1


async def test_chunks_sent_together_go_one_after_another_without_asking(stack: Stack):
    mine, counting = _counted(stack)
    sid = await mine.open("alice", "tiny-mamba2")
    await mine.advance(sid, "alice", tokens=[1])
    counting.calls.clear()
    results = await asyncio.gather(*(mine.advance(sid, "alice", tokens=[t]) for t in (2, 3, 4)))
    assert sorted(r.chunk_seq for r in results) == [2, 3, 4]
    assert counting.calls == {"update advance": 3}
    assert (await mine.stats(sid)).tokens == 4


async def test_a_chunk_left_in_flight_is_not_a_conflict_for_the_next_one(stack: Stack):
    """After a Ctrl-C'd generate its chunk runs on; a new client (the CLI's next command) that
    names no sequence takes the one after it, and waits behind it."""
    mine = StreamClient(stack.client, stack.queue)
    sid = await mine.open("alice", "tiny-mamba2")
    await mine.advance(sid, "alice", tokens=[1, 2])
    long = asyncio.ensure_future(mine.generate(sid, "alice", 2000, seed=1))

    async def in_flight() -> bool:
        s = await mine.stats(sid)
        return (s.chunk_seq, s.next_seq) == (1, 3)

    await eventually(in_flight)  # chunk 2 in flight
    long.cancel()  # the caller leaves; the update goes on in the stream
    fresh = StreamClient(stack.client, stack.queue)
    assert await fresh.next_seq(sid) == 3
    after = await fresh.advance(sid, "alice", tokens=[5])
    assert after.chunk_seq == 3
    stats = await fresh.stats(sid)
    assert stats.chunk_seq == 3 and stats.generated_tokens >= 1
