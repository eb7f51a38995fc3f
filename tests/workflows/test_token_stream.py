"""Tokens as they are made: a streaming generate's activity heartbeats its newest tokens, and readers
poll them (`describe`) beside the committed token log (a query). Readers get each chunk's tokens
once, in order, from any offset, across continue-as-new; the commit is the same chunk, whole, as
without streaming. Readers write no history and hold no update, so any number of them blocks
nothing; no caller but the workers adds to a stream's tokens, and only its principal (and the
operator) reads them."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from mamba_stream.activities import StreamActivities
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.state_codec.payload import ENCRYPTED_ENCODING, sealed_for_stream
from mamba_stream.workflows import StreamClient, StreamOptions, TokenEvent, TokenProgress
from tests.workflows.conftest import FAST, Stack, eventually, make_stack
from tests.workflows.test_stream_workflow import local, reason

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


class CountingStreams(StreamClient):
    """A StreamClient that counts its readers' looks at a running generate and reads of the log."""

    polls = 0
    reads = 0

    async def progress(self, stream_id, desc=None):
        self.polls += 1
        return await super().progress(stream_id, desc)

    async def read_tokens(self, stream_id, **kw):
        self.reads += 1
        return await super().read_tokens(stream_id, **kw)


def _tokens(events: list[TokenEvent]) -> list[int]:
    out: list[int] = []
    for ev in events:
        if ev.restart:
            out = []
        out.extend(ev.tokens)
    return out


async def _events(stack: Stack, sid: str) -> list:
    return [e async for e in stack.streams.handle(sid).fetch_history_events()]


async def _length(stack: Stack, sid: str) -> int:
    return (await stack.streams.handle(sid).describe()).history_length


def _accepted(events) -> list[str]:
    """The ids of the updates a history accepted."""
    return [e.workflow_execution_update_accepted_event_attributes.accepted_request.meta.update_id
            for e in events if e.HasField("workflow_execution_update_accepted_event_attributes")]


def _signals(events) -> list[str]:
    return [e.workflow_execution_signaled_event_attributes.signal_name
            for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED]


async def _collect(it, out: list[TokenEvent], dones: int) -> None:
    async for ev in it:
        out.append(ev)
        if sum(e.done for e in out) == dones:
            return


def _one_chunk_in_order(events: list[TokenEvent], tokens: list[int], text: str | None) -> None:
    """`events` are one chunk's: its tokens once, in order, from index 0, the last one done."""
    assert not any(e.restart for e in events)
    assert [e.index for e in events] == [sum(len(x.tokens) for x in events[:i]) for i in range(len(events))]
    assert _tokens(events) == tokens and "".join(e.text or "" for e in events) == (text or "")
    assert events[-1].done and not any(e.done for e in events[:-1])


