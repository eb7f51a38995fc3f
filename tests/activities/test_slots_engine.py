"""The slot table and the stream engine: identity moves with state, reuse never leaks, batching
and prefill splitting change no result."""

from __future__ import annotations

import copy
import gc
import mmap
import os
import sys
import threading
import time
import weakref

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mamba_stream.activities._engine import NeedsLoad, SeededSampler, StreamEngine, sample_rows
from mamba_stream.activities._engine import _sample_one as _sample  # the per-row path, which batching must match
from mamba_stream.activities._slots import SlotTable, StaleSlot
from mamba_stream.scan import InvalidState, NonFiniteOutput, load_model
from tests._pages import pages_in_memory
from tests.scan._helpers import model_for, tokens

MODEL = "tiny-mamba2"


def test_release_zeroes_and_the_next_occupant_starts_fresh():
    model = model_for(MODEL)
    table = SlotTable(model, 2)
    used = model.advance(model.initial_state(), tokens(30, 1))
    h = table.insert("a", used.state, epoch=0, state_key="k-a", logits=used.logits[-1])
    assert table.release("a") and len(table) == 0
    assert all(not bool(b[h.slot].abs().sum()) for b in table.buffers.values())
    assert not bool(table.logits[h.slot].abs().sum())
    with pytest.raises(StaleSlot):
        table.view(h)  # the old handle cannot read the slot
    h2 = table.insert("b", model.initial_state(), epoch=0, state_key="k-b")
    assert h2.slot == h.slot and h2.generation != h.generation
    toks = tokens(12, 2)
    via_slot = model.advance(table.view(h2), toks)
    fresh = model.advance(model.initial_state(), toks)
    assert torch.equal(via_slot.logits, fresh.logits) and via_slot.state.equal(fresh.state)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pagemap is Linux's")
