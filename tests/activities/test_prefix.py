"""The prefix store (activities.PrefixStore) under the open activity: stored prefix states open
streams with the bits of a stream fed the prefix from position 0; the longest stored prefix is
used; scopes keep principals apart, store calls included; only an exact arithmetic serves or
fills; retention is bounded per scope, least recently used out first; the sweep knows entries.

The activities run through `ActivityEnvironment` on the memory, file and PostgreSQL stores."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from mamba_stream.activities import MemoryStateStore, ModelRegistry, StreamActivities, StreamMetrics, open_store
from mamba_stream.activities._prefix import SCOPES_KIND, SHARED_PRINCIPAL, is_prefix_stream
from mamba_stream.activities._store import StateStore
from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import Keyring, open_bytes, plaintext_checksum
from mamba_stream.workflows import AdvanceChunkRequest, AdvanceRequest, OpenStreamRequest
from tests.activities._env import stream_env
from tests.activities.test_stores import PG_URL
from tests.workflows.test_stream_workflow import digest

MODEL = "tiny-mamba2"


class CountingMeter:
    """A metric meter that keeps every counter's sum by (name, labels), for tests."""

    def __init__(self) -> None:
        self.sums: dict[tuple[str, tuple], float] = defaultdict(float)

    def total(self, name: str, **labels: str) -> float:
        return sum(v for (n, lab), v in self.sums.items()
                   if n == name and all(dict(lab).get(k) == w for k, w in labels.items()))

    def __getattr__(self, attr: str) -> Any:
        if not attr.startswith("create_"):
            raise AttributeError(attr)
        meter = self

        class Instrument:
            def __init__(self, name: str, *_: Any) -> None:
                self.name = name

            def add(self, value: float, labels: dict | None = None) -> None:
                meter.sums[(self.name, tuple(sorted((labels or {}).items())))] += value

            set = record = add

        return Instrument