async def test_a_reader_gets_the_tokens_while_generate_runs_and_reconnects_from_an_offset(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=SlowSampling)
    async with stack.exits:
        model = local("tiny-mamba3")
        sid = await stack.streams.open("alice", "tiny-mamba3", options=FAST)
        prompt = await stack.streams.advance(sid, "alice", text="Once upon a time")
        at = await stack.streams.token_offset(sid)
        gen = stack.streams.generate_stream(sid, "alice", 40, seed=7, temperature=0.9, top_k=20)
        events: list[TokenEvent] = []
        committed_before: list[int] = []
        async for ev in gen:
            events.append(ev)
            # the chunk is not committed while its tokens arrive (presentation never commits)
            committed_before.append((await stack.streams.stats(sid)).chunk_seq)
        result = gen.result
        assert result is not None and len(result.tokens) == 40
        _one_chunk_in_order(events, result.tokens, result.text)
        assert events[-1].finish_reason == "length"
        assert len(events) >= 4  # shown in pieces while it ran, not only at the end
        assert committed_before[0] == 1  # the first tokens came while chunk 2 ran
        assert {e.offset for e in events} == {at}  # the log entry the chunk took
        # the same chunk as a generate that does not stream: same tokens, same state
        truth = model.advance(model.initial_state(), model.transform.encode("Once upon a time") + result.tokens)
        assert result.receipt.checksum == plaintext_checksum(truth.state.tensors)
        assert result.position == prompt.position + 40
        sid2 = await stack.streams.open("alice", "tiny-mamba3", options=FAST)
        await stack.streams.advance(sid2, "alice", text="Once upon a time")
        plain = await stack.streams.generate(sid2, "alice", 40, seed=7, temperature=0.9, top_k=20)
        assert plain.tokens == result.tokens and plain.receipt.checksum == result.receipt.checksum
        # a reader that subscribes late, from the chunk's offset: the committed chunk, whole
        late: list[TokenEvent] = []
        await asyncio.wait_for(_collect(stack.streams.tokens(sid, from_offset=at, chunk_seq=2), late, 1), 30)
        assert [(e.offset, e.index, e.tokens, e.text, e.done, e.update_id) for e in late] == \
            [(at, 0, result.tokens, result.text, True, events[0].update_id)]
        # the log holds the chunk once; past it, nothing
        assert (await stack.streams.read_tokens(sid, from_offset=at + 1)).events == []
        # the same chunk sent again streams its committed tokens, once (the server answers the id)
        dup = stack.streams.generate_stream(sid, "alice", 40, seed=7, temperature=0.9, top_k=20, chunk_seq=2)
        got = [ev async for ev in dup]
        assert _tokens(got) == result.tokens and dup.result == result
        assert (await stack.streams.stats(sid)).chunks == 2