def test_a_tables_memory_is_that_of_the_slots_used_not_of_its_capacity():
    """The buffers read as zeros and take memory page by page as slots are written: a table of 8
    slots with one stream in has that slot's pages in memory and none of the 7 others' (a 7B
    Mamba-2's 7 slots are 1.95 GB), and an empty slot still reads as zeros."""
    model = model_for(MODEL)
    table = SlotTable(model, 8)
    name, buf = max(table.buffers.items(), key=lambda kv: kv[1].numel())
    per_slot = buf[0].numel() * buf.element_size()
    assert per_slot >= 3 * mmap.PAGESIZE, (name, per_slot)  # whole pages inside each slot
    assert not any(pages_in_memory(buf))
    used = model.advance(model.initial_state(), tokens(30, 1))
    h = table.insert("a", used.state, epoch=0, state_key="k-a", logits=used.logits[-1])
    assert all(pages_in_memory(buf[h.slot]))
    others = [s for s in range(8) if s != h.slot]
    assert not any(p for s in others for p in pages_in_memory(buf[s]))
    assert not bool(buf[others[0]].abs().sum()) and torch.equal(table.view(h).tensors[name], used.state.tensors[name])
    # the pages are this process's own: a child forked now writes its copy, never the parent's
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        buf[others[0]].fill_(7.0)
        os._exit(0 if bool(buf[others[0]].ne(0).all()) else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert not bool(buf[others[0]].abs().sum())


def test_a_table_admits_only_its_own_schema():
    table = SlotTable(model_for(MODEL), 2)
    other = load_model("tiny-mamba3")  # another recurrence
    with pytest.raises(InvalidState):
        table.insert("x", other.initial_state(), epoch=0, state_key="k")
    wide = model_for(MODEL, dtype="float64")  # same shapes, another dtype
    with pytest.raises(InvalidState):
        table.insert("y", wide.initial_state(), epoch=0, state_key="k")


def test_a_batched_step_answers_in_handle_order_whatever_the_slot_order():
    model = model_for(MODEL)
    table = SlotTable(model, 4)
    fed = {name: tokens(n, n) for name, n in (("a", 5), ("b", 9), ("c", 2))}
    handles = {name: table.insert(name, model.advance(model.initial_state(), t).state, epoch=0, state_key=None)
               for name, t in fed.items()}
    order = ["c", "a", "b"]  # slots 2, 0, 1: stepped as one span, answered in this order
    logits, _ = table.step([handles[n] for n in order], [7, 8, 9])
    for i, (name, tok) in enumerate(zip(order, [7, 8, 9], strict=True)):
        solo = model.advance(model.initial_state(), fed[name] + [tok])
        assert torch.equal(logits[i], solo.logits[-1])
        assert torch.equal(table.next_logits(handles[name]), solo.logits[-1])
        assert table.view(handles[name]).equal(solo.state)


class SlotsAgainstSoloRuns(RuleBasedStateMachine):
    """Random insert / remove / advance; every stream's slot must equal its solo run."""

    @initialize()
    def setup(self):
        self.model = model_for(MODEL)
        self.table = SlotTable(self.model, 4)
        self.solo: dict[str, object] = {}
        self.fed: dict[str, list[int]] = {}
        self.n = 0

    @precondition(lambda self: self.table.free > 0)
    @rule(prefix=st.lists(st.integers(0, 255), max_size=6))
    def insert(self, prefix):
        self.n += 1
        sid = f"s{self.n}"
        state = self.model.advance(self.model.initial_state(), prefix).state
        self.table.insert(sid, state, epoch=0, state_key=None)
        self.solo[sid] = state
        self.fed[sid] = list(prefix)

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data())
    def remove(self, data):
        sid = data.draw(st.sampled_from(sorted(self.solo)))
        h = self.table.handle(sid)
        assert self.table.release(sid)
        with pytest.raises(StaleSlot):
            self.table.view(h)
        del self.solo[sid]

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data(), toks=st.lists(st.integers(0, 255), min_size=0, max_size=4))
    def advance(self, data, toks):
        sids = data.draw(st.lists(st.sampled_from(sorted(self.solo)), min_size=1, max_size=3, unique=True))
        handles = [self.table.handle(s) for s in sids]
        results = self.model.advance_batch([self.table.view(h) for h in handles], [toks] * len(sids))
        for s, h, r in zip(sids, handles, results, strict=True):
            self.table.write(h, r.state, r.logits[-1] if toks else None, state_key=None)
            self.solo[s] = self.model.advance(self.solo[s], toks).state

    @invariant()
    def every_slot_equals_its_solo_run(self):
        if not hasattr(self, "table"):
            return
        for sid, state in self.solo.items():
            got = self.table.view(self.table.handle(sid))
            assert got.equal(state), sid
            assert self.table.meta[self.table.handle(sid).slot].stream_id == sid


SlotsAgainstSoloRuns.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_slots_against_solo_runs = SlotsAgainstSoloRuns.TestCase


def _engine(**kw) -> StreamEngine:
    return StreamEngine(model_for(MODEL), **kw)


