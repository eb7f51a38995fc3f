"""A hybrid model served like any other: GraniteMoeHybrid (Mamba-2 and attention layers, the KV as
part of the stream's state) through a real Temporal server, on the default (exact) backend.

Streams fed the same tokens in different chunkings, decode steps between (the slot table's batched
step, which writes each token's KV row at its stream's position), end on one checksum, a local
scan's; checkpoint/resume, fork, rewind and reset keep it; the position bound refuses a chunk
typed and advances nothing.
"""

from __future__ import annotations

import random

import pytest
from temporalio.client import WorkflowUpdateFailedError

from mamba_stream.activities._segments import is_segment_stream
from mamba_stream.scan import load_model
from mamba_stream.state_codec import Receipt, parse_state_key
from mamba_stream.state_codec.codec import plaintext_checksum
from tests.scan._mamba_ssm import require
from tests.workflows.conftest import eventually, make_stack
from tests.workflows.test_stream_workflow import chunking, digest, feed

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_POSITIONS = 96


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory):
    """A seeded tiny dense GraniteMoeHybrid saved by transformers (layers mamba, attention, mamba,
    attention; multipliers not 1), its KV bounded at 96 positions, in segments of 16 rows."""
    require("transformers")
    from tests.scan._hybrid import save_tiny_granite

    return save_tiny_granite(tmp_path_factory.mktemp("granite"), MAX_POSITIONS)


def _segments(stack) -> list[str]:
    """The KV segments in the stack's store, every owner's."""
    store = stack.acts.store
    return [k for ns in store.stream_ids() if is_segment_stream(ns) for k in store.list_stream(stream_id=ns)
            if k.startswith("s-")]


async def _at_zero(stack, sid):
    rec = await stack.streams.receipt(sid)
    return rec if rec is not None and rec.position == 0 else None


async def test_a_hybrid_stream_gives_one_checksum_for_every_chunking_and_keeps_it_through_the_lifecycle(
        temporal_env, tmp_path, granite_dir):
    stack = await make_stack(temporal_env, tmp_path, backend="auto", start_worker=False)
    async with stack.exits:
        await stack.worker(stack.new_activities(backend="auto", models={"granite": str(granite_dir)}))
        rng = random.Random(17)
        prompt, tail = [rng.randrange(256) for _ in range(40)], [rng.randrange(256) for _ in range(7)]
        runs = []
        for chunks in ([40], [1] * 40, chunking(rng, 40)):
            sid = await stack.streams.open("alice", "granite")
            fed = await feed(stack, sid, "alice", prompt, chunks)
            gen = await stack.streams.generate(sid, "alice", 6, temperature=0.0)  # the slot table's steps
            runs.append((sid, fed[-1].receipt, gen.tokens, await stack.streams.advance(sid, "alice", tokens=tail)))
        (sid0, after_prompt, gen0, r0), *others = runs
        assert r0.receipt.backend.startswith("exact:") and r0.receipt.position == 40 + len(gen0) + 7
        for _, fed_rec, gen, r in others:
            assert fed_rec.checksum == after_prompt.checksum
            assert gen == gen0 and r.receipt.checksum == r0.receipt.checksum and r.output_digest == r0.output_digest
        local = load_model(granite_dir)
        one = local.advance(local.initial_state(), prompt + gen0 + tail)
        assert plaintext_checksum(one.state.tensors, schema=local.schema) == r0.receipt.checksum
        assert digest(one.logits[-len(tail):]) == r0.output_digest
        mid = local.advance(local.initial_state(), prompt).state
        assert plaintext_checksum(mid.tensors, schema=local.schema) == after_prompt.checksum

        # checkpoint -> resume in a new stream; fork; both continue as the original does
        cp = await stack.streams.checkpoint(sid0, "alice")
        resumed = await stack.streams.open("alice", "granite", resume=cp.receipt)
        forked = await stack.streams.fork(sid0)
        more = [rng.randrange(256) for _ in range(5)]
        a = await stack.streams.advance(sid0, "alice", tokens=more)
        b = await stack.streams.advance(resumed, "alice", tokens=more)
        c = await stack.streams.advance(forked, "alice", tokens=more)
        assert a.receipt.checksum == b.receipt.checksum == c.receipt.checksum and a.output_digest == b.output_digest
        ref = local.advance(local.initial_state(), prompt + gen0 + tail + more)
        assert plaintext_checksum(ref.state.tensors, schema=local.schema) == a.receipt.checksum
        # six streams of one principal, fed the same 58 tokens in three chunkings, resumed and forked:
        # three segments of 16 rows in the store, each written once and shared
        assert a.receipt.position == 58 and len(_segments(stack)) == 3

        # rewind to just after the prompt's chunk (chunk 1 of the [40] stream): the prompt's state again
        await stack.streams.rewind(sid0, 1)
        assert (await stack.streams.receipt(sid0)).checksum == after_prompt.checksum
        again = await stack.streams.generate(sid0, "alice", 6, temperature=0.0)
        assert again.tokens == gen0

        # reset: position 0, the KV zeroed with the rest; the same prompt gives the same state
        await stack.streams.reset(sid0, "alice")  # a signal: wait for its receipt
        zero = await eventually(lambda: _at_zero(stack, sid0))
        initial = plaintext_checksum(local.initial_state().tensors, schema=local.schema)
        assert zero.position == 0 and zero.checksum == initial
        r = await stack.streams.advance(sid0, "alice", tokens=prompt)
        assert r.receipt.checksum == after_prompt.checksum