async def test_a_reader_of_every_chunk_sees_unstreamed_generates_whole_and_advances_nothing(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", tokens=[5, 6, 7])
    start = await stack.streams.token_offset(sid)
    got: list[TokenEvent] = []
    reader = asyncio.ensure_future(_collect(stack.streams.tokens(sid, from_offset=start), got, 2))
    a = await stack.streams.generate(sid, "alice", 5, seed=1)  # local, not streamed: one entry
    await stack.streams.advance(sid, "alice", tokens=[8])
    b = await stack.streams.generate(sid, "alice", 3, seed=2)
    await asyncio.wait_for(reader, 20)
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
        await eventually(lambda: _true(bool(seen)), timeout=30, interval=0.01)
        await stack.streams.cancel(sid, wait=False)
        with pytest.raises(WorkflowUpdateFailedError) as exc:
            await asyncio.wait_for(task, 30)
        assert reason(exc.value) == "StreamCancelled"
        assert 0 < len(_tokens(seen)) < 400
        # a reader of the cancelled stream ends, it does not wait: the chunk's entry says why
        rest = await asyncio.wait_for(_list(stack.streams.tokens(sid, from_offset=0)), 30)
        assert [(e.chunk_seq, e.tokens, e.done, e.error) for e in rest] in ([], [(2, [], True, "StreamCancelled")])


async def _true(value: bool) -> bool:
    return value


async def _list(it) -> list:
    return [x async for x in it]


async def test_the_token_log_crosses_continue_as_new_and_readers_follow_it(can_env, tmp_path):
    stack = await make_stack(can_env, tmp_path)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        await stack.streams.advance(sid, "alice", tokens=[9, 8, 7])
        got: list[TokenEvent] = []
        reader = asyncio.ensure_future(_collect(stack.streams.tokens(sid, from_offset=0), got, 8))
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
        for r in results:
            _one_chunk_in_order(by_chunk[r.chunk_seq], r.tokens, r.text)
        # each entry once, in order, none lost: the generates took offsets 0..7
        assert [e.offset for e in got if e.done] == list(range(8))
        assert all(len({e.offset for e in by_chunk[r.chunk_seq]}) == 1 for r in results)


async def test_the_token_log_is_bounded_within_a_run_and_across_continue_as_new(can_env, tmp_path):
    stack = await make_stack(can_env, tmp_path)
    async with stack.exits:
        opts = FAST.model_copy(update={"carry_bytes": 4096, "token_log_events": 5})
        sid = await stack.streams.open("alice", "tiny-mamba2", options=opts)
        await stack.streams.advance(sid, "alice", tokens=[9, 8, 7])
        results = [await stack.streams.generate(sid, "alice", 40, seed=i) for i in range(10)]
        assert (await stack.streams.stats(sid)).continued_as_new >= 2
        now = await stack.streams.read_tokens(sid, from_offset=0)
        # one entry per generate: the newest ones are kept, the oldest are gone
        assert now.next_offset == len(results) and now.base_offset > 0
        assert 1 <= len(now.events) <= 5 and now.events[0].offset == now.base_offset
        assert [e.tokens for e in now.events] == [r.tokens for r in results[now.base_offset:]]


async def test_a_streamed_generate_after_a_reset_it_did_not_see_is_sent_again_under_the_new_epoch(stack: Stack):
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


# --- readers and publishers cannot hurt a stream (Issue 25) ------------------------------------------


@pytest.mark.parametrize("n", [10, 50])
async def test_many_readers_during_a_generate_block_nothing_and_write_no_history(temporal_env, tmp_path, n):
    """With the token log behind updates, 10 readers filled the workflow's 10 in-flight updates and
    the owner's chunks were refused `ResourceExhausted`; each poll's answer went into history."""
    stack = await make_stack(temporal_env, tmp_path, acts_cls=SlowSampling)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba2")
        await stack.streams.advance(sid, "alice", text="readers, ")
        start = await stack.streams.token_offset(sid)
        readers = CountingStreams(stack.client, stack.queue)
        got: list[list[TokenEvent]] = [[] for _ in range(n)]
        # half read the stream's log, half the chunk by its sequence number
        tasks = [asyncio.ensure_future(_collect(readers.tokens(sid, from_offset=start, chunk_seq=None if i % 2 else 2),
                                                got[i], 2 if i % 2 else 1)) for i in range(n)]
        # every reader has read the log and follows the stream's history: it has not moved
        before = await _length(stack, sid)
        await eventually(lambda: _true(readers.reads >= n), timeout=60)
        assert await _length(stack, sid) == before
        gen = stack.streams.generate_stream(sid, "alice", 150, seed=4)
        shown: list[TokenEvent] = []
        streamed = asyncio.ensure_future(_collect(gen, shown, 1))
        # every reader sees the chunk's first tokens while it runs
        await eventually(lambda: _true(all(got[i] for i in range(n))), timeout=60)
        assert not streamed.done() and all(not any(e.done for e in g) for g in got)
        # meanwhile the owner's chunks and checkpoint are admitted (they run after the generate)
        fed = await stack.streams.advance(sid, "alice", tokens=[1, 2], chunk_seq=3)
        plain = await stack.streams.generate(sid, "alice", 8, seed=9, chunk_seq=4)
        ckpt = await stack.streams.checkpoint(sid, "alice")
        await asyncio.wait_for(asyncio.gather(streamed, *tasks), 60)
        result = gen.result
        assert fed.chunk_seq == 3 and plain.chunk_seq == 4 and ckpt.receipt == plain.receipt
        _one_chunk_in_order(shown, result.tokens, result.text)
        for i in range(n):
            mine = [e for e in got[i] if e.chunk_seq == 2]
            _one_chunk_in_order(mine, result.tokens, result.text)
            assert len(mine) >= 2  # live tokens before the commit, not only the committed entry
            if i % 2:
                assert [(e.chunk_seq, e.tokens, e.offset) for e in got[i][len(mine):]] == [(4, plain.tokens, start + 1)]
        # what history holds: the owner's updates (ready, 2 advances, 2 generates, the checkpoint),
        # no reader's, no signal
        events = await _events(stack, sid)
        ids = _accepted(events)
        assert [u.split("-")[0] for u in ids[:5]] == ["ready", "advance", "generate", "advance", "generate"]
        assert len(ids) == 6 and not _signals(events)


async def test_a_reader_past_the_end_gets_nothing_blocks_nothing_and_writes_nothing(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=SlowSampling)
    async with stack.exits:
        await _past_the_end(stack)


async def _past_the_end(stack: Stack) -> None:
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", tokens=[4, 5, 6])
    far = CountingStreams(stack.client, stack.queue)
    got: list[TokenEvent] = []
    reader = asyncio.ensure_future(_collect(far.tokens(sid, from_offset=2**53), got, 1))
    before = await _length(stack, sid)
    await eventually(lambda: _true(far.reads >= 1), timeout=30)
    assert await _length(stack, sid) == before
    # the owner's chunks go on while it waits: a streamed generate, an advance, a generate, a checkpoint
    gen = stack.streams.generate_stream(sid, "alice", 60, seed=2)  # about a second: the reader looks
    shown = [ev async for ev in gen]
    assert _tokens(shown) == gen.result.tokens and len(gen.result.tokens) == 60
    await stack.streams.advance(sid, "alice", tokens=[7])
    await stack.streams.generate(sid, "alice", 4, seed=3)
    await stack.streams.checkpoint(sid, "alice")
    # it looked at the streamed generate while it ran, showed none of it, and read the log once a
    # generate had finished (a busy stream's events come in batches: maybe one read for both)
    assert far.polls >= 1 and got == []
    await eventually(lambda: _true(far.reads >= 2), timeout=30)
    assert got == [] and not reader.done()
    events = await _events(stack, sid)
    assert len(_accepted(events)) == 6 and not _signals(events)  # ready, 2 advances, 2 generates, checkpoint
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)


