"""Prefix states and forks through Temporal, on the default worker (backend auto: exact on a CPU)
and the PostgreSQL store: a stream opened from a stored prefix, fed the rest, ends with the
outputs and checksum of one fed everything from position 0; so does a fork fed its parent's
continuation; principals never see each other's entries; concurrent opens of a new prefix
compute it once; bad prefixes are refused typed and store nothing; a prefix computed under one
arithmetic is never served to a worker of another."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from mamba_stream.activities import StreamMetrics, open_store
from mamba_stream.scan import load_model
from mamba_stream.state_codec import parse_state_key
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import MambaStreamWorkflow, OpenStreamInput, StreamClient, StreamOptions
from tests.activities.test_prefix import CountingMeter
from tests.activities.test_stores import PG_URL
from tests.workflows._owner import OwnerInput
from tests.workflows._owner import TestOwner as Owner  # (not a test class)
from tests.workflows.conftest import FAST, Stack, eventually, make_stack, replay
from tests.workflows.test_stream_workflow import digest

pytestmark = pytest.mark.asyncio(loop_scope="session")

OPTS = StreamOptions(**{**FAST.model_dump(), "max_chunk_tokens": 64})


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


async def pg_stack(temporal_env, tmp_path, **kw: Any) -> Stack:
    """A stack on the default worker (backend auto) whose store is a fresh PostgreSQL table."""
    stack = await make_stack(temporal_env, tmp_path, backend="auto", start_worker=False)
    stack.store_url = f"{PG_URL}?table=t_{uuid.uuid4().hex[:12]}"
    def drop() -> None:
        with open_store(stack.store_url) as store:
            store.drop()
    stack.exits.callback(drop)
    stack.acts = stack.new_activities(backend="auto", **kw)
    await stack.worker(stack.acts)
    return stack


async def feed(streams: StreamClient, sid: str, tokens: list[int], piece: int = 64):
    out = None
    for i in range(0, len(tokens), piece):
        out = await streams.advance(sid, "alice", tokens=tokens[i : i + piece])
    return out


@pytest.mark.parametrize("model_id", ["tiny-mamba1", "tiny-mamba2", "tiny-mamba3"])
async def test_streams_opened_from_stored_prefixes_end_as_one_fed_everything_from_position_0(
        temporal_env, tmp_path, model_id):
    stack = await pg_stack(temporal_env, tmp_path)
    async with stack.exits:
        s = stack.streams
        system, tools, rest = toks(150, 1), toks(70, 2), toks(30, 3)
        # longer than the chunk limit (64): computed in pieces all the same
        computed = await s.open("alice", model_id, prefix=system, options=OPTS)
        hit = await s.open("alice", model_id, prefix=system, options=OPTS)
        longer = await s.open("alice", model_id, prefix=system + tools, options=OPTS)
        plain = await s.open("alice", model_id, options=OPTS)
        origins = [(await s.receipt(sid)).origin for sid in (computed, hit, longer)]
        assert [(o.tokens, o.stored_tokens, o.scope) for o in origins] == [
            (150, 0, ""), (150, 150, "principal"), (220, 150, "principal")]
        pfx = stack.acts.prefixes
        assert origins[2].digest == pfx.digest(pfx.scope("alice"), system + tools)
        assert (await s.receipt(plain)).origin is None

        await feed(s, plain, system + tools)
        await feed(s, hit, tools)
        ends = {}
        for sid in (plain, hit, longer):
            last = await s.advance(sid, "alice", tokens=rest)
            gen = await s.generate(sid, "alice", 5, temperature=0.0)
            ends[sid] = (last.output_digest, last.receipt.position, gen.tokens, gen.receipt.checksum)
        assert ends[hit] == ends[plain] and ends[longer] == ends[plain]
        # and that is one local scan of everything on the same arithmetic, outputs and state
        m = load_model(model_id)
        everything = system + tools + rest
        one = m.advance(m.initial_state(), everything + ends[plain][2])
        assert ends[plain][0] == digest(one.logits[len(system + tools) : len(everything)])
        assert ends[plain][3] == plaintext_checksum(one.state.tensors)
        stats = await s.stats(hit)
        assert stats.position == len(everything) + 5 and (await s.receipt(hit)).origin == origins[1]


async def test_a_fork_fed_its_parents_continuation_ends_as_the_parent_and_names_its_origin(temporal_env, tmp_path):
    stack = await pg_stack(temporal_env, tmp_path)
    async with stack.exits:
        s = stack.streams
        opts = StreamOptions(**{**OPTS.model_dump(), "checkpoints_kept": 3})
        parent = await s.open("alice", "tiny-mamba2", options=opts)
        chunks = [toks(20, 10 + i) for i in range(4)]
        results = [await s.advance(parent, "alice", tokens=c) for c in chunks[:2]]
        zero = await s.fork(parent, at_seq=0)  # the opened state forks too
        assert (await s.receipt(zero)).position == 0 and (await s.receipt(zero)).origin.chunk_seq == 0
        results += [await s.advance(parent, "alice", tokens=c) for c in chunks[2:]]
        child = await s.fork(parent, at_seq=2)
        origin = (await s.receipt(child)).origin
        assert (origin.kind, origin.stream_id, origin.chunk_seq, origin.checksum) == (
            "checkpoint", parent, 2, results[1].receipt.checksum)
        assert (await s.stats(child)).principal == "alice" and (await s.receipt(child)).position == 40
        again = [await s.advance(child, "alice", tokens=c) for c in chunks[2:]]
        for got, want in zip(again, results[2:], strict=True):
            assert (got.output_digest, got.receipt.checksum, got.receipt.position) == (
                want.output_digest, want.receipt.checksum, want.receipt.position)
        assert again[-1].receipt.origin == origin  # every receipt of the child's epoch names it
        # a branch: the child takes another turn; the parent is unchanged
        await s.advance(child, "alice", tokens=[1, 2, 3])
        assert (await s.receipt(parent)).checksum == results[-1].receipt.checksum
        # a chunk outside the window (the newest 3 checkpoints: chunks 2-4), or not committed, does
        # not fork, typed, and opens nothing
        for seq, reason in ((1, "RewindPastWindow"), (9, "RewindUnavailable")):
            with pytest.raises(WorkflowUpdateFailedError) as err:
                await s.fork(parent, at_seq=seq)
            assert isinstance(err.value.cause, ApplicationError) and err.value.cause.type == reason
        now = await s.fork(parent)  # the state now
        assert (await s.receipt(now)).checksum == results[-1].receipt.checksum

        # a fork's checkpoint is released once the child opened: the parent keeps no more than its
        # line (2 x checkpoints_kept - 1) however many forks it had; a `checkpoint` holds until released
        def checkpoints() -> set[str]:
            return {k for k in stack.acts.store.list_stream(stream_id=parent) if parse_state_key(k) is not None}
        held = await s.checkpoint(parent, "alice")
        for i in range(6):
            await s.advance(parent, "alice", tokens=[i])
        stored = checkpoints()
        assert len(stored) == 2 * 3 - 1 + 1 and held.receipt.state_key in stored  # the line, and the held one
        assert results[1].receipt.state_key not in stored  # chunk 2's: forked from, released, dropped
        await s.release(parent, held.receipt)
        with pytest.raises(WorkflowUpdateFailedError) as err:  # released already: not kept for anyone
            await s.release(parent, held.receipt)
        assert err.value.cause.type == "InvalidRequest"
        await s.advance(parent, "alice", tokens=[9])
        assert held.receipt.state_key not in checkpoints() and len(checkpoints()) == 2 * 3 - 1
        assert (await s.receipt(child)).origin.chunk_seq == 2  # the children live on from their own copies
        await s.advance(child, "alice", tokens=[5])


async def test_another_principal_neither_reads_nor_detects_a_private_prefix(temporal_env, tmp_path):
    meter = CountingMeter()
    stack = await pg_stack(temporal_env, tmp_path, metrics=StreamMetrics(meter))
    async with stack.exits:
        s, store = stack.streams, stack.acts.store
        secret, other = toks(120, 20), toks(120, 21)
        await s.open("alice", "tiny-mamba2", prefix=secret, options=OPTS)
        alice = stack.acts.prefixes.scope("alice")
        entry = store.read_meta(kind=alice.index_kind)
        hits = meter.total("mamba_stream_prefix_hits")
        b1 = await s.open("bob", "tiny-mamba2", prefix=secret, options=OPTS)  # alice holds it
        b2 = await s.open("bob", "tiny-mamba2", prefix=other, options=OPTS)  # nobody does
        r1, r2 = await s.receipt(b1), await s.receipt(b2)
        # what bob sees of the open that alice's entry could have served is what he sees of a miss
        assert r1.origin.model_dump(exclude={"digest"}) == r2.origin.model_dump(exclude={"digest"})
        assert (r1.origin.stored_tokens, r1.origin.scope) == (0, "")
        st1, st2 = await s.stats(b1), await s.stats(b2)
        assert st1.model_dump(exclude={"stream_id"}) == st2.model_dump(exclude={"stream_id"})
        assert meter.total("mamba_stream_prefix_hits") == hits  # no hit recorded
        assert store.read_meta(kind=alice.index_kind) == entry  # alice's entry untouched
        assert r1.checksum == (await s.receipt(await s.fork(b1))).checksum  # bob's own state, his to fork
        # bob computed his own: his next open of it is a hit in his scope
        b3 = await s.open("bob", "tiny-mamba2", prefix=secret, options=OPTS)
        assert (await s.receipt(b3)).origin.scope == "principal"
        assert meter.total("mamba_stream_prefix_hits", scope="principal") == hits + 1


async def test_concurrent_opens_of_one_new_prefix_compute_it_once_and_every_stream_gets_it(temporal_env, tmp_path):
    stack = await pg_stack(temporal_env, tmp_path)
    async with stack.exits:
        # two workers of the deployment on the shared queue: the prefix is computed once in all
        workers = [stack.acts, await stack.worker(stack.new_activities(backend="auto"))]
        pieces: list[int] = []
        models = [acts.models.get("tiny-mamba2") for acts in workers]
        reals = [m.advance for m in models]
        for m, real in zip(models, reals, strict=True):
            m.advance = lambda state, t, real=real, **kw: pieces.append(len(t)) or real(state, t, **kw)  # type: ignore[method-assign]
        try:
            p = toks(1100, 30)
            sids = await asyncio.gather(*(stack.streams.open("alice", "tiny-mamba2", prefix=p, options=OPTS)
                                          for _ in range(8)))
        finally:
            for m, real in zip(models, reals, strict=True):
                m.advance = real  # type: ignore[method-assign]
        piece = stack.acts.engine(models[0]).prefill_piece
        assert sorted(pieces) == sorted([piece] * (1100 // piece) + [1100 % piece])  # one computation
        receipts = [await stack.streams.receipt(sid) for sid in sids]
        m = load_model("tiny-mamba2")
        assert {r.checksum for r in receipts} == {plaintext_checksum(m.advance(m.initial_state(), p).state.tensors)}
        assert sorted(r.origin.stored_tokens for r in receipts) == [0] + [1100] * 7


async def test_bad_prefixes_are_refused_typed_and_store_nothing(temporal_env, tmp_path):
    stack = await pg_stack(temporal_env, tmp_path)
    async with stack.exits:
        s, store = stack.streams, stack.acts.store
        vocab = load_model("tiny-mamba2").vocab_size
        small = StreamOptions(**{**OPTS.model_dump(), "max_prefix_tokens": 100, "max_text_bytes": 64})
        with pytest.raises(WorkflowFailureError) as err:  # the vocabulary is the workers' to know
            await s.open("alice", "tiny-mamba2", prefix=[5, vocab, 6], options=OPTS)
        cause = err.value.cause
        assert isinstance(cause, ApplicationError) and (cause.type, cause.non_retryable) == ("TokenOutOfRange", True)
        point = await s.checkpoint(await s.open("alice", "tiny-mamba2", options=OPTS), "alice")
        opened = {w.id async for w in stack.client.list_workflows(f"TaskQueue = '{stack.queue}'")}
        cases = [(dict(prefix=toks(101, 40), options=small), "ChunkTooLarge"),
                 (dict(prefix="x" * 65, options=small), "ChunkTooLarge"),
                 (dict(prefix=[1, 2], resume=point.receipt, options=OPTS), "InvalidRequest")]
        for kw, reason in cases:  # the client refuses them before anything starts
            with pytest.raises(ApplicationError) as err:
                await s.open("alice", "tiny-mamba2", **kw)
            assert (err.value.type, err.value.non_retryable) == (reason, True)
        assert {w.id async for w in stack.client.list_workflows(f"TaskQueue = '{stack.queue}'")} == opened
        # and so does the stream, started by a client that does not check
        for kw, reason in cases:
            sid = s.new_id("alice")
            inp = OpenStreamInput(principal="alice", model_id="tiny-mamba2", **{"options": OPTS, **kw})
            handle = await stack.client.start_workflow(MambaStreamWorkflow.run, inp, id=sid, task_queue=stack.queue)
            with pytest.raises(WorkflowFailureError) as err:
                await handle.result()
            assert (err.value.cause.type, err.value.cause.non_retryable) == (reason, True)
        assert store.stream_ids() == [point.receipt.stream_id]
        assert stack.acts.prefixes.usage().entries == 0
        for empty in ([], ""):  # an ordinary open
            r = await s.receipt(await s.open("alice", "tiny-mamba2", prefix=empty, options=OPTS))
            assert r.position == 0 and r.origin is None
        assert stack.acts.prefixes.usage().entries == 0


async def test_a_prefix_computed_under_one_arithmetic_is_never_served_to_a_worker_of_another(temporal_env, tmp_path):
    stack = await pg_stack(temporal_env, tmp_path)
    async with stack.exits:
        # a second queue served by exact-2 (fused multiply-add) workers on the same store and keys
        fma = dataclasses.replace(stack, queue=f"{stack.queue}-fma",
                                  streams=StreamClient(stack.client, f"{stack.queue}-fma"))
        await fma.worker(fma.new_activities(backend="exact-fma"))
        stack.exits.push_async_callback(lambda: replay(stack.client, fma.queue, stack.keyring))
        p = toks(90, 50)
        one = await stack.streams.receipt(await stack.streams.open("alice", "tiny-mamba2", prefix=p, options=OPTS))
        two = await fma.streams.receipt(await fma.streams.open("alice", "tiny-mamba2", prefix=p, options=OPTS))
        assert one.origin.stored_tokens == 0 and two.origin.stored_tokens == 0  # each computed its own
        assert one.arithmetic.id != two.arithmetic.id
        again = await fma.streams.receipt(await fma.streams.open("alice", "tiny-mamba2", prefix=p, options=OPTS))
        assert again.origin.stored_tokens == 90 and again.checksum == two.checksum
        assert again.arithmetic.id == two.arithmetic.id
        fused = load_model("tiny-mamba2", backend="exact-fma")
        assert two.checksum == plaintext_checksum(fused.advance(fused.initial_state(), p).state.tensors)


async def test_a_workflow_that_owns_its_stream_opens_it_from_a_stored_prefix(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, backend="auto", owners=(Owner,))
    async with stack.exits:
        system, chunks = toks(80, 60), [toks(5, 61), toks(7, 62)]
        await stack.streams.open("alice", "tiny-mamba2", prefix=system, options=OPTS)  # stores it
        sid = stack.streams.new_id("alice")
        handle = await stack.client.start_workflow(Owner.run, OwnerInput(
            principal="alice", model_id="tiny-mamba2", options=OPTS, chunks=chunks, prefix=system),
            id=sid, task_queue=stack.queue)
        await eventually(lambda: handle.query(Owner.all_fed), timeout=60)
        receipt = await stack.streams.receipt(sid)
        assert (receipt.origin.stored_tokens, receipt.position) == (80, 92)
        m = load_model("tiny-mamba2")
        fed = system + [t for c in chunks for t in c]
        assert receipt.checksum == plaintext_checksum(m.advance(m.initial_state(), fed).state.tensors)
        await stack.streams.cancel(sid)


async def test_agents_that_share_a_system_prompt_open_from_its_state(temporal_env, tmp_path):
    from mamba_stream.workflows import ChatAgent, ChatInput, ChatMessage

    stack = await make_stack(temporal_env, tmp_path, backend="auto")
    async with stack.exits:
        system = "System: answer briefly. Tools: search(query), calc(expr).\n"
        replies, receipts = [], []
        for _ in range(2):
            sid = stack.streams.new_id("alice")
            handle = await stack.client.start_workflow(ChatAgent.run, ChatInput(
                principal="alice", model_id="tiny-mamba2", options=OPTS, reply_tokens=4, system=system),
                id=sid, task_queue=stack.queue)
            replies.append(await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice", text="hi")))
            receipts.append(await stack.streams.receipt(sid))
            await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice"))
        n = len(system.encode())  # tiny-mamba2 reads bytes
        assert [r.origin.stored_tokens for r in receipts] == [0, n] and receipts[1].origin.tokens == n
        # each state is that of one local scan of the prompt, the turn and the reply (sampled: seeded by
        # the stream, so the two replies differ), whichever way the prompt's state came
        m = load_model("tiny-mamba2")
        for reply, receipt in zip(replies, receipts, strict=True):
            fed = list(m.transform.encode(system + "User: hi\nAssistant:")) + reply.tokens
            assert receipt.position == len(fed)
            assert receipt.checksum == plaintext_checksum(m.advance(m.initial_state(), fed).state.tensors)