async def test_the_position_bound_refuses_a_chunk_typed_and_ends_a_generation_at_it(
        temporal_env, tmp_path, granite_dir):
    """A chunk that would pass max_positions: PositionLimit, nothing advanced; a generation asked for
    more tokens than the room left ends at the bound ("length"); at the bound it is refused."""
    stack = await make_stack(temporal_env, tmp_path, backend="auto", start_worker=False)
    async with stack.exits:
        await stack.worker(stack.new_activities(backend="auto", models={"granite": str(granite_dir)}))
        rng = random.Random(19)
        toks = [rng.randrange(256) for _ in range(MAX_POSITIONS - 4)]
        sid = await stack.streams.open("alice", "granite")
        before = (await stack.streams.advance(sid, "alice", tokens=toks)).receipt
        with pytest.raises(WorkflowUpdateFailedError) as exc:
            await stack.streams.advance(sid, "alice", tokens=[1] * 5)
        assert getattr(exc.value.cause, "type", None) == "PositionLimit"
        assert await stack.streams.receipt(sid) == before
        gen = await stack.streams.generate(sid, "alice", 10, temperature=0.0)
        assert len(gen.tokens) == 4 and gen.finish_reason == "length" and gen.receipt.position == MAX_POSITIONS
        with pytest.raises(WorkflowUpdateFailedError) as exc:
            await stack.streams.generate(sid, "alice", 1, temperature=0.0)
        assert getattr(exc.value.cause, "type", None) == "PositionLimit"
        assert (await stack.streams.receipt(sid)).position == MAX_POSITIONS


async def test_hybrid_prefix_states_at_any_position_end_as_a_stream_fed_everything(
        temporal_env, tmp_path, granite_dir):
    """Prefixes of 37 and 58 tokens (no block alignment): computed once, then taken from the
    principal's prefix store whole or as the start of a longer one; every stream, fed the same
    rest, ends on the checksum and outputs of one fed everything from position 0 (its KV rows and
    its Mamba states alike)."""
    stack = await make_stack(temporal_env, tmp_path, backend="auto", start_worker=False)
    async with stack.exits:
        await stack.worker(stack.new_activities(backend="auto", models={"granite": str(granite_dir)}))
        s = stack.streams
        rng = random.Random(23)
        system, tools, rest = ([rng.randrange(256) for _ in range(n)] for n in (37, 21, 9))
        computed = await s.open("alice", "granite", prefix=system)
        hit = await s.open("alice", "granite", prefix=system)
        longer = await s.open("alice", "granite", prefix=system + tools)
        origins = [(await s.receipt(sid)).origin for sid in (computed, hit, longer)]
        assert [(o.tokens, o.stored_tokens, o.scope) for o in origins] == [
            (37, 0, ""), (37, 37, "principal"), (58, 37, "principal")]
        plain = await s.open("alice", "granite")
        await feed(stack, plain, "alice", system + tools, [58])
        await feed(stack, hit, "alice", tools, [21])
        ends = {}
        for sid in (plain, hit, longer):
            last = await s.advance(sid, "alice", tokens=rest)
            ends[sid] = (last.output_digest, last.receipt.checksum)
        assert ends[hit] == ends[plain] and ends[longer] == ends[plain]
        local = load_model(granite_dir)
        one = local.advance(local.initial_state(), system + tools + rest)
        assert ends[plain] == (digest(one.logits[58:]), plaintext_checksum(one.state.tensors, schema=local.schema))
        # the prefix entries (37, 58) and the three streams (67) share one set of segments: 67 // 16
        assert len(_segments(stack)) == 4