async def test_no_one_but_the_workers_adds_tokens_and_no_one_but_the_principal_reads_them(temporal_env, tmp_path):
    """The old `publish_tokens` let another principal's client (or one with no keys, in clear)
    put its text at index 0 of the owner's generate, and `poll_tokens` filled history."""
    stack = await make_stack(temporal_env, tmp_path, acts_cls=SlowSampling)
    async with stack.exits:
        bob = StreamClient(await Client.connect(
            stack.address, plugins=[MambaStreamPlugin(keyring=stack.keyring.for_principal("bob"))]), stack.queue)
        keyless = await Client.connect(stack.address)  # no plugin: plaintext JSON, no codec
        sid = await stack.streams.open("alice", "tiny-mamba2")
        await stack.streams.advance(sid, "alice", text="alice's secret: ")
        first = await stack.streams.generate(sid, "alice", 12, seed=1)
        log = await stack.streams.read_tokens(sid)
        assert [e.tokens for e in log.events] == [first.tokens]
        before = await _length(stack, sid)
        forged = {"chunk_seq": 3, "index": 0, "tokens": [70, 79, 82, 71, 69, 68], "text": "FORGED"}
        for client in (bob.client, keyless):
            handle = client.get_workflow_handle(sid)
            for name, arg in (("publish_tokens", forged), ("poll_tokens", {"from_offset": 0}),
                              ("poll_tokens", {"from_offset": 2**53})):
                # refused; the keyless client cannot even read why (the refusal's details are
                # encrypted for the stream's principal: KeyError, its converter knows no such encoding)
                with pytest.raises((WorkflowUpdateFailedError, ApplicationError, RPCError, KeyError)):
                    await asyncio.wait_for(handle.execute_update(name, arg, id=f"{name}-{uuid.uuid4().hex}"), 30)
        assert await _length(stack, sid) == before  # refused: nothing in history
        assert await stack.streams.read_tokens(sid) == log  # nothing added
        # a signal of either name is written to history, as every signal is (Temporal's authorization
        # decides who may signal), and changes nothing
        for client in (bob.client, keyless):
            await client.get_workflow_handle(sid).signal("publish_tokens", forged)
        assert await stack.streams.read_tokens(sid) == log
        # reading: bob's client is refused typed; the keyless one sees ciphertext only
        for read in (lambda: bob.read_tokens(sid), lambda: bob.token_offset(sid),
                     lambda: _list(bob.tokens(sid, from_offset=0))):
            with pytest.raises(ApplicationError) as err:
                await read()
            assert err.value.type == "UnknownKeyId"
        raw = await keyless.get_workflow_handle(sid).query("read_tokens", {"from_offset": 0}, result_type=RawValue)
        assert raw.payload.metadata["encoding"] == ENCRYPTED_ENCODING
        assert first.text.encode() not in raw.payload.data and json.dumps(first.tokens).encode() not in raw.payload.data
        # a running generate's heartbeats can be written by anyone who names the activity: its
        # readers show only what the workers wrote (under the stream's principal's key)
        stack.acts.step_s = 0.2
        gen = stack.streams.generate_stream(sid, "alice", 40, seed=5)
        shown: list[TokenEvent] = []
        streamed = asyncio.ensure_future(_collect(gen, shown, 1))
        genuine = await eventually(lambda: stack.streams.progress(sid), timeout=30)
        fake = genuine.model_copy(update={"start": 0, "tokens": forged["tokens"], "text_start": 0, "text": "FORGED"})
        for client, details in ((bob.client, fake), (keyless, json.loads(fake.model_dump_json()))):
            # awaited within this iteration
            await eventually(lambda: _forge(stack, sid, client, details), timeout=30, interval=0)  # noqa: B023
        await asyncio.wait_for(streamed, 60)
        result = gen.result
        assert b"FORGED" not in "".join(e.text or "" for e in shown).encode() and not any(e.restart for e in shown)
        _one_chunk_in_order(shown, result.tokens, result.text)
        after = await stack.streams.read_tokens(sid)
        assert [e.tokens for e in after.events] == [first.tokens, result.tokens]
        events = await _events(stack, sid)
        assert all(not u.startswith(("publish", "poll")) for u in _accepted(events))
        assert _signals(events) == ["publish_tokens", "publish_tokens"]  # the two sent above, and nothing else


