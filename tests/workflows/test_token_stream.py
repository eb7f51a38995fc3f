"""Tokens as they are made: a streaming generate publishes to the stream's token log while it runs;
readers get each chunk's tokens once, in order, from any offset, across continue-as-new; the
commit is the same chunk, whole, as without streaming."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowUpdateFailedError

from activities._stream import StreamActivities
from state_codec.codec import plaintext_checksum
from tests.workflows.conftest import FAST, Stack, make_stack
from tests.workflows.test_stream_workflow import local, reason
from workflows import StreamOptions, TokenEvent

pytestmark = pytest.mark.asyncio(loop_scope="session")


class SlowSampling(StreamActivities):
    """Each decode step takes a while, so a reader sees the chunk's tokens before it commits."""

    step_s = 0.02

    def engine(self, model):
        eng = super().engine(model)
        if not getattr(eng, "_slowed", False):
            inner = eng.slots.step

            def step(handles, tokens):
                import time

                time.sleep(self.step_s)
                return inner(handles, tokens)

            eng.slots.step = step
            eng._slowed = True
        return eng


def _tokens(events: list[TokenEvent]) -> list[int]:
    out: list[int] = []
    for ev in events:
        if ev.restart:
            out = []
        out.extend(ev.tokens)
    return out


async def test_a_reader_gets_the_tokens_while_generate_runs_and_reconnects_from_an_offset(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=SlowSampling)
    async with stack.exits:
        model = local("tiny-mamba3")
        sid = await stack.streams.open("alice", "tiny-mamba3", options=FAST)
        prompt = await stack.streams.advance(sid, "alice", text="Once upon a time")
        gen = stack.streams.generate_stream(sid, "alice", 40, seed=7, temperature=0.9, top_k=20)
        events: list[TokenEvent] = []
        committed_before: list[int] = []
        async for ev in gen:
            events.append(ev)
            # the chunk is not committed while its tokens arrive (presentation never commits)
            committed_before.append((await stack.streams.stats(sid)).chunk_seq)
        result = gen.result
        assert result is not None and len(result.tokens) == 40
        assert _tokens(events) == result.tokens and not any(e.restart for e in events)
        assert [e.index for e in events] == [sum(len(x.tokens) for x in events[:i]) for i in range(len(events))]
        assert events[-1].done and events[-1].finish_reason == "length" and not any(e.done for e in events[:-1])
        assert len(events) >= 4  # published in pieces while it ran, not only at the end
        assert committed_before[0] == 1  # the first tokens came while chunk 2 ran
        assert "".join(e.text or "" for e in events) == result.text
        offsets = [e.offset for e in events]
        assert offsets == sorted(set(offsets))
        # the same chunk as a generate that does not stream: same tokens, same state
        truth = model.advance(model.initial_state(), model.transform.encode("Once upon a time") + result.tokens)
        assert result.receipt.checksum == plaintext_checksum(truth.state.tensors)
        assert result.position == prompt.position + 40
        sid2 = await stack.streams.open("alice", "tiny-mamba3", options=FAST)
        await stack.streams.advance(sid2, "alice", text="Once upon a time")
        plain = await stack.streams.generate(sid2, "alice", 40, seed=7, temperature=0.9, top_k=20)
        assert plain.tokens == result.tokens and plain.receipt.checksum == result.receipt.checksum
        # a reader that subscribes late, from the start, and one that reconnects from the middle
        late = []
        async for ev in stack.streams.tokens(sid, from_offset=0, chunk_seq=2):
            late.append(ev)
            if ev.done:
                break
        assert late == events
        cut = events[len(events) // 2].offset
        again = []
        async for ev in stack.streams.tokens(sid, from_offset=cut, chunk_seq=2):
            again.append(ev)
            if ev.done:
                break
        assert again == events[len(events) // 2:]
        # the same chunk sent again streams its committed tokens, once (the server answers the id)
        dup = stack.streams.generate_stream(sid, "alice", 40, seed=7, temperature=0.9, top_k=20, chunk_seq=2)
        got = [ev async for ev in dup]
        assert _tokens(got) == result.tokens and dup.result == result
        assert (await stack.streams.stats(sid)).chunks == 2


async def test_a_reader_of_every_chunk_sees_unstreamed_generates_whole_and_advances_nothing(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", tokens=[5, 6, 7])
    start = await stack.streams.token_offset(sid)

    async def read(n: int) -> list[TokenEvent]:
        out = []
        async for ev in stack.streams.tokens(sid, from_offset=start):
            out.append(ev)
            if sum(e.done for e in out) == n:
                return out
        return out

    reader = asyncio.ensure_future(read(2))
    a = await stack.streams.generate(sid, "alice", 5, seed=1)  # local, not streamed: one entry
    await stack.streams.advance(sid, "alice", tokens=[8])
    b = await stack.streams.generate(sid, "alice", 3, seed=2)
    got = await asyncio.wait_for(reader, 20)
    assert [(e.chunk_seq, e.tokens, e.done) for e in got] == [(2, a.tokens, True), (4, b.tokens, True)]
    assert [e.offset for e in got] == [start, start + 1]


async def test_a_refused_streaming_generate_raises_and_its_reader_stops(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2", options=StreamOptions(max_generate_tokens=8))
    gen = stack.streams.generate_stream(sid, "alice", 4)
    with pytest.raises(WorkflowUpdateFailedError) as exc:
        async for _ in gen:
            pass
    assert reason(exc.value) == "EmptyContext"
    await stack.streams.advance(sid, "alice", tokens=[1, 2])
    too_many = stack.streams.generate_stream(sid, "alice", 9)
    with pytest.raises(WorkflowUpdateFailedError) as exc:
        async for _ in too_many:
            pass
    assert reason(exc.value) == "ChunkTooLarge"
    assert (await stack.streams.stats(sid)).chunk_seq == 1


async def test_a_cancelled_stream_closes_its_token_stream(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=SlowSampling)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        await stack.streams.advance(sid, "alice", tokens=[3, 4, 5])
        gen = stack.streams.generate_stream(sid, "alice", 400, seed=3)
        seen: list[TokenEvent] = []

        async def read() -> None:
            async for ev in gen:
                seen.append(ev)

        task = asyncio.ensure_future(read())
        while not seen:
            await asyncio.sleep(0.01)
        await stack.streams.cancel(sid, wait=False)
        with pytest.raises(WorkflowUpdateFailedError) as exc:
            await asyncio.wait_for(task, 30)
        assert reason(exc.value) == "StreamCancelled"
        assert 0 < len(_tokens(seen)) < 400
        # a reader of the cancelled stream ends, it does not wait
        rest = [ev async for ev in stack.streams.tokens(sid, from_offset=0)]
        assert all(ev.chunk_seq == 2 for ev in rest)


async def test_the_token_log_crosses_continue_as_new_and_readers_follow_it(can_env, tmp_path):
    stack = await make_stack(can_env, tmp_path)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        await stack.streams.advance(sid, "alice", tokens=[9, 8, 7])
        got: list[TokenEvent] = []

        async def read_all(n: int) -> None:
            async for ev in stack.streams.tokens(sid, from_offset=0):
                got.append(ev)
                if sum(e.done for e in got) == n:
                    return

        reader = asyncio.ensure_future(read_all(8))
        results = []
        for i in range(8):
            if i % 2:
                gen = stack.streams.generate_stream(sid, "alice", 12, seed=i)
                async for _ in gen:
                    pass
                results.append(gen.result)
            else:
                results.append(await stack.streams.generate(sid, "alice", 12, seed=i))
        await asyncio.wait_for(reader, 60)
        assert (await stack.streams.stats(sid)).continued_as_new >= 2
        by_chunk: dict[int, list[TokenEvent]] = {}
        for ev in got:
            by_chunk.setdefault(ev.chunk_seq, []).append(ev)
        assert [_tokens(by_chunk[r.chunk_seq]) for r in results] == [r.tokens for r in results]
        assert [e.offset for e in got] == list(range(len(got)))  # each entry once, in order, none lost


async def test_the_token_log_is_bounded_within_a_run_and_across_continue_as_new(can_env, tmp_path):
    stack = await make_stack(can_env, tmp_path)
    async with stack.exits:
        opts = FAST.model_copy(update={"carry_bytes": 4096, "token_log_events": 5})
        sid = await stack.streams.open("alice", "tiny-mamba2", options=opts)
        await stack.streams.advance(sid, "alice", tokens=[9, 8, 7])
        results = [await stack.streams.generate(sid, "alice", 40, seed=i) for i in range(10)]
        assert (await stack.streams.stats(sid)).continued_as_new >= 2
        now = await stack.streams.read_tokens(sid, from_offset=0)
        # one entry per unstreamed generate: the newest ones are kept, the oldest are gone
        assert now.next_offset == len(results) and now.base_offset > 0
        assert 1 <= len(now.events) <= 5 and now.events[0].offset == now.base_offset
        assert [e.tokens for e in now.events] == [r.tokens for r in results[now.base_offset:]]


async def test_a_streamed_generate_after_a_reset_it_did_not_see_is_sent_again_under_the_new_epoch(stack: Stack):
    from workflows import StreamClient

    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])  # this client now knows epoch 0
    other = StreamClient(stack.client, stack.queue)
    await other.reset(sid, "alice")
    for _ in range(200):
        if (await other.stats(sid)).epoch == 1:
            break
        await asyncio.sleep(0.02)
    await other.advance(sid, "alice", tokens=[4, 5])
    gen = stack.streams.generate_stream(sid, "alice", 6, seed=5)
    events = [ev async for ev in gen]
    assert gen.result.receipt.epoch == 1 and _tokens(events) == gen.result.tokens and len(gen.result.tokens) == 6
    assert events[-1].done and (await stack.streams.stats(sid)).generated_tokens == 6