def test_engine_batches_concurrent_decode_steps_and_equals_solo_runs():
    model = model_for(MODEL)
    engine = _engine(capacity=16, max_batch=16, max_wait_s=0.02)
    try:
        prefixes = {f"s{i}": tokens(5 + i, i) for i in range(12)}
        for sid, pre in prefixes.items():
            r = model.advance(model.initial_state(), pre)
            engine.put(sid, r.state, epoch=0, state_key=f"{sid}-0", logits=r.logits[-1])
        outs: dict[str, list] = {}

        def stream(sid: str) -> None:
            key, got = f"{sid}-0", []
            for i, tok in enumerate(tokens(6, hash(sid) % 1000)):
                out = engine.advance(sid, [tok], expected_key=key, epoch=0,
                                     load=lambda: (_ for _ in ()).throw(AssertionError))
                key = f"{sid}-{i + 1}"
                engine.mark_committed(sid, key)
                got.append((tok, out))
            outs[sid] = got

        threads = [threading.Thread(target=stream, args=(sid,)) for sid in prefixes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.stats.max_batch > 1  # steps of different streams ran together
        for sid, pre in prefixes.items():
            state = model.advance(model.initial_state(), pre).state
            for tok, out in outs[sid]:
                solo = model.advance(state, [tok])
                assert torch.equal(out.logits, solo.logits) and out.state.equal(solo.state)
                state = solo.state
    finally:
        engine.close()


def test_a_long_prefill_does_not_starve_decode_and_is_split_invisibly():
    model = model_for(MODEL)
    # pieces of exactly `prefill_piece` tokens, however slow a loaded box makes one (`piece_s`)
    engine = _engine(prefill_piece=128, max_wait_s=0.0, piece_s=float("inf"))
    try:
        engine.put("long", model.initial_state(), epoch=0, state_key="l0")
        engine.put("fast", model.initial_state(), epoch=0, state_key="f0")
        big = tokens(2048, 9)
        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("long", engine.advance(
            "long", big, expected_key="l0", epoch=0, load=lambda: None)))
        t.start()
        time.sleep(0.05)
        waits, key = [], "f0"
        for i in range(10):
            t0 = time.perf_counter()
            engine.advance("fast", [i], expected_key=key, epoch=0, load=lambda: None)
            waits.append(time.perf_counter() - t0)
            key = f"f{i + 1}"
            engine.mark_committed("fast", key)
        t.join()
        whole = model.advance(model.initial_state(), big)
        assert torch.equal(result["long"].logits, whole.logits) and result["long"].state.equal(whole.state)
        piece = model.advance(model.initial_state(), big[:128])
        t0 = time.perf_counter()
        model.advance(piece.state, big[128:256])
        one_piece = time.perf_counter() - t0
        assert engine.stats.pieces == 16
        assert max(waits) < 10 * one_piece + 0.05, (max(waits), one_piece)  # bounded by a piece, not the chunk
    finally:
        engine.close()


def test_a_chunk_that_keeps_only_its_last_row_gives_the_same_state_and_next_logits():
    """`keep_rows=False` (a prefix's computation): the other rows are never kept, and what is kept
    is bit for bit what a chunk keeping every row gives, single-token chunks included."""
    model = model_for(MODEL)
    engine = _engine(prefill_piece=64, max_wait_s=0.0)
    try:
        for n in (1, 2, 300):
            big = tokens(n, 3 + n)
            outs = []
            for keep in (True, False):
                sid = f"s{n}{keep}"
                outs.append(engine.advance(sid, big, expected_key=f"{sid}/0", epoch=0, keep_rows=keep,
                                           load=lambda: (model.initial_state(), None)))
                engine.release(sid)
            full, last = outs
            assert full.logits.shape == (n, model.vocab_size) and last.logits.shape == (0, model.vocab_size)
            assert torch.equal(last.last_logits, full.last_logits) and torch.equal(last.last_logits, full.logits[-1])
            assert last.state.equal(full.state) and last.path == full.path
    finally:
        engine.close()


def test_eviction_writes_nothing_and_the_next_chunk_reloads():
    model = model_for(MODEL)
    engine = _engine(capacity=2)
    try:
        states = {s: model.advance(model.initial_state(), tokens(4, i)).state for i, s in enumerate("abc")}
        for s, st_ in states.items():
            engine.put(s, st_, epoch=0, state_key=f"{s}0")
        assert not engine.holds("a", "a0") and engine.stats.evictions == 1  # "a" was least recently used
        loads = []

        def load():
            loads.append(1)
            return states["a"], None

        out = engine.advance("a", [1, 2], expected_key="a0", epoch=0, load=load)
        assert loads == [1] and engine.stats.loads == 1
        assert out.state.equal(model.advance(states["a"], [1, 2]).state)
        with pytest.raises(NeedsLoad):
            engine.advance("zzz", [1], expected_key="nope", epoch=0, load=lambda: (_ for _ in ()).throw(NeedsLoad()))
    finally:
        engine.close()