async def _forge(stack: Stack, sid: str, client: Client, details) -> bool:
    """Write forged heartbeat details for the stream's running generate; True once the owner's
    client was shown them by `describe` (the workers' next heartbeat replaces them) and ignored them."""
    async def pending():
        desc = await stack.streams.handle(sid).describe()
        [pa] = [p for p in desc.raw_description.pending_activities if p.activity_type.name == "generate_tokens"]
        return desc, pa

    _, pa = await pending()
    await client.get_async_activity_handle(workflow_id=sid, run_id=None, activity_id=pa.activity_id).heartbeat(details)
    desc, pa = await pending()
    if sealed_for_stream(pa.heartbeat_details.payloads[0], sid):
        return False  # the workers heartbeat in between: again
    got = await stack.streams.progress(sid, desc)
    assert got is None  # not the workers': not shown
    return True


async def test_a_4000_token_streamed_generate_adds_no_history_events(temporal_env, tmp_path):
    """It added 89 `publish_tokens` and 12 `poll_tokens` updates when tokens went through the workflow."""
    stack = await make_stack(temporal_env, tmp_path, backend="exact")
    async with stack.exits:
        streamed_sid = await stack.streams.open("alice", "tiny-mamba2")
        plain_sid = await stack.streams.open("alice", "tiny-mamba2")
        for sid in (streamed_sid, plain_sid):
            await stack.streams.advance(sid, "alice", text="Four thousand tokens: ")
        gen = stack.streams.generate_stream(streamed_sid, "alice", 4000, seed=11)
        shown: list[TokenEvent] = []
        # both at once: the engine steps them in one batch
        _, plain = await asyncio.gather(_collect(gen, shown, 1),
                                        stack.streams.generate(plain_sid, "alice", 4000, seed=11))
        streamed = gen.result
        assert len(streamed.tokens) == 4000 and streamed.tokens == plain.tokens
        assert streamed.receipt.checksum == plain.receipt.checksum and streamed.output_digest == plain.output_digest
        assert _tokens(shown) == streamed.tokens and len(shown) >= 3  # shown live, in pieces
        spans = {}
        for sid in (streamed_sid, plain_sid):
            events = await _events(stack, sid)
            [accepted] = [i for i, e in enumerate(events)
                          if e.HasField("workflow_execution_update_accepted_event_attributes")
                          and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
                          == "generate"]
            [completed] = [i for i, e in enumerate(events)
                           if e.HasField("workflow_execution_update_completed_event_attributes")
                           and e.workflow_execution_update_completed_event_attributes.meta.update_id == events[accepted]
                           .workflow_execution_update_accepted_event_attributes.accepted_request.meta.update_id]
            spans[sid] = (events[accepted + 1 : completed], len(events), _accepted(events))
        (span, total, ids), (plain_span, plain_total, plain_ids) = spans[streamed_sid], spans[plain_sid]
        # token plumbing adds at most 10 events (the acceptance), and in fact none: between the
        # update's acceptance and its completion there is the chunk's activity and the workflow
        # task that commits it, as for the chunk that did not stream
        assert len(span) - len(plain_span) <= 10 and total - plain_total <= 10, \
            (len(span), len(plain_span), total, plain_total)
        plumbing = [e.event_type for e in span if EventType.Name(e.event_type).split("EVENT_TYPE_")[1].split("_")[0]
                    not in ("ACTIVITY", "WORKFLOW")]
        assert plumbing == [] \
            and [EventType.Name(e.event_type) for e in span if "ACTIVITY" in EventType.Name(e.event_type)] \
            == ["EVENT_TYPE_ACTIVITY_TASK_SCHEDULED", "EVENT_TYPE_ACTIVITY_TASK_STARTED",
                "EVENT_TYPE_ACTIVITY_TASK_COMPLETED"]
        assert not any(e.event_type in (EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
                                        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED) for e in span)
        assert len(ids) == len(plain_ids) == 3  # ready, advance, generate


