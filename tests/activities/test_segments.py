"""KV segments (issue 45 item 4): a hybrid's checkpoints hold the Mamba states and the KV's tail,
and name sealed, content-addressed segments of 16 rows that commits write once and share; a sweep
deletes what no checkpoint names any more, and never what a commit has taken since it looked.

A tiny GraniteMoeHybrid saved by transformers (bound 96, so segments of 16 rows), on the exact
backend, committed through `ChunkCommit` into an in-memory store (the fenced delete is tested on
every store in test_stores.py; the file and PostgreSQL stores serve segments in the workflow tests)."""

from __future__ import annotations

import random

import pytest
import torch

from mamba_stream.activities import MemoryStateStore, StateStore, open_store
from mamba_stream.activities._commit import ChunkCommit
from mamba_stream.activities._segments import SEEN_KIND, is_segment_stream
from mamba_stream.scan import load_model
from mamba_stream.state_codec import ChecksumMismatch, CorruptBlob, SegmentMissing
from mamba_stream.state_codec.codec import Keyring, plaintext_checksum, seal, split_state, unseal
from tests.scan._mamba_ssm import require

ROWS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    require("transformers")
    from tests.scan._hybrid import save_tiny_granite

    m = load_model(save_tiny_granite(tmp_path_factory.mktemp("granite")), backend="exact")
    assert m.schema.layers is not None and m.schema.layers.kv_segment_rows == ROWS
    return m


@pytest.fixture(scope="module")
def tokens():
    rng = random.Random(45)
    return [rng.randrange(256) for _ in range(90)]


def _objects(store: StateStore) -> dict[str, list[str]]:
    """The store's segments and refs objects, by owner namespace."""
    return {sid: store.list_stream(stream_id=sid) for sid in store.stream_ids() if is_segment_stream(sid)}


def _segment_keys(store: StateStore) -> set[str]:
    return {k for keys in _objects(store).values() for k in keys if k.startswith("s-")}


class _Stream:
    """A stream committed chunk by chunk through `ChunkCommit`, as the activities do."""

    def __init__(self, commits: ChunkCommit, model, sid: str, principal: str = "alice") -> None:
        self.commits, self.model, self.sid, self.principal = commits, model, sid, principal
        state = model.initial_state()
        self.done = commits.commit(model, state, stream_id=sid, principal=principal, chunk_seq=0, epoch=0,
                                   key=commits.state_key(sid, 0, 0, "open|initial"), backend="exact", before=None)
        self.receipts = [self.done.receipt]
        self.sizes: list[int] = []

    def feed(self, toks: list[int]) -> None:
        before = self.done.receipt
        state = self.model.advance(self.done.state, toks).state
        seq = before.chunk_seq + 1
        key = self.commits.chunk_key(self.sid, before, seq, str(toks))
        self.done = self.commits.commit(self.model, state, stream_id=self.sid, principal=self.principal,
                                        chunk_seq=seq, epoch=0, key=key, backend="exact", before=before)
        self.receipts.append(self.done.receipt)
        self.sizes.append(len(self.commits.store.get(key=key, owner=self.commits.owner(self.principal))))

    def fetch(self, receipt=None):
        return self.commits.fetch(self.model, receipt or self.done.receipt, self.principal)[0]


def _equal(a, b) -> bool:
    return a.position == b.position and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_segments_are_cut_at_positions_so_every_chunking_gives_the_same_ones_and_checksum(model, tokens):
    whole = model.advance(model.initial_state(), tokens).state
    pieces, state = [1, 7, 30, 52], model.initial_state()
    at = 0
    for n in pieces:
        state = model.advance(state, tokens[at : at + n]).state
        at += n
    body_a, segs_a = split_state(model.schema, whole.tensors, 90)
    _, segs_b = split_state(model.schema, state.tensors, 90)
    assert [s.first for s in segs_a] == [0, 16, 32, 48, 64] and [s.digest for s in segs_a] == [s.digest for s in segs_b]
    kv = [t.name for t in model.schema.tensors if t.rows == "position"]
    assert kv and all(body_a[n].shape[0] == 10 and torch.equal(body_a[n], whole.tensors[n][80:]) for n in kv)
    checksum = plaintext_checksum(whole.tensors, schema=model.schema)
    assert checksum == plaintext_checksum(state.tensors, schema=model.schema)
    # a row changed in a full segment changes that segment's digest and the checksum, nothing else
    bent = {k: v.clone() for k, v in whole.tensors.items()}
    bent[kv[0]][20, 0, 0] += 1.0
    segs_c = split_state(model.schema, bent, 90)[1]
    assert [a.digest == c.digest for a, c in zip(segs_a, segs_c, strict=True)] == [True, False, True, True, True]
    assert plaintext_checksum(bent, schema=model.schema) != checksum