def _collected(ref: weakref.ref, timeout: float = 5.0) -> bool:
    """Whether the object behind `ref` is gone (the engine thread may be between two calls)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.01)
    return False


def test_the_engine_keeps_no_state_it_was_given_beyond_its_slot():
    """A put's state and a chunk's loaded state are copied into the slot and let go: the engine
    thread, idle after its last call, holds no reference (each is a whole state: 279 MB for a 7B
    Mamba-2, a second copy for as long as the engine waited)."""
    model = model_for(MODEL)
    engine = _engine(capacity=2)
    try:
        put = model.advance(model.initial_state(), [5, 6, 7]).state
        held = weakref.ref(next(iter(put.tensors.values())))
        engine.put("a", put, epoch=0, state_key="a0")
        del put
        assert _collected(held), "the engine still holds the state it was put"
        loaded = model.advance(model.initial_state(), [8, 9]).state
        want = model.advance(loaded, [1, 2])
        held = weakref.ref(next(iter(loaded.tensors.values())))
        box = [(loaded, None)]
        del loaded
        out = engine.advance("b", [1, 2], expected_key="b0", epoch=0, load=lambda: box.pop())
        assert out.state.equal(want.state) and engine.stats.loads == 1
        assert _collected(held), "the engine still holds the state a chunk loaded"
        assert engine.holds("a", "a0")  # the slot's copy, all the same
    finally:
        engine.close()


def test_release_zeroes_the_slot():
    model = model_for(MODEL)
    engine = _engine(capacity=2)
    try:
        engine.put("a", model.advance(model.initial_state(), [5, 6, 7]).state, epoch=0, state_key="a0")
        slot = engine.slots.handle("a").slot
        assert engine.release("a") and not engine.release("a")
        assert all(not bool(b[slot].abs().sum()) for b in engine.slots.buffers.values())
        assert not engine.holds("a", "a0")
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["prefill", "decode", "generate"])
def test_a_retry_of_an_uncommitted_chunk_reloads_its_receipts_state_not_the_slots(kind):
    """Issue 31: a chunk ran in its slot but its checkpoint never reached the store (a read-only
    store refused the write), so the attempt is retried from the same receipt. The slot now holds
    the chunk's uncommitted result, not the receipt's state: the retry must reload the receipt's
    state and give, bit for bit, what the first attempt gave. An admission that kept the slot's
    stale committed key served the retry from the advanced slot (the chunk applied twice)."""
    model = model_for(MODEL)
    engine = _engine(capacity=4, max_wait_s=0.0)
    try:
        start = model.advance(model.initial_state(), tokens(7, 21))
        stored = (start.state, start.logits[-1])  # the receipt's checkpoint "a0", as the store has it
        engine.put("a", start.state, epoch=0, state_key="a0", logits=start.logits[-1])
        fed = {"prefill": tokens(9, 22), "decode": [17], "generate": []}[kind]
        loads: list[int] = []

        def load():
            loads.append(1)
            return stored

        def chunk():
            if kind == "generate":
                return engine.generate("a", SeededSampler(1.0, 0, torch.Generator().manual_seed(5)), 4,
                                       expected_key="a0", epoch=0, load=load)
            return engine.advance("a", fed, expected_key="a0", epoch=0, load=load)

        first = chunk()
        assert loads == []  # the first attempt ran hot, from the slot "a0" was put in
        retry = chunk()  # no engine.mark_committed("a", ...) between them: the store refused the checkpoint
        if kind == "generate":
            toks, logits, state, last = _decode_alone(model, start.state, start.logits[-1], (1.0, 0, 5), 4)
        else:
            truth = model.advance(start.state, fed)
            toks, logits, state, last = fed, truth.logits, truth.state, truth.logits[-1]
        for name, out in (("first attempt", first), ("retry", retry)):
            assert out.tokens == toks, f"{name}: other tokens"
            assert out.state.position == state.position == start.state.position + len(toks), \
                f"{name}: at position {out.state.position}, not {start.state.position + len(toks)}"
            assert out.state.equal(state), f"{name}: another state than the receipt's advanced by the chunk"
            assert torch.equal(out.logits, logits), f"{name}: other logits"
            assert torch.equal(out.last_logits, last), f"{name}: other next-token logits"
        assert loads == [1] and engine.stats.loads == 1  # the retry reloaded from the store, not hot
        # the slot runs ahead of every committed key until the retry's checkpoint is in the store
        assert not engine.holds("a", "a0") and "a" not in engine.hot_stream_ids()
        engine.mark_committed("a", "a1")  # the retry's checkpoint made it: the next chunk runs hot from it
        assert engine.holds("a", "a1")
        nxt = engine.advance("a", [3], expected_key="a1", epoch=0,
                             load=lambda: (_ for _ in ()).throw(AssertionError))
        assert nxt.state.equal(model.advance(state, [3]).state) and engine.stats.loads == 1
    finally:
        engine.close()


# --- batched decode: in-place steps, batched sampling ----------------------------------------------


def _decode_alone(model, state, first_logits, sampler_args, max_tokens):
    """One stream decoded alone, one `advance` per token, sampled one row at a time (`_sample_one`):
    (tokens, logits (n, V), final state, last logits)."""
    temperature, top_k, seed = sampler_args
    gen = torch.Generator().manual_seed(seed)
    toks, rows, nxt = [], [], first_logits
    for _ in range(max_tokens):
        tok = _sample(nxt, temperature, top_k, gen)
        toks.append(tok)
        step = model.advance(state, [tok])
        rows.append(step.logits)
        state, nxt = step.state, step.logits[-1]
    return toks, torch.cat(rows), state, nxt


#: (temperature, top_k, seed) per stream: greedy, plain, top-k, a top-k wider than the vocabulary
SAMPLING = [(1.0, 0, 11), (0.0, 0, 12), (0.7, 5, 13), (1.3, 0, 14), (1.0, 1, 15), (0.9, 300, 16)]


@pytest.mark.parametrize("backend", ["exact", "reference"])
def test_batched_decode_of_many_streams_equals_each_decoded_alone_bit_for_bit(backend):
    """12 streams generating at once, half with a SeededSampler (sampled as a batch) and half with
    a plain callable: every token, every logits row, the last logits and the final state are
    each stream's solo run's, bit for bit."""
    model = model_for(MODEL, backend)
    engine = StreamEngine(model, capacity=16, max_batch=16, max_wait_s=0.02)
    n_tokens = 9
    try:
        prefixes = {f"s{i}": tokens(3 + i, 100 + i) for i in range(12)}
        starts = {}
        for sid, pre in prefixes.items():
            r = model.advance(model.initial_state(), pre)
            starts[sid] = r
            engine.put(sid, r.state, epoch=0, state_key=f"{sid}-0", logits=r.logits[-1])
        outs: dict = {}

        def stream(i: int, sid: str) -> None:
            temperature, top_k, seed = SAMPLING[i % len(SAMPLING)]
            gen = torch.Generator().manual_seed(seed)
            taken: list[int] = []
            if i % 2:
                sampler = SeededSampler(temperature, top_k, gen, taken=taken.append)
            else:
                sampler = lambda lg: _sample(lg, temperature, top_k, gen)  # noqa: E731
            outs[sid] = (engine.generate(sid, sampler, n_tokens, expected_key=f"{sid}-0", epoch=0,
                                         load=lambda: (_ for _ in ()).throw(AssertionError)), taken)

        threads = [threading.Thread(target=stream, args=(i, sid)) for i, sid in enumerate(prefixes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.stats.max_batch > 1
        for i, sid in enumerate(prefixes):
            out, taken = outs[sid]
            toks, logits, state, last = _decode_alone(model, starts[sid].state, starts[sid].logits[-1],
                                                      SAMPLING[i % len(SAMPLING)], n_tokens)
            assert out.tokens == toks, sid
            assert i % 2 == 0 or taken == toks
            assert torch.equal(out.logits, logits) and out.state.equal(state) and torch.equal(out.last_logits, last)
            # the slot holds the same state, and stepping went on in place, not in a copy
            assert engine.slots.view(engine.slots.handle(sid)).equal(state)
    finally:
        engine.close()


@pytest.mark.parametrize("rows", [[1, 2, 3], [4, 0, 2]], ids=["span", "scattered"])
def test_an_in_place_step_changes_only_its_own_slots(rows):
    model = model_for(MODEL, "exact")
    table = SlotTable(model, 6)
    fed = {f"s{i}": tokens(2 + i, 40 + i) for i in range(5)}
    handles = {sid: table.insert(sid, model.advance(model.initial_state(), t).state, epoch=0, state_key=None)
               for sid, t in fed.items()}
    before = {k: v.clone() for k, v in table.buffers.items()}
    stepped = [f"s{r}" for r in rows]
    logits, path = table.step([handles[s] for s in stepped], [5, 6, 7])
    assert path == "exact"
    for i, (sid, tok) in enumerate(zip(stepped, [5, 6, 7], strict=True)):
        solo = model.advance(model.advance(model.initial_state(), fed[sid]).state, [tok])
        assert torch.equal(logits[i], solo.logits[0]) and table.view(handles[sid]).equal(solo.state)
    for sid in sorted(set(fed) - set(stepped)):
        slot = handles[sid].slot
        assert all(torch.equal(table.buffers[k][slot], before[k][slot]) for k in before), sid
    assert all(not bool(b[5].abs().sum()) for b in table.buffers.values())  # the free slot stays zero


def test_a_failed_in_place_step_drops_its_streams_and_spares_the_others():
    model = copy.deepcopy(load_model(MODEL, backend="exact"))
    table = SlotTable(model, 4)
    states = {s: model.advance(model.initial_state(), tokens(4, i)).state for i, s in enumerate("abc")}
    handles = {s: table.insert(s, st_, epoch=0, state_key=f"{s}0") for s, st_ in states.items()}
    with torch.no_grad():
        model.module.backbone.layers[1].mixer.out_proj.weight.fill_(float("inf"))
    with pytest.raises(NonFiniteOutput):
        table.step([handles["a"], handles["b"]], [1, 2])  # layer 0 wrote its states in place
    assert table.handle("a") is None and table.handle("b") is None and len(table) == 1
    for s in "ab":  # zeroed, and the old handles cannot read them
        assert all(not bool(b[handles[s].slot].abs().sum()) for b in table.buffers.values())
        with pytest.raises(StaleSlot):
            table.view(handles[s])
    assert table.view(handles["c"]).equal(states["c"])


def test_an_evicted_stream_reloads_and_continues_exactly():
    """Generate, commit, get evicted by other streams, reload the committed state from the
    'store', generate on: the same tokens, logits and state as one uninterrupted decode."""
    model = model_for(MODEL, "exact")
    engine = StreamEngine(model, capacity=2, max_wait_s=0.0)
    try:
        start = model.advance(model.initial_state(), tokens(6, 3))
        gen = torch.Generator().manual_seed(7)
        engine.put("a", start.state, epoch=0, state_key="a0", logits=start.logits[-1])
        first = engine.generate("a", SeededSampler(1.0, 0, gen), 5, expected_key="a0", epoch=0,
                                load=lambda: (_ for _ in ()).throw(AssertionError))
        engine.mark_committed("a", "a1")
        stored = (first.state, first.last_logits)  # what the activity seals into the store
        for s in "bc":
            engine.put(s, model.initial_state(), epoch=0, state_key=f"{s}0")
        assert not engine.holds("a", "a1") and engine.stats.evictions >= 1
        second = engine.generate("a", SeededSampler(1.0, 0, gen), 6, expected_key="a1", epoch=0,
                                 load=lambda: stored)
        assert engine.stats.loads == 1
        toks, logits, state, last = _decode_alone(model, start.state, start.logits[-1], (1.0, 0, 7), 11)
        assert first.tokens + second.tokens == toks
        assert torch.equal(torch.cat([first.logits, second.logits]), logits)
        assert second.state.equal(state) and torch.equal(second.last_logits, last)
    finally:
        engine.close()


def test_sample_rows_gives_each_row_its_own_samplers_token_and_generator_state():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(24, 256, generator=g) * 4
    logits[3, 17] = logits[3, 90] = 50.0  # a tie for the greedy and top-k rows to break the same way
    for seed in range(20):
        params = [SAMPLING[(seed + i) % len(SAMPLING)] for i in range(24)]
        batch = [SeededSampler(t, k, torch.Generator().manual_seed(seed * 100 + i))
                 for i, (t, k, _) in enumerate(params)]
        alone = [torch.Generator().manual_seed(seed * 100 + i) for i in range(24)]
        got = sample_rows(logits, batch)
        want = [_sample(logits[i], t, k, alone[i]) for i, (t, k, _) in enumerate(params)]
        assert got == want, seed
        assert all(torch.equal(s.generator.get_state(), a.get_state()) for s, a in zip(batch, alone, strict=True))


def test_a_row_that_cannot_be_sampled_fails_its_own_stream_only():
    model = model_for(MODEL, "exact")
    engine = StreamEngine(model, capacity=4, max_batch=4, max_wait_s=0.05)
    try:
        start = model.advance(model.initial_state(), [1, 2, 3])
        for s in "ab":
            engine.put(s, start.state, epoch=0, state_key=f"{s}0", logits=start.logits[-1])
        # stream b's distribution turns NaN after its first token, when it samples with the batch
        poisoned = SeededSampler(1.0, 0, torch.Generator().manual_seed(2))
        calls = []

        def proceed() -> bool:
            calls.append(1)
            if len(calls) == 2:
                poisoned.temperature = float("nan")
            return True

        poisoned.proceed = proceed
        results: dict = {}

        def run(s: str, sampler) -> None:
            try:
                results[s] = engine.generate(s, sampler, 4, expected_key=f"{s}0", epoch=0, load=lambda: None)
            except Exception as exc:  # noqa: BLE001
                results[s] = exc

        threads = [threading.Thread(target=run, args=("a", SeededSampler(1.0, 0, torch.Generator().manual_seed(1)))),
                   threading.Thread(target=run, args=("b", poisoned))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert isinstance(results["b"], NonFiniteOutput)
        toks, _logits, state, _ = _decode_alone(model, start.state, start.logits[-1], (1.0, 0, 1), 4)
        assert results["a"].tokens == toks and results["a"].state.equal(state)
        assert len(calls) == 2 and engine.slots.handle("b") is None  # the failed stream's slot was dropped
    finally:
        engine.close()


def test_a_lone_stream_does_not_wait_for_company():
    """max_wait_s gathers steps of streams that are active; one stream alone steps at once
    (with the wait, these 6 steps would take 3 s)."""
    import time

    model = model_for(MODEL)
    engine = _engine(capacity=4, max_batch=16, max_wait_s=0.5)
    try:
        r = model.advance(model.initial_state(), tokens(5, 1))
        engine.put("solo", r.state, epoch=0, state_key="k0", logits=r.logits[-1])
        t0 = time.perf_counter()
        key = "k0"
        for i, tok in enumerate(tokens(6, 2)):
            engine.advance("solo", [tok], expected_key=key, epoch=0, load=lambda: (_ for _ in ()).throw(AssertionError))
            key = f"k{i + 1}"
            engine.mark_committed("solo", key)
        assert time.perf_counter() - t0 < 1.5
        assert engine.stats.steps == 6 and engine.stats.max_batch == 1
    finally:
        engine.close()


def test_the_engine_reports_its_pace_once_it_has_run():
    """`expected_seconds` (what a local attempt asks before it takes a chunk on): None before the
    engine's first round, then proportional to the rounds asked about."""
    model = model_for(MODEL)
    engine = _engine(capacity=2, max_wait_s=0.0)
    try:
        assert engine.expected_seconds(10) is None
        r = model.advance(model.initial_state(), tokens(4, 3))
        engine.put("s", r.state, epoch=0, state_key="k0", logits=r.logits[-1])
        engine.advance("s", [7], expected_key="k0", epoch=0, load=lambda: (_ for _ in ()).throw(AssertionError))
        import time

        deadline = time.monotonic() + 5  # the engine thread records the round just after it answers
        while engine.expected_seconds(1) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        one = engine.expected_seconds(1)
        assert one is not None and one > 0 and engine.expected_seconds(100) == pytest.approx(100 * one)
    finally:
        engine.close()