# --- what a reader shows of a running generate (no server) ---------------------------------------


def _progress(start: int, tokens: list[int], text_start: int = 0, text: str | None = None, **kw) -> TokenProgress:
    return TokenProgress(chunk_seq=2, epoch=0, update_id="generate-2-e0-x", offset=5, start=start, tokens=tokens,
                         text_start=text_start, text=text, **kw)


async def test_a_reader_shows_each_token_once_and_the_commit_brings_the_rest():
    from mamba_stream.workflows._reader import _Shown

    first = _progress(0, [1, 2, 3], 0, "abc")
    shown = _Shown(first)
    ev = shown.live(first)
    assert (ev.offset, ev.index, ev.tokens, ev.text, ev.done) == (5, 0, [1, 2, 3], "abc", False)
    assert shown.live(first) is None  # nothing new
    # the window moved on: only the newest tokens are in it, the ones shown among them
    ev = shown.live(_progress(2, [3, 4, 5], 2, "cde"))
    assert (ev.index, ev.tokens, ev.text) == (3, [4, 5], "de")
    entry = TokenEvent(offset=5, chunk_seq=2, update_id="generate-2-e0-x", tokens=[1, 2, 3, 4, 5, 6], text="abcdef",
                       done=True, finish_reason="length")
    done = shown.settle(entry)
    assert (done.index, done.tokens, done.text, done.done, done.restart) == (5, [6], "f", True, False)