class Recording(StateStore):
    """A store that records the calls made through it (operation and the scope-free shape of
    the names), forwarding to another."""

    def __init__(self, inner: StateStore) -> None:
        self.inner, self.url, self.calls = inner, inner.url, []

    def __getattribute__(self, name: str) -> Any:
        if name in ("inner", "url", "calls") or name.startswith("_"):
            return object.__getattribute__(self, name)
        attr = getattr(object.__getattribute__(self, "inner"), name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            object.__getattribute__(self, "calls").append(name)
            return attr(*args, **kw)
        return call

    # the abstract methods, so the class can be instantiated (calls go through __getattribute__)
    put_if_absent = get = delete = delete_stream = list_stream = usage = None  # type: ignore[assignment]
    read_meta = put_meta = put_meta_if_absent = delete_meta = None  # type: ignore[assignment]


@pytest.fixture(params=["memory", "file", "postgres"])
def store(request, tmp_path):
    if request.param == "memory":
        yield MemoryStateStore()
    elif request.param == "file":
        yield open_store(f"file://{tmp_path / 'states'}")
    else:
        s = open_store(f"{PG_URL}?table=t_{uuid.uuid4().hex[:12]}")
        yield s
        s.drop()
        s.close()


def acts_for(store: StateStore, ring: Keyring, backend: str = "exact", **kw: Any) -> StreamActivities:
    return StreamActivities(models=ModelRegistry([MODEL], backend=backend), store=store, keyring=ring, **kw)


def tokens(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def open_(acts: StreamActivities, sid: str, prefix: Any, principal: str = "alice"):
    return stream_env(sid).run(acts.open_stream, OpenStreamRequest(stream_id=sid, principal=principal,
                                                                   model_id=MODEL, prefix=prefix))


def feed(acts: StreamActivities, sid: str, receipt, toks: list[int], principal: str = "alice"):
    return stream_env(sid).run(acts.advance_chunk, AdvanceChunkRequest(
        stream_id=sid, principal=principal, receipt=receipt,
        request=AdvanceRequest(principal=principal, chunk_seq=receipt.chunk_seq + 1, tokens=toks))).result


def truth(toks: list[int], backend: str = "exact") -> str:
    m = load_model(MODEL, backend=backend)
    return plaintext_checksum(m.advance(m.initial_state(), toks).state.tensors)


def test_a_stored_prefix_opens_with_the_bits_of_the_prefix_fed_from_position_0_and_the_longest_is_used(store):
    acts = acts_for(store, Keyring.generate())
    p = tokens(700)
    first = open_(acts, "s1", p[:600]).receipt  # computed in the engine's prefill pieces
    assert first.position == 600 and first.checksum == truth(p[:600])
    assert first.origin.kind == "prefix" \
        and first.origin.digest == acts.prefixes.digest(acts.prefixes.scope("alice"), p[:600])
    assert (first.origin.tokens, first.origin.stored_tokens, first.origin.scope) == (600, 0, "")
    again = open_(acts, "s2", p[:600]).receipt
    assert (again.origin.stored_tokens, again.origin.scope) == (600, "principal")
    assert again.checksum == first.checksum
    longer = open_(acts, "s3", p).receipt
    assert (longer.origin.tokens, longer.origin.stored_tokens) == (700, 600)
    assert longer.checksum == truth(p)
    # a shorter prefix than any stored one: nothing stored begins it
    shorter = open_(acts, "s4", p[:599]).receipt
    assert shorter.origin.stored_tokens == 0 and shorter.checksum == truth(p[:599])
    # streams opened from stored states go on as the stream fed everything does, outputs included
    plain = open_(acts, "s5", None).receipt
    assert plain.origin is None
    want = feed(acts, "s5", plain, [*p, 7, 8, 9])
    got = feed(acts, "s2", again, [*p[600:], 7, 8, 9])
    assert got.receipt.checksum == want.receipt.checksum and got.receipt.position == want.receipt.position == 703
    assert got.top_k == want.top_k
    m = load_model(MODEL)
    every = m.advance(m.initial_state(), [*p, 7, 8, 9]).logits  # every position's logits, one local scan
    assert want.output_digest == digest(every) and got.output_digest == digest(every[600:])
    assert got.receipt.origin == again.origin  # every receipt of the epoch names where it began


def test_a_prefix_seen_by_another_principal_is_computed_and_its_store_calls_are_those_of_a_miss(store):
    meter = CountingMeter()
    acts = acts_for(Recording(store), Keyring.generate(), metrics=StreamMetrics(meter), prefix_ram_bytes=0)
    p, q = tokens(300, seed=2), tokens(300, seed=3)
    open_(acts, "a1", p, "alice")
    a_scope = acts.prefixes.scope("alice")
    a_index = store.read_meta(kind=a_scope.index_kind)
    hits = meter.total("mamba_stream_prefix_hits")
    acts.store.calls.clear()
    b = open_(acts, "b1", p, "bob").receipt  # alice holds p
    calls_with, acts.store.calls[:] = list(acts.store.calls), []
    c = open_(acts, "b2", q, "bob").receipt  # nobody holds q
    calls_without = list(acts.store.calls)
    assert calls_with == calls_without  # the same store calls, in the same order: nothing to time
    assert b.origin.model_dump(exclude={"digest"}) == c.origin.model_dump(exclude={"digest"})
    assert (b.origin.stored_tokens, b.origin.scope) == (0, "")
    assert meter.total("mamba_stream_prefix_hits") == hits
    assert store.read_meta(kind=a_scope.index_kind) == a_index  # untouched, its last use included
    assert b.checksum == truth(p)
    # bob's own entry serves bob
    assert open_(acts, "b3", p, "bob").receipt.origin.stored_tokens == 300
    assert meter.total("mamba_stream_prefix_hits", scope="principal") == hits + 1


def test_only_an_exact_arithmetic_serves_or_fills_and_never_another_arithmetics_entry(store):
    ring = Keyring.generate()
    p = tokens(200, seed=4)
    exact, fma = acts_for(store, ring), acts_for(store, ring, backend="exact-fma")
    ref = acts_for(store, ring, backend="reference")
    open_(exact, "e1", p)
    fused = open_(fma, "f1", p).receipt  # another arithmetic: computed, then stored in its own entry
    assert fused.origin.stored_tokens == 0 and fused.checksum == truth(p, "exact-fma")
    assert open_(fma, "f2", p).receipt.origin.stored_tokens == 200
    assert open_(exact, "e2", p).receipt.origin.stored_tokens == 200
    before = exact.prefixes.usage()
    torch_ = open_(ref, "r1", p).receipt  # torch's kernels: computed for each stream, nothing stored
    assert torch_.origin.stored_tokens == 0 and open_(ref, "r2", p).receipt.origin.stored_tokens == 0
    assert exact.prefixes.usage() == before


def test_bad_prefixes_are_refused_typed_and_store_nothing_and_an_empty_one_is_an_ordinary_open(store):
    acts = acts_for(store, Keyring.generate())
    vocab = load_model(MODEL).vocab_size
    with pytest.raises(ApplicationError) as err:
        open_(acts, "x1", [1, 2, vocab])
    assert err.value.type == "TokenOutOfRange" and err.value.non_retryable
    with pytest.raises(ApplicationError) as err:
        stream_env("x2").run(acts.open_stream, OpenStreamRequest(
            stream_id="x2", principal="alice", model_id=MODEL, prefix=tokens(50), max_prefix_tokens=49))
    assert err.value.type == "ChunkTooLarge"
    assert store.list_stream(stream_id="x1") == [] and store.list_stream(stream_id="x2") == []
    assert acts.prefixes.usage().entries == 0 and not [s for s in store.stream_ids() if is_prefix_stream(s)]
    for empty in ([], ""):
        r = open_(acts, f"e{len(str(empty))}", empty).receipt
        assert r.position == 0 and r.origin is None
    # no stream may take the prefix store's ids (disposing one would delete a scope's entries)
    with pytest.raises(ApplicationError) as err:
        open_(acts, "pfx.0123", None)
    assert err.value.type == "InvalidRequest"


def test_a_shared_prefix_serves_every_principal_and_a_longer_prefix_extends_it(store):
    meter = CountingMeter()
    p = tokens(400, seed=5)
    acts = acts_for(store, Keyring.generate(), metrics=StreamMetrics(meter), shared_prefixes={MODEL: [p[:300]]})
    a = open_(acts, "a1", p[:300], "alice").receipt  # the declared prefix itself: computed once, shared
    assert a.origin.stored_tokens == 0 and a.checksum == truth(p[:300])
    b = open_(acts, "b1", p, "bob").receipt  # bob's longer prefix starts from the shared one
    assert (b.origin.stored_tokens, b.origin.scope) == (300, "shared") and b.checksum == truth(p)
    c = open_(acts, "c1", p[:300], "carol").receipt
    assert (c.origin.stored_tokens, c.origin.scope) == (300, "shared")
    assert meter.total("mamba_stream_prefix_tokens", how="computed") == 300 + 100
    shared = acts.prefixes.scope(None)
    assert store.list_stream(stream_id=shared.stream_id)  # sealed for the shared scope
    assert shared.principal == SHARED_PRINCIPAL


def test_retention_is_bounded_per_scope_least_recently_used_first_and_the_sweep_knows_entries(store):
    meter = CountingMeter()
    ring = Keyring.generate()
    probe = acts_for(MemoryStateStore(), ring)
    open_(probe, "p", tokens(10))
    size = probe.prefixes.usage().bytes  # one entry's sealed bytes
    acts = acts_for(store, ring, metrics=StreamMetrics(meter), prefix_bytes=2 * size + size // 2, prefix_ram_bytes=0)
    clock = [1000.0]
    acts.prefixes.clock = lambda: clock[0]
    ps = [tokens(10, seed=s) for s in (10, 11, 12)]
    for i, p in enumerate(ps[:2]):
        clock[0] += 10
        open_(acts, f"s{i}", p)
    clock[0] += 10
    assert open_(acts, "t0", ps[0]).receipt.origin.stored_tokens == 10  # ps[0] is now the recent one
    clock[0] += 10
    open_(acts, "s2", ps[2])  # a third entry: over the bound, the least recently used (ps[1]) goes
    assert meter.total("mamba_stream_prefix_evictions", why="lru") == 1
    assert open_(acts, "t1", ps[1]).receipt.origin.stored_tokens == 0
    assert acts.prefixes.usage().entries == 2
    # bob's entries have a bound of their own: filling his scope evicts nothing of alice's
    for i, p in enumerate(ps[:2]):
        clock[0] += 10
        open_(acts, f"b{i}", p, "bob")
    # (alice's second fill of ps[1] evicted ps[0]; bob's two fills, within his own bound, nothing)
    assert meter.total("mamba_stream_prefix_evictions", why="lru") == 2
    # a fill that died between its blob and its index record: the sweep removes the blob after the grace
    scope = acts.prefixes.scope("alice")
    store.put_if_absent(key=f"{scope.stream_id}.deadbeef", data=b"x", stream_id=scope.stream_id, owner=scope.owner)
    # and a fill lease of a worker that died, and one being renewed: the stale one goes
    leases = f"prefix-fill.{scope.tag}"
    store.put_meta(kind=leases, name="dead", data=json.dumps({"since": clock[0] - 31}).encode())
    store.put_meta(kind=leases, name="live", data=json.dumps({"since": clock[0] - 1}).encode())
    rep = acts.prefixes.sweep(grace_s=60)
    assert set(store.read_meta(kind=leases)) == {"live"}
    assert rep.incomplete == 0 and f"{scope.stream_id}.deadbeef" in store.list_stream(stream_id=scope.stream_id)
    clock[0] += 61
    rep = acts.prefixes.sweep(grace_s=60)
    assert rep.incomplete == 1 and f"{scope.stream_id}.deadbeef" not in store.list_stream(stream_id=scope.stream_id)
    # bob's blobs are bound to a name two bytes shorter than alice's: the sealed header's padding
    # makes them the same size (a blob's length says nothing of its principal's name)
    assert rep.entries == 4 and rep.scopes == 2 and rep.bytes == 4 * size
    assert len(store.read_meta(kind=SCOPES_KIND)) == 2
    record = store.read_meta(kind=SCOPES_KIND)[scope.tag]  # sealed: whose scope it is, for the keys only
    assert b"alice" not in record
    assert json.loads(open_bytes(record, binding=f"prefix-scope|{scope.tag}",
                                 keyring=acts.keyring))["principal"] == "alice"


def test_concurrent_opens_of_one_new_prefix_compute_it_once(store):
    acts = acts_for(store, Keyring.generate())
    model = acts.models.get(MODEL)
    calls, real = [], model.advance
    model.advance = lambda state, toks, **kw: calls.append(len(toks)) or real(state, toks, **kw)  # type: ignore[method-assign]
    p = tokens(900, seed=6)
    out: dict[str, Any] = {}

    def run(i: int) -> None:
        out[i] = open_(acts, f"c{i}", p).receipt

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    piece = acts.engine(model).prefill_piece
    assert sorted(calls) == sorted([piece] * (900 // piece) + [900 % piece])  # one computation, in pieces
    assert {r.checksum for r in out.values()} == {truth(p)}
    assert sorted(r.origin.stored_tokens for r in out.values()) == [0] + [900] * 5


def test_an_index_record_that_names_another_entrys_state_is_not_served(store):
    """Someone with write access to the store's metadata swaps two entries' records (same scope,
    same length): each blob is sealed for its own entry, so neither is served for the other."""
    acts = acts_for(store, Keyring.generate(), prefix_ram_bytes=0)
    p1, p2 = tokens(40, seed=7), tokens(40, seed=8)
    open_(acts, "a", p1)
    open_(acts, "b", p2)
    scope = acts.prefixes.scope("alice")
    index = store.read_meta(kind=scope.index_kind)
    model = acts.models.get(MODEL)
    e1, e2 = acts.prefixes.entry_id(model, scope, p1), acts.prefixes.entry_id(model, scope, p2)
    assert set(index) == {e1, e2}
    store.put_meta(kind=scope.index_kind, name=e1, data=index[e2])
    got = open_(acts, "c", p1).receipt
    assert got.origin.stored_tokens == 0 and got.checksum == truth(p1)


def test_concurrent_opens_on_two_workers_compute_a_new_prefix_once(store):
    """Two workers of one deployment (one store, one keyring): the first to take the entry's fill
    lease computes it, the other waits for its entry; a lease whose worker died is taken over."""
    ring = Keyring.generate()
    workers = [acts_for(store, ring, prefix_ram_bytes=0) for _ in range(2)]
    calls: list[int] = []
    for acts in workers:
        model, real = acts.models.get(MODEL), acts.models.get(MODEL).advance
        model.advance = lambda state, toks, real=real, **kw: calls.append(len(toks)) or real(state, toks, **kw)  # type: ignore
    p = tokens(700, seed=9)
    out: dict[str, Any] = {}

    def run(i: int) -> None:
        out[i] = open_(workers[i % 2], f"w{i}", p).receipt

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    piece = workers[0].engine(workers[0].models.get(MODEL)).prefill_piece
    assert sorted(calls) == sorted([piece] * (700 // piece) + [700 % piece])  # one computation in all
    assert {r.checksum for r in out.values()} == {truth(p)}
    assert sorted(r.origin.stored_tokens for r in out.values()) == [0] + [700] * 5
    scope = workers[0].prefixes.scope("alice")
    assert store.read_meta(kind=f"prefix-fill.{scope.tag}") == {}  # every lease dropped
    # a lease left by a worker that died mid-fill: waited for while fresh, taken over once stale
    q = tokens(60, seed=10)
    eid = workers[0].prefixes.entry_id(workers[0].models.get(MODEL), scope, q)
    clock = [5000.0]
    workers[0].prefixes.clock = lambda: clock[0]
    store.put_meta(kind=f"prefix-fill.{scope.tag}", name=eid, data=json.dumps({"since": 5000.0, "by": "dead"}).encode())
    calls.clear()
    waited = threading.Event()

    def age() -> None:  # the clock moves past the lease's life only once the open is seen waiting
        waited.wait(10)
        clock[0] += 31

    ager = threading.Thread(target=age)
    ager.start()

    def sleeping(s: float) -> None:
        waited.set()
        time.sleep(s)
    workers[0].prefixes.sleep = sleeping
    got = open_(workers[0], "late", q).receipt
    ager.join()
    assert waited.is_set() and sum(calls) == 60 and got.checksum == truth(q) and got.origin.stored_tokens == 0
    assert store.read_meta(kind=f"prefix-fill.{scope.tag}") == {}


class Pausable(StateStore):
    """A store whose every call waits while it is paused: what a worker stalled as a whole (a
    stopped process, a long GC pause) looks like to the store, its lease renewals included."""

    def __init__(self, inner: StateStore) -> None:
        self.inner, self.url, self.running = inner, inner.url, threading.Event()
        self.running.set()

    def __getattribute__(self, name: str) -> Any:
        if name in ("inner", "url", "running") or name.startswith("_"):
            return object.__getattribute__(self, name)
        attr = getattr(object.__getattribute__(self, "inner"), name)
        if not callable(attr):
            return attr
        running = object.__getattribute__(self, "running")

        def call(*args: Any, **kw: Any) -> Any:
            running.wait()
            return attr(*args, **kw)
        return call

    # the abstract methods and the metadata ones, overridden so the store counts as one that keeps
    # metadata (calls go through __getattribute__)
    put_if_absent = get = delete = delete_stream = list_stream = usage = None  # type: ignore[assignment]
    read_meta = put_meta = put_meta_if_absent = delete_meta = swap_meta = None  # type: ignore[assignment]


def test_a_holder_stalled_past_its_lease_has_its_writes_refused_and_the_entry_is_the_taker_s(store):
    """Worker A takes a new prefix's fill lease and stalls while it computes (its renewals stall
    with it); the lease goes stale, worker B takes it over, computes and stores the entry; A wakes:
    its renewal finds the lease B's, its writes are refused by the fence, and it opens its own
    stream from what it computed. One entry stored, B's; nothing lost; every stream exact."""
    ring = Keyring.generate()
    meters = [CountingMeter(), CountingMeter()]
    paused = Pausable(store)
    a = acts_for(paused, ring, metrics=StreamMetrics(meters[0]), prefix_ram_bytes=0)
    b = acts_for(store, ring, metrics=StreamMetrics(meters[1]), prefix_ram_bytes=0)
    for acts in (a, b):
        acts.prefixes.lease_s = 0.6  # stale after 0.6 s: the test does not wait 30 s
    calls: list[list[int]] = [[], []]
    stalled, wake = threading.Event(), threading.Event()
    model_a, real_a = a.models.get(MODEL), a.models.get(MODEL).advance
    model_b, real_b = b.models.get(MODEL), b.models.get(MODEL).advance

    def advance_a(state, toks, **kw):
        if not stalled.is_set():  # A's first piece: the whole worker stops here, store calls and all
            paused.running.clear()
            stalled.set()
            assert wake.wait(60)
            paused.running.set()
        calls[0].append(len(toks))
        return real_a(state, toks, **kw)

    model_a.advance = advance_a  # type: ignore[method-assign]
    model_b.advance = lambda state, toks, **kw: calls[1].append(len(toks)) or real_b(state, toks, **kw)  # type: ignore
    p = tokens(300, seed=11)
    out: dict[str, Any] = {}
    holder = threading.Thread(target=lambda: out.setdefault("a", open_(a, "a1", p).receipt))
    holder.start()
    assert stalled.wait(60)
    scope = b.prefixes.scope("alice")
    lease = store.get_meta(kind=scope.lease_kind, name=b.prefixes.entry_id(model_b, scope, p))
    assert lease is not None  # A's
    taker = open_(b, "b1", p).receipt  # waits for A's lease to go stale, takes it over, computes, stores
    wake.set()
    holder.join(60)
    assert not holder.is_alive()
    assert sum(calls[1]) == 300 and sum(calls[0]) == 300  # both computed (A was mid-computation) ...
    assert taker.checksum == out["a"].checksum == truth(p)  # ... the same bits, exact
    assert meters[0].total("mamba_stream_prefix_leases_lost") == 1  # A's writes were refused
    assert meters[1].total("mamba_stream_prefix_leases_lost") == 0
    assert (meters[0].total("mamba_stream_prefix_bytes_written") == 0
            < meters[1].total("mamba_stream_prefix_bytes_written"))
    index = b.prefixes._index(scope)
    assert len(index) == 1
    (entry,) = index.values()
    assert entry.generation and lease is not None and not lease.startswith(entry.generation.encode())  # B's, not A's
    assert sorted(store.list_stream(stream_id=scope.stream_id)) == [entry.key, entry.key + ".out"]
    assert store.read_meta(kind=scope.lease_kind) == {}  # B released its lease; A's release changed nothing
    # nothing lost: the entry serves the next open, on either worker
    for acts, sid in ((a, "a2"), (b, "b2")):
        again = open_(acts, sid, p).receipt
        assert again.origin.stored_tokens == 300 and again.checksum == truth(p)


def test_a_prefix_digest_is_keyed_per_scope(store):
    """Receipts name a prefix by a digest keyed per scope: bob's and alice's of the same prefix
    differ (neither can test a guess against the other's, nor can anyone without the keys), a
    principal's own opens agree, and a declared shared prefix has one digest for everyone."""
    import hashlib
    import struct

    ring = Keyring.generate()
    p, q = tokens(120, seed=12), tokens(100, seed=13)
    acts = acts_for(store, ring, shared_prefixes={MODEL: [q]})
    a1, a2 = open_(acts, "a1", p, "alice").receipt, open_(acts, "a2", p, "alice").receipt
    b1 = open_(acts, "b1", p, "bob").receipt
    assert a1.origin.digest == a2.origin.digest != b1.origin.digest
    plain = hashlib.sha256(struct.pack(f"<{len(p)}I", *p)).hexdigest()
    assert plain not in a1.origin.digest and a1.origin.digest.startswith("hmac-sha256:")
    assert acts_for(MemoryStateStore(), Keyring.generate()).prefixes.digest(acts.prefixes.scope("alice"), p) \
        != a1.origin.digest  # another deployment's keys, another digest
    sa, sb = open_(acts, "s1", q, "alice").receipt, open_(acts, "s2", q, "bob").receipt
    assert sa.origin.digest == sb.origin.digest == acts.prefixes.digest(acts.prefixes.scope(None), q)
    assert sb.origin.scope == "shared"
    longer = open_(acts, "s3", [*q, 5], "bob").receipt  # past the shared prefix: bob's own
    assert longer.origin.digest == acts.prefixes.digest(acts.prefixes.scope("bob"), [*q, 5])