def test_a_chunk_writes_its_new_rows_once_and_its_checkpoint_stays_flat(model, tokens):
    commits = ChunkCommit(MemoryStateStore(), Keyring.generate())
    s = _Stream(commits, model, "s1")
    for at in range(0, 90, 5):
        s.feed(tokens[at : at + 5])
    truth = model.advance(model.initial_state(), tokens).state
    assert s.done.receipt.checksum == plaintext_checksum(truth.tensors, schema=model.schema)
    assert len(_segment_keys(commits.store)) == 5  # 90 // 16, each written once
    # checkpoints at the same tail length are the same size whatever the position, but for the
    # segments' digests (32 bytes each, msgpack framed): 5 + 80 rows cost 5 digests more than 5
    tails = {}
    for r, size in zip(s.receipts[1:], s.sizes, strict=True):
        tails.setdefault(r.position % ROWS, {})[r.position] = size
    row_bytes = sum(t.nbytes // t.shape[0] for t in model.schema.tensors if t.rows == "position")
    for sizes in tails.values():
        lo, hi = min(sizes), max(sizes)
        assert sizes[hi] - sizes[lo] <= (hi // ROWS - lo // ROWS) * 34 + 64 < row_bytes
    back = commits.fetch(model, s.done.receipt, "alice")[0]
    assert _equal(back, truth)
    for r in s.receipts:  # every checkpoint of the window reads back whole (the store keeps them all here)
        assert _equal(s.fetch(r), model.advance(model.initial_state(), tokens[: r.position]).state)


def test_streams_of_one_principal_share_segments_another_principals_never(model, tokens):
    commits = ChunkCommit(MemoryStateStore(), Keyring.generate())
    a, b, c = _Stream(commits, model, "a"), _Stream(commits, model, "b"), _Stream(commits, model, "c", "bob")
    a.feed(tokens[:50])
    b.feed(tokens[:20])
    b.feed(tokens[20:50])
    c.feed(tokens[:50])
    objs = _objects(commits.store)
    assert sorted(len([k for k in keys if k.startswith("s-")]) for keys in objs.values()) == [3, 3]
    assert sorted(len([k for k in keys if k.startswith("r-")]) for keys in objs.values()) == [1, 3]
    assert a.done.receipt.checksum == b.done.receipt.checksum == c.done.receipt.checksum
    # bob's keys say nothing of alice's rows: no key in common
    alice, bob = (set(keys) for keys in objs.values())
    assert not alice & bob


def test_a_missing_or_swapped_segment_is_refused_typed(model, tokens):
    commits = ChunkCommit(MemoryStateStore(), Keyring.generate())
    s = _Stream(commits, model, "s1")
    s.feed(tokens[:50])
    store, ns = commits.store, commits.segments.namespace("alice")
    keys = sorted(_segment_keys(store))
    fresh = ChunkCommit(store, commits.keyring)  # no digests known, nothing in memory
    first, second = (store.get(key=k, owner=commits.owner("alice")) for k in keys[:2])
    store.delete(key=keys[0], stream_id=ns, owner=commits.owner("alice"))
    store.put_if_absent(key=keys[0], data=second, stream_id=ns, owner=commits.owner("alice"))  # another's bytes
    with pytest.raises(CorruptBlob) as err:
        fresh.fetch(model, s.done.receipt, "alice")
    assert err.value.field == "segment"
    store.delete(key=keys[0], stream_id=ns, owner=commits.owner("alice"))
    with pytest.raises(SegmentMissing) as missing:
        fresh.fetch(model, s.done.receipt, "alice")
    assert missing.value.expected == keys[0]
    store.put_if_absent(key=keys[0], data=first, stream_id=ns, owner=commits.owner("alice"))
    truth = model.advance(model.initial_state(), tokens[:50]).state
    assert _equal(fresh.fetch(model, s.done.receipt, "alice")[0], truth)
    # a bare unseal without the store's segments is refused, not given a state of zeros
    blob = store.get(key=s.done.receipt.state_key, owner=commits.owner("alice"))
    with pytest.raises(SegmentMissing):
        unseal(blob, s.done.receipt, commits.keyring, model=model, principal="alice")


def test_a_segment_that_is_not_its_digests_rows_is_refused(model, tokens):
    """A checkpoint sealed (with the keys) naming a digest its segment's rows do not hash to."""
    commits = ChunkCommit(MemoryStateStore(), Keyring.generate())
    state = model.advance(model.initial_state(), tokens[:40]).state
    segs = commits.segments.split(model, state, "alice", None)
    commits.segments.write(model, segs, "alice")
    other = split_state(model.schema, model.advance(model.initial_state(), tokens[1:41]).state.tensors, 40)[1]
    liar = [segs[0], type(segs[0])(other[1].first, segs[1].digest, other[1].pieces)]
    from mamba_stream.state_codec.codec import seal_segment, segment_key

    key = segment_key(commits.keyring, commits.owner("alice"), model.schema.fingerprint(), 16, segs[1].digest)
    store, ns = commits.store, commits.segments.namespace("alice")
    store.delete(key=key, stream_id=ns, owner=commits.owner("alice"))
    store.put_if_absent(key=key, data=seal_segment(liar[1], key, commits.keyring), stream_id=ns,
                        owner=commits.owner("alice"))
    receipt, blob = seal(model, state, stream_id="s", principal="alice", chunk_seq=1, epoch=0,
                         keyring=commits.keyring, segments=segs)
    with pytest.raises(ChecksumMismatch) as err:
        unseal(blob, receipt, commits.keyring, model=model, principal="alice",
               segments=commits.segments.reader("alice"))
    assert err.value.field == "segment"


def test_two_sweeps_delete_what_no_checkpoint_names_and_keep_what_a_fork_shares(model, tokens, any_store):
    commits = ChunkCommit(any_store, Keyring.generate())
    a, b = _Stream(commits, model, "a"), _Stream(commits, model, "b")
    a.feed(tokens[:40])
    a.feed(tokens[40:70])  # segments 0..3
    b.feed(tokens[:35])  # segments 0, 1: shared
    kv, store = commits.segments, commits.store
    assert len(_segment_keys(store)) == 4
    # a's checkpoints dropped (a rewind's, a window's): b's still name two of a's four segments
    commits.drop([r.state_key for r in a.receipts], stream_id="a", principal="alice", model=model)
    first = kv.sweep(grace_s=0)
    assert (first.segments, first.live, first.sighted, first.deleted) == (4, 2, 2, 0)
    second = kv.sweep(grace_s=0)
    assert (second.deleted, len(_segment_keys(store))) == (2, 2)
    assert _equal(b.fetch(), model.advance(model.initial_state(), tokens[:35]).state)
    # b cancelled (its checkpoints deleted whole, its refs left behind): the rest follows in two sweeps
    store.delete_stream(stream_id="b")
    assert kv.sweep(grace_s=0).orphan_refs == 1
    last = kv.sweep(grace_s=0)
    assert last.deleted == 3 and _objects(store) == {}
    assert store.list_meta(kind=SEEN_KIND) == []  # no sighting outlives its object


def test_a_segment_a_commit_takes_while_the_sweep_looks_is_not_deleted(model, tokens, any_store):
    """The sweep decided on a segment (sighted a grace ago, no refs in its listing); a commit takes
    it between the listing and the delete: the fence on the sighting fails, the segment stays."""
    commits = ChunkCommit(any_store, Keyring.generate())
    a = _Stream(commits, model, "a")
    a.feed(tokens[:40])
    commits.drop([r.state_key for r in a.receipts], stream_id="a", principal="alice", model=model)
    kv = commits.segments
    assert kv.sweep(grace_s=0).sighted == 2
    late: list[_Stream] = []

    def exists(stream_id: str, key: str) -> bool:  # the sweep's look at a checkpoint: a commit runs now
        if not late:
            late.append(_Stream(commits, model, "b"))
            late[0].feed(tokens[:40])
        return key in commits.store.list_stream(stream_id=stream_id)

    # a refs object for the sweep to look at (and so to call `exists` for) before it deletes: c's
    _Stream(commits, model, "c").feed(tokens[50:70])
    report = kv.sweep(grace_s=0, exists=exists)
    assert late and report.deleted == 0
    assert _equal(late[0].fetch(), model.advance(model.initial_state(), tokens[:40]).state)
    assert kv.sweep(grace_s=0).deleted == 0 and len(_segment_keys(commits.store)) == 3


def test_a_commit_killed_before_its_checkpoint_or_its_refs_is_finished_or_swept(model, tokens):
    """A crash after the segments (none of it visible: two sweeps remove them), and one between
    the checkpoint and its refs object (the retry adopts the checkpoint and writes the refs)."""

    class Killed(Exception):
        pass

    store, ring = MemoryStateStore(), Keyring.generate()

    def die_at(edge: str):
        def hook(name: str, stream_id: str, chunk_seq: int) -> None:
            if name == edge and chunk_seq == 1:
                raise Killed(edge)
        return hook

    doomed = ChunkCommit(store, ring, edge=die_at("segments-written"))
    s = _Stream(doomed, model, "a")
    with pytest.raises(Killed):
        s.feed(tokens[:40])
    assert len(_segment_keys(store)) == 2
    store.delete_stream(stream_id="a")  # never retried: the stream was cancelled
    kv = doomed.segments
    kv.sweep(grace_s=0)
    assert kv.sweep(grace_s=0).deleted == 2 and not _segment_keys(store)

    doomed = ChunkCommit(store, ring)
    s = _Stream(doomed, model, "b")
    real_hold = doomed.segments.hold
    doomed.segments.hold = lambda *a, **k: (_ for _ in ()).throw(Killed("hold"))
    with pytest.raises(Killed):
        s.feed(tokens[:40])
    kv.sweep(grace_s=0)  # the checkpoint without refs: its segments are sighted
    rescuer = ChunkCommit(store, ring)
    s.commits = rescuer
    s.feed(tokens[:40])  # the retry: the same key, adopted; its refs written, its segments claimed
    assert s.done.adopted
    doomed.segments.hold = real_hold
    assert kv.sweep(grace_s=0).deleted == 0 and len(_segment_keys(store)) == 2
    assert _equal(ChunkCommit(store, ring).fetch(model, s.done.receipt, "alice")[0],
                  model.advance(model.initial_state(), tokens[:40]).state)


def test_a_reader_of_the_stores_files_learns_no_row_and_no_name_and_cannot_name_a_segment(model, tokens, tmp_path):
    """The store's files of two principals' hybrid streams: no 64-byte run of any KV row, no name;
    a segment's key is keyed (another keyring, another owner: another key for the same rows), so
    a guess of the rows cannot be checked against the keys."""
    store = open_store(f"file://{tmp_path / 'store'}")
    commits = ChunkCommit(store, Keyring.generate())
    for sid, principal in (("s1", "alice-the-principal"), ("s2", "bob-the-principal")):
        _Stream(commits, model, sid, principal).feed(tokens[:50])
    state = model.advance(model.initial_state(), tokens[:50]).state
    raw = b"".join(p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file())
    names = [p.name for p in (tmp_path / "store").rglob("*")]
    for spec in model.schema.tensors:
        if spec.rows == "position":
            rows = state.tensors[spec.name].contiguous().view(torch.uint8).numpy().tobytes()
            assert all(rows[i : i + 64] not in raw for i in range(0, len(rows) - 64, 64))
    # The whole names: a 3-byte word turns up in this much random ciphertext about once in 100 runs.
    for word in (b"alice-the-principal", b"bob-the-principal"):
        assert word not in raw and not any(word.decode()[:3] in n for n in names)
    segs = split_state(model.schema, state.tensors, 50)[1]
    from mamba_stream.state_codec.codec import segment_key

    fp = model.schema.fingerprint()
    ours = segment_key(commits.keyring, commits.owner("alice-the-principal"), fp, 0, segs[0].digest)
    assert ours in _segment_keys(store)
    assert segment_key(Keyring.generate(), commits.owner("alice-the-principal"), fp, 0, segs[0].digest) != ours
    assert segment_key(commits.keyring, commits.owner("bob-the-principal"), fp, 0, segs[0].digest) != ours
    assert segs[0].digest.hex() not in raw.decode("latin-1") and segs[0].digest not in raw


def test_revocation_reaches_the_segments_at_the_next_two_sweeps(model, tokens):
    """A reset that revokes the epochs before it: their checkpoints and refs go at once, the
    segments only they named at the next two sweeps; the new epoch's, equal rows or not, stay."""
    commits = ChunkCommit(MemoryStateStore(), Keyring.generate())
    s = _Stream(commits, model, "a")
    s.feed(tokens[:50])
    assert len(_segment_keys(commits.store)) == 3
    commits.revoke_before("a", "alice", 1, model)
    key = commits.state_key("a", 1, 1, "reset|initial")
    commits.commit(model, model.advance(model.initial_state(), tokens[:20]).state, stream_id="a", principal="alice",
                   chunk_seq=1, epoch=1, key=key, backend="exact", before=None)
    kv = commits.segments
    kv.sweep(grace_s=0)
    assert kv.sweep(grace_s=0).deleted == 2 and len(_segment_keys(commits.store)) == 1  # the new epoch's block 0


def test_an_earlier_attempts_other_bits_are_adopted_with_their_segments_claimed(model, tokens):
    """An earlier attempt (another arithmetic's bits) wrote its segments and checkpoint and died
    before its refs object; a sweep sighted its segments. The retry adopts its state, so its
    segments, not the retry's, are the ones named: claimed and kept by the next sweeps."""

    class Killed(Exception):
        pass

    store, ring = MemoryStateStore(), Keyring.generate()
    first = ChunkCommit(store, ring)
    s = _Stream(first, model, "a")
    before = s.done.receipt
    true = model.advance(s.done.state, tokens[:40]).state
    other = {k: v.clone() for k, v in true.tensors.items()}
    kv_name = next(t.name for t in model.schema.tensors if t.rows == "position")
    other[kv_name][3, 0, 0] += 1.0  # the earlier attempt's bits differ in block 0
    key = first.chunk_key("a", before, 1, "c1")
    first.segments.hold = lambda *a, **k: (_ for _ in ()).throw(Killed("hold"))
    with pytest.raises(Killed):
        first.commit(model, model.restore_state(40, other), stream_id="a", principal="alice", chunk_seq=1, epoch=0,
                     key=key, backend="exact", before=before)
    kv = ChunkCommit(store, ring).segments
    assert kv.sweep(grace_s=0).sighted == 2  # no refs object names them yet
    retry = ChunkCommit(store, ring)
    done = retry.commit(model, true, stream_id="a", principal="alice", chunk_seq=1, epoch=0, key=key,
                        backend="exact", before=before)
    assert done.adopted and torch.equal(done.state.tensors[kv_name], other[kv_name])
    assert kv.sweep(grace_s=0).deleted == 0
    back = ChunkCommit(store, ring).fetch(model, done.receipt, "alice")[0]
    assert torch.equal(back.tensors[kv_name], other[kv_name])