async def test_a_reader_that_fell_behind_or_saw_a_retry_sample_others_waits_for_the_commit():
    from mamba_stream.workflows._reader import _Shown

    entry = TokenEvent(offset=5, chunk_seq=2, update_id="generate-2-e0-x", tokens=[1, 2, 9, 9], text="ab!!",
                       done=True, finish_reason="length")
    behind = _Shown(_progress(0, [1], 0, "a"))
    behind.live(_progress(0, [1], 0, "a"))
    assert behind.live(_progress(3, [9], 3, "!")) is None  # token 2 is no longer in the window
    assert behind.live(_progress(0, [1, 2, 9, 9], 0, "ab!!")) is None  # and it shows no more live
    done = behind.settle(entry)
    assert (done.index, done.tokens, done.text, done.restart) == (1, [2, 9, 9], "b!!", False)
    other = _Shown(_progress(0, [1, 2, 3], 0, "abc"))
    other.live(_progress(0, [1, 2, 3], 0, "abc"))
    # a retry sampled other tokens (an approximate backend): its progress is not shown
    assert other.live(_progress(0, [1, 2, 9, 9], 0, "ab!!", attempt=2)) is None
    done = other.settle(entry)
    assert (done.index, done.tokens, done.text, done.restart) == (0, [1, 2, 9, 9], "ab!!", True)
    failed = _Shown(_progress(0, [1], 0, "a"))
    failed.live(_progress(0, [1], 0, "a"))
    err = failed.settle(TokenEvent(offset=5, chunk_seq=2, update_id="generate-2-e0-x", done=True,
                                   error="StreamCancelled"))
    assert (err.index, err.tokens, err.error, err.restart) == (1, [], "StreamCancelled", False)


async def _read_all(stack: Stack, sid: str, max_events: int, **kw) -> tuple[list[TokenEvent], list[bool]]:
    """The log read in batches of `max_events` from offset 0, each from the last one's next_offset."""
    got, mores, offset = [], [], 0
    for _ in range(64):
        batch = await stack.streams.read_tokens(sid, from_offset=offset, max_events=max_events, **kw)
        assert len(batch.events) <= max_events
        got += batch.events
        mores.append(batch.more)
        assert batch.next_offset > offset or not batch.more, "a held-back read must move on"
        offset = batch.next_offset
        if not batch.more:
            return got, mores
    raise AssertionError("the reads never ended")


async def test_a_read_cut_at_max_events_goes_on_from_the_entry_after_the_last_returned(temporal_env, tmp_path):
    """A read that holds entries back (its `max_events`) says `more`, and its next offset is the
    entry after the last one it returned: read again and again, every entry once, in order, none
    skipped; with a chunk filter (offsets with gaps) and with the log's oldest entries gone (the
    first read starts past from_offset) alike."""
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        opts = FAST.model_copy(update={"token_log_events": 5})
        sid = await stack.streams.open("alice", "tiny-mamba2", options=opts)
        await stack.streams.advance(sid, "alice", tokens=[9, 8, 7])
        results = [await stack.streams.generate(sid, "alice", 3, seed=i) for i in range(7)]
        whole = await stack.streams.read_tokens(sid, from_offset=0)
        assert not whole.more and whole.base_offset == 2 and [e.offset for e in whole.events] == [2, 3, 4, 5, 6]
        assert [e.tokens for e in whole.events] == [r.tokens for r in results[2:]]
        for n in (1, 2, 3, 4):
            got, mores = await _read_all(stack, sid, n)
            assert [(e.offset, e.chunk_seq, e.tokens) for e in got] == \
                [(e.offset, e.chunk_seq, e.tokens) for e in whole.events], n
            assert mores[:-1] == [True] * (len(mores) - 1)
        seq = results[4].chunk_seq
        one, mores = await _read_all(stack, sid, 1, chunk_seq=seq)
        assert [(e.offset, e.tokens) for e in one] == [(4, results[4].tokens)] and mores[0] is True
        # the reader does the same with a small batch: each kept entry once
        seen: list[TokenEvent] = []
        await asyncio.wait_for(_collect(stack.streams.tokens(sid, from_offset=0, max_events=2), seen, 5), 20)
        assert [(e.offset, e.tokens) for e in seen] == [(e.offset, e.tokens) for e in whole.events]