async def test_hybrid_streams_evicted_from_a_one_slot_worker_come_back_exactly(temporal_env, tmp_path, granite_dir):
    """One slot, two streams taking turns: each chunk of one evicts the other to its checkpoint (KV
    rows included), and its next chunk reloads it from the store; both end on the checksum of a
    local scan of their tokens, and of the same stream on a worker that never evicted."""
    stack = await make_stack(temporal_env, tmp_path, backend="auto", start_worker=False)
    async with stack.exits:
        acts = stack.new_activities(backend="auto", models={"granite": str(granite_dir)}, slots=1)
        await stack.worker(acts)
        rng = random.Random(29)
        feeds = {name: [rng.randrange(256) for _ in range(30)] for name in ("a", "b")}
        sids = {name: await stack.streams.open("alice", "granite") for name in feeds}
        last = {}
        for i in range(0, 30, 10):
            for name, sid in sids.items():
                last[name] = await stack.streams.advance(sid, "alice", tokens=feeds[name][i : i + 10])
        gens = {name: await stack.streams.generate(sid, "alice", 3, temperature=0.0) for name, sid in sids.items()}
        assert acts.metrics.migration_count >= 4  # reloads from the store, KV and all
        local = load_model(granite_dir)
        for name in feeds:
            one = local.advance(local.initial_state(), feeds[name] + gens[name].tokens)
            assert gens[name].receipt.checksum == plaintext_checksum(one.state.tensors, schema=local.schema)
            assert last[name].output_digest == digest(local.advance(local.initial_state(), feeds[name]).logits[20:])


@pytest.mark.parametrize("edge", ["computed", "segments-written", "written", "recorded"])
async def test_a_hybrid_worker_killed_at_a_commit_edge_another_worker_finishes_exactly_once(
        temporal_env, tmp_path, granite_dir, edge):
    """SIGKILL after the kernel, after the KV segments (the chunk crosses position 16), after the
    checkpoint, after the record: another worker finishes the chunk once, and the stream ends on a
    local scan's checksum. Nothing lost: every checkpoint of the stream reads back whole, after two
    sweeps too; nothing leaked: after the stream is cancelled, two sweeps leave no segment."""
    import subprocess
    import sys

    from tests.workflows.conftest import FAST
    from tests.workflows.test_stream_workflow import ROOT, _exists

    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        stack.acts = stack.new_activities(models={"granite": str(granite_dir)})
        keyfile, ready = tmp_path / "keyring.json", tmp_path / "ready"
        stack.keyring.save(keyfile)
        await stack.worker(workflows=True, activities=False)
        proc = subprocess.Popen([sys.executable, "-m", "tests.workflows._crash_worker", stack.address, stack.queue,
                                 stack.store_url, str(keyfile), edge, "2", str(ready), "regular",
                                 f"granite={granite_dir}"], cwd=ROOT)
        try:
            await eventually(lambda: _exists(ready), timeout=90)
            tokens = [random.Random(31).randrange(256) for _ in range(30)]
            sid = await stack.streams.open("alice", "granite", options=FAST.model_copy(update={"local_chunks": False}))
            await stack.streams.advance(sid, "alice", tokens=tokens[:10])  # on the doomed worker
            await stack.worker(stack.acts, workflows=False, activities=True)  # the rescuer
            r2 = await stack.streams.advance(sid, "alice", tokens=tokens[10:20])  # the doomed worker dies
            assert proc.wait(timeout=30) == -9
            r3 = await stack.streams.advance(sid, "alice", tokens=tokens[20:])
            model = load_model(granite_dir, backend="reference")
            truth = model.advance(model.initial_state(), tokens)
            assert r2.output_digest == digest(truth.logits[10:20])
            assert r3.receipt.position == 30
            assert r3.receipt.checksum == plaintext_checksum(truth.state.tensors, schema=model.schema)
            stats = await stack.streams.stats(sid)
            assert stats.migrations >= 1 and stats.chunks == 3
            kv, store = stack.acts.commits.segments, stack.acts.store
            for _ in range(2):
                kv.sweep(grace_s=0)
            fresh = stack.new_activities(models={"granite": str(granite_dir)})  # nothing in memory
            local = load_model(granite_dir)
            for key in store.list_stream(stream_id=sid):
                parsed = parse_state_key(key)
                if parsed is not None:
                    rec = fresh.commits.prior(key, "alice")
                    receipt = r3.receipt if key == r3.receipt.state_key else Receipt.model_validate(
                        rec.result["receipt"]) if rec is not None and "receipt" in rec.result else None
                    if receipt is not None:
                        state = fresh.commits.fetch(local, receipt, "alice")[0]
                        assert plaintext_checksum(state.tensors, schema=local.schema) == receipt.checksum
            segments = [k for ns in store.stream_ids() if is_segment_stream(ns)
                        for k in store.list_stream(stream_id=ns) if k.startswith("s-")]
            assert len(segments) == 1  # 30 // 16, written once whatever died where
            await stack.streams.cancel(sid, "alice")

            async def disposed():
                return not store.list_stream(stream_id=sid) or None

            await eventually(disposed)
            for _ in range(2):
                kv.sweep(grace_s=0)
            assert not [ns for ns in store.stream_ids() if is_segment_stream(ns)]
        finally:
            if proc.poll() is None:
                proc.kill()