class FailStreamedOnce(SlowSampling):
    """The first regular attempt of a streamed generate fails for a reason not the chunk's own
    (`InternalError`, permanent) after its tokens went out as heartbeats."""

    step_s = 0.05

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.failed = False

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        from temporalio import activity

        from mamba_stream.workflows import InternalError

        super()._edge(name, stream_id, chunk_seq)
        if name == "computed" and not self.failed and activity.in_activity() and not activity.info().is_local \
                and activity.info().activity_type == "generate_tokens":
            self.failed = True
            raise InternalError("planted: the worker lost the chunk after sampling it")


async def test_a_reader_of_a_generate_sent_again_yields_only_that_attempts_entries(temporal_env, tmp_path):
    """A streamed chunk fails permanently (not its own fault) and is sent again as `attempt=1`:
    a reader of the second attempt's update id, running while the first attempt streamed, yields
    only the second attempt's tokens (from index 0, once, then its commit), never the first's live
    tokens or its failure entry; a reader of the chunk sequence sees both attempts' entries."""
    stack = await make_stack(temporal_env, tmp_path, acts_cls=FailStreamedOnce)
    async with stack.exits:
        regular = FAST.model_copy(update={"local_chunks": False})
        sid = await stack.streams.open("alice", "tiny-mamba2", options=regular)
        await stack.streams.advance(sid, "alice", tokens=[3, 1, 4, 1, 5])
        start, seq = await stack.streams.token_offset(sid), await stack.streams.next_seq(sid)
        first = stack.streams.generate_stream(sid, "alice", 30, seed=7)
        shown: list[TokenEvent] = []
        again_reader: asyncio.Future | None = None
        again_seen: list[TokenEvent] = []
        with pytest.raises(WorkflowUpdateFailedError) as err:
            async for ev in first:
                shown.append(ev)
                if again_reader is None:  # the second attempt's id: the first's + "-a1"
                    again_reader = asyncio.ensure_future(_collect(stack.streams.tokens(
                        sid, from_offset=start, update_id=ev.update_id + "-a1"), again_seen, 1))
        assert reason(err.value) == "InternalError" and shown and again_reader is not None
        uid0 = shown[0].update_id
        assert all(e.update_id == uid0 and e.chunk_seq == seq and not e.done for e in shown)
        second = stack.streams.generate_stream(sid, "alice", 30, seed=7, chunk_seq=seq, attempt=1)
        mine = [ev async for ev in second]
        result = second.result
        assert result.chunk_seq == seq and len(result.tokens) == 30
        _one_chunk_in_order(mine, result.tokens, result.text)
        await asyncio.wait_for(again_reader, 30)
        assert all(e.update_id == uid0 + "-a1" and e.error is None for e in again_seen), again_seen
        _one_chunk_in_order(again_seen, result.tokens, result.text)
        assert again_seen[-1].offset == start + 1  # the failed attempt's entry took `start`
        by_seq: list[TokenEvent] = []
        await asyncio.wait_for(_collect(stack.streams.tokens(sid, from_offset=start, chunk_seq=seq), by_seq, 2), 20)
        assert [(e.offset, e.update_id, e.error, e.tokens) for e in by_seq] == \
            [(start, uid0, "InternalError", []), (start + 1, uid0 + "-a1", None, result.tokens)]
        truth = local("tiny-mamba2")
        full = truth.advance(truth.initial_state(), [3, 1, 4, 1, 5, *result.tokens])
        assert result.receipt.checksum == plaintext_checksum(full.state.tensors)
