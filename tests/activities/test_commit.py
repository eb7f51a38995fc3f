"""The commit protocol without a server: an in-memory store, then the activities through
`ActivityEnvironment` (a real activity context: attempts, heartbeats, cancellation)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from temporalio.exceptions import ApplicationError

from mamba_stream.activities import MemoryStateStore, ModelRegistry, StreamActivities
from mamba_stream.activities._commit import ChunkCommit
from mamba_stream.scan import State, load_model
from mamba_stream.state_codec import CheckpointNotFound, format_state_key, parse_state_key, record_key
from mamba_stream.state_codec.codec import Keyring, default_state_key, plaintext_checksum
from mamba_stream.workflows import AdvanceRequest, GenerateRequest
from mamba_stream.workflows._models import AdvanceResult
from mamba_stream.workflows.contract import (
    AdvanceChunkRequest,
    GenerateChunkRequest,
    OpenStreamRequest,
    RecallResultRequest,
)
from tests.activities._env import stream_env

MODEL = "tiny-mamba2"


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL, backend="reference")


@pytest.fixture
def commits():
    return ChunkCommit(MemoryStateStore(), Keyring.generate())


def _first(commits: ChunkCommit, model, sid: str = "s1"):
    """The stream's opening commit: its receipt."""
    key = default_state_key(sid, 0, 0, "0" * 64)
    return commits.commit(model, model.initial_state(), stream_id=sid, principal="alice", chunk_seq=0, epoch=0,
                          key=key, backend="reference:open", before=None).receipt


def _result(n: int):
    def make(receipt):
        return AdvanceResult(stream_id=receipt.stream_id, chunk_seq=receipt.chunk_seq, position=receipt.position,
                             n_tokens=n, receipt=receipt, top_k=[], output_digest="sha256:x", backend="reference")
    return make


def test_a_chunk_commits_its_state_and_record_and_a_retry_finds_the_record(commits, model):
    r0 = _first(commits, model)
    out = model.advance(model.initial_state(), [3, 4, 5])
    key = commits.chunk_key("s1", r0, 1, "d1")
    assert commits.prior(key, "alice") is None
    res = commits.complete(model, out.state, stream_id="s1", principal="alice", before=r0, chunk_seq=1, key=key,
                           path="reference", last=out.logits[-1], make_result=_result(3), drop_keys=[]).result
    assert res.receipt.checksum == plaintext_checksum(out.state.tensors) and res.position == 3
    prior = commits.prior(key, "alice")
    assert AdvanceResult.model_validate(prior.result) == res
    assert torch.equal(prior.logits, out.logits[-1].to(torch.float32))
    assert commits.prior(key, "mallory") is None  # a record is its principal's alone
    state, _logits, size = commits.fetch(model, res.receipt, "alice")
    assert all(torch.equal(state.tensors[k], out.state.tensors[k]) for k in out.state.tensors) and size > 0


def test_keys_name_input_state_and_content(commits, model):
    r0 = _first(commits, model)
    k = commits.chunk_key
    assert k("s1", r0, 1, "d1") == k("s1", r0, 1, "d1")
    assert len({k("s1", r0, 1, "d1"), k("s1", r0, 1, "d2"), k("s1", r0, 2, "d1"), k("s2", r0, 1, "d1")}) == 4
    assert record_key("k") == "k.out"
    # keyed: another deployment's keyring derives other keys, and the key says nothing of the content
    other = ChunkCommit(MemoryStateStore(), Keyring.generate())
    assert other.chunk_key("s1", r0, 1, "d1") != k("s1", r0, 1, "d1")
    assert k("s1", r0, 1, "d1").startswith("s1.e0.c1.") and parse_state_key(k("s1", r0, 1, "d1")).chunk_seq == 1


@pytest.mark.parametrize("what", ["open|initial", "open|sha256:" + "ab" * 32, "reset|initial", "chunk"])
def test_every_key_the_workers_derive_is_one_the_parser_reads(commits, model, what: str):
    r0 = _first(commits, model)
    key = commits.chunk_key("s1", r0, 4, "d") if what == "chunk" else commits.state_key("s1", 2, 4, what)
    epoch = r0.epoch if what == "chunk" else 2
    assert parse_state_key(key) == parse_state_key(format_state_key("s1", epoch, 4, key.rsplit(".", 1)[1]))
    assert (parse_state_key(key).epoch, parse_state_key(key).chunk_seq) == (epoch, 4)


def test_a_revoke_deletes_the_earlier_epochs_checkpoints_and_records_and_only_those(commits, model):
    store = commits.store
    r0 = _first(commits, model)  # the open checkpoint, epoch 0
    commits.write_record(r0, {"kind": "open"}, None)
    out = model.advance(model.initial_state(), [3, 4])
    c1 = commits.complete(model, out.state, stream_id="s1", principal="alice", before=r0, chunk_seq=1,
                          key=commits.chunk_key("s1", r0, 1, "d1"), path="reference", last=None,
                          make_result=_result(2), drop_keys=[]).result.receipt
    reset1 = commits.commit(model, model.initial_state(), stream_id="s1", principal="alice", chunk_seq=1, epoch=1,
                            key=commits.state_key("s1", 1, 1, "reset|initial"), backend="reference:reset",
                            before=None).receipt
    legacy = "s1.e0.c0."  # an open key as an earlier version wrote it, and its record
    store.put_if_absent(key=legacy, data=b"x", stream_id="s1", owner=commits.owner("alice"))
    store.put_if_absent(key=record_key(legacy), data=b"x", stream_id="s1", owner=commits.owner("alice"))
    orphan = record_key(commits.chunk_key("s1", r0, 9, "gone"))  # its checkpoint deleted, the record not yet
    store.put_if_absent(key=orphan, data=b"x", stream_id="s1", owner=commits.owner("alice"))
    other = _first(commits, model, sid="s2")  # another stream's epoch 0: untouched
    assert commits.revoke_before("s1", "alice", 1) == 3  # open, chunk 1 and the legacy open
    assert store.list_stream(stream_id="s1") == [reset1.state_key]
    assert store.list_stream(stream_id="s2") == [other.state_key]
    with pytest.raises(CheckpointNotFound):
        commits.fetch(model, c1, "alice")
    commits.fetch(model, reset1, "alice")  # the new epoch's checkpoint still opens
    assert commits.revoke_before("s1", "alice", 1) == 0


def test_a_second_attempt_adopts_the_first_attempts_bytes(commits, model):
    r0 = _first(commits, model)
    key = commits.chunk_key("s1", r0, 1, "d1")
    first = model.advance(model.initial_state(), [3, 4, 5]).state
    a = commits.commit(model, first, stream_id="s1", principal="alice", chunk_seq=1, epoch=0, key=key,
                       backend="reference:reference", before=r0)
    # the second attempt computed other bits (as another arithmetic would): the stored ones win
    other = first.__class__(first.position, {k: v + 1 for k, v in first.tensors.items()}, first.origin)
    b = commits.commit(model, other, stream_id="s1", principal="alice", chunk_seq=1, epoch=0, key=key,
                       backend="reference:reference", before=r0)
    assert not a.adopted and b.adopted
    assert b.receipt.checksum == a.receipt.checksum == plaintext_checksum(first.tensors)
    assert all(torch.equal(b.state.tensors[k], first.tensors[k]) for k in first.tensors)
    assert b.receipt.arithmetic_changes == 1 and b.receipt.arithmetic_since == 3


@pytest.mark.parametrize("edge", ["computed", "written", "recorded"])
def test_a_crash_at_any_edge_leaves_what_the_next_attempt_finishes(model, edge):
    store, ring = MemoryStateStore(), Keyring.generate()

    class Crash(Exception):
        pass

    def crash(name: str, sid: str, seq: int) -> None:
        if name == edge:
            raise Crash(name)

    r0 = _first(ChunkCommit(store, ring), model)
    commits = ChunkCommit(store, ring)
    old = commits.chunk_key("s1", r0, 0, "old")
    store.put_if_absent(key=old, data=b"old checkpoint", stream_id="s1", owner=commits.owner("alice"))
    out = model.advance(model.initial_state(), [9, 8])
    key = commits.chunk_key("s1", r0, 1, "d")
    kw = dict(stream_id="s1", principal="alice", before=r0, chunk_seq=1, key=key, path="reference",
              last=out.logits[-1], make_result=_result(2), drop_keys=[old])
    with pytest.raises(Crash):
        ChunkCommit(store, ring, edge=crash).complete(model, out.state, **kw)
    # what the crash left: nothing before `written`, the checkpoint from then on, the record at `recorded`
    assert (store.get(key=key, owner=commits.owner("alice")) is not None) == (edge != "computed")
    assert (store.get(key=record_key(key), owner=commits.owner("alice")) is not None) == (edge == "recorded")
    assert store.get(key=old, owner=commits.owner("alice")) is not None  # drops come last
    retry = ChunkCommit(store, ring)
    prior = retry.prior(key, "alice")
    if prior is None:
        res = retry.complete(model, out.state, **kw).result
    else:
        res = AdvanceResult.model_validate(prior.result)
        retry.drop([old], stream_id="s1", principal="alice")
    assert res.receipt.checksum == plaintext_checksum(out.state.tensors)
    assert store.get(key=old, owner=commits.owner("alice")) is None
    assert store.list_stream(stream_id="s1") == sorted([r0.state_key, key, record_key(key)])


def test_fetch_of_a_missing_checkpoint_is_typed(commits, model):
    r0 = _first(commits, model)
    commits.drop([r0.state_key], stream_id="s1", principal="alice")
    with pytest.raises(CheckpointNotFound):
        commits.fetch(model, r0, "alice")


# --- the activities, through ActivityEnvironment -------------------------------------------------


class Flaky(StreamActivities):
    """Fails every generate with an exception nobody foresaw (as a bug in a sampler would)."""

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name == "admitted" and chunk_seq == 2:
            raise RuntimeError("a bug")


def _activities(cls=StreamActivities):
    return cls(models=ModelRegistry([MODEL], backend="reference"), store=MemoryStateStore(), keyring=Keyring.generate())


def test_the_activities_run_on_a_memory_store_and_untyped_failures_are_bounded():
    acts = _activities(Flaky)
    try:
        env = stream_env()
        opened = env.run(acts.open_stream, OpenStreamRequest(stream_id="s1", principal="alice", model_id=MODEL))
        req = AdvanceRequest(principal="alice", chunk_seq=1, tokens=[1, 2, 3])
        done = env.run(acts.advance_chunk, AdvanceChunkRequest(stream_id="s1", principal="alice",
                                                               receipt=opened.receipt, request=req))
        model = load_model(MODEL, backend="reference")
        assert done.result.receipt.checksum == plaintext_checksum(
            model.advance(model.initial_state(), [1, 2, 3]).state.tensors)
        gen = GenerateChunkRequest(stream_id="s1", principal="alice", receipt=done.result.receipt,
                                   request=GenerateRequest(principal="alice", chunk_seq=2, max_tokens=2, seed=1))
        for attempt in (1, 2):  # retried: re-raised as it is
            env.info = env.info.__class__(**{**env.info.__dict__, "attempt": attempt})
            with pytest.raises(RuntimeError):
                env.run(acts.generate_tokens, gen)
        env.info = env.info.__class__(**{**env.info.__dict__, "attempt": 3})
        with pytest.raises(ApplicationError) as err:
            env.run(acts.generate_tokens, gen)
        assert err.value.type == "InternalError" and err.value.non_retryable and "a bug" in err.value.message
        assert acts.store.list_stream(stream_id="s1") == sorted(
            [opened.receipt.state_key, record_key(opened.receipt.state_key), done.result.receipt.state_key,
             record_key(done.result.receipt.state_key)])
    finally:
        acts.close()


def test_a_missing_checkpoint_is_a_typed_permanent_failure_through_the_activity():
    acts = _activities()
    try:
        env = stream_env()
        opened = env.run(acts.open_stream, OpenStreamRequest(stream_id="s1", principal="alice", model_id=MODEL))
        acts.store.delete(key=opened.receipt.state_key, stream_id="s1", owner=acts.commits.owner("alice"))
        acts.release_stream("s1")  # not hot either: the state must come from the store
        req = AdvanceRequest(principal="alice", chunk_seq=1, tokens=[1])
        with pytest.raises(ApplicationError) as err:
            env.run(acts.advance_chunk, AdvanceChunkRequest(stream_id="s1", principal="alice",
                                                            receipt=opened.receipt, request=req))
        assert err.value.type == "CheckpointNotFound" and err.value.non_retryable
    finally:
        acts.close()


# --- adoption and chunk keys through the activities (Issue 19, mutants 2 and 3) -----------------


def _digest(logits: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(logits.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _hot(acts: StreamActivities, sid: str) -> State:
    """The state the stream's slot holds, read on the engine's own thread."""
    eng = acts.engine(acts.models.get(MODEL))
    return eng._call(lambda: eng.slots.state(eng.slots.handle(sid)))


def _same(a: State, b: State) -> bool:
    return a.position == b.position and list(a.tensors) == list(b.tensors) and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


class _DiesAfterWriting(StreamActivities):
    """A worker that stores the chunk's checkpoint and dies before recording the result (the
    `written` edge): the retry finds the key taken and no record."""

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name == "written":
            raise KeyboardInterrupt("worker died after writing the checkpoint")


def test_a_retry_that_computes_other_bits_adopts_the_stored_state_and_the_stream_reloads():
    """Attempt 1 ran on a worker whose arithmetic differs (the chunked backend: other bits for the
    same tokens) and died after storing its checkpoint. Attempt 2, on the reference backend,
    computes state B under the same key, finds state A there and must adopt it: the receipt it
    returns, the state its slot holds and what a reload reads must all be A."""
    store, ring = MemoryStateStore(), Keyring.generate()
    other_cpu = _DiesAfterWriting(models=ModelRegistry([MODEL], backend="chunked"), store=store, keyring=ring)
    retry = StreamActivities(models=ModelRegistry([MODEL], backend="reference"), store=store, keyring=ring)
    chunked, reference = load_model(MODEL, backend="chunked"), load_model(MODEL, backend="reference")
    try:
        env = stream_env()
        opened = env.run(retry.open_stream, OpenStreamRequest(stream_id="s1", principal="alice", model_id=MODEL))
        req = AdvanceChunkRequest(stream_id="s1", principal="alice", receipt=opened.receipt,
                                  request=AdvanceRequest(principal="alice", chunk_seq=1, tokens=[3, 4, 5]))
        with pytest.raises(KeyboardInterrupt):
            env.run(other_cpu.advance_chunk, req)
        a = chunked.advance(chunked.initial_state(), [3, 4, 5])
        b = reference.advance(reference.initial_state(), [3, 4, 5])
        # the premise: the two attempts' states differ, else adopting would be invisible
        assert plaintext_checksum(a.state.tensors) != plaintext_checksum(b.state.tensors)
        [written] = [k for k in store.list_stream(stream_id="s1")
                     if k not in (opened.receipt.state_key, record_key(opened.receipt.state_key))]

        done = env.run(retry.advance_chunk, req).result
        assert done.receipt.state_key == written and done.receipt.checksum == plaintext_checksum(a.state.tensors)
        assert done.n_tokens == 3 and done.position == 3
        held, _, _ = retry.commits.fetch(reference, done.receipt, "alice")  # the store holds A
        assert _same(held, a.state)
        assert _same(_hot(retry, "s1"), a.state)  # and so does the slot

        # the next chunk continues from A, from the hot slot
        nxt = env.run(retry.advance_chunk, req.model_copy(update={
            "receipt": done.receipt, "request": AdvanceRequest(principal="alice", chunk_seq=2, tokens=[6, 7])})).result
        want = reference.advance(a.state, [6, 7])
        assert nxt.receipt.checksum == plaintext_checksum(want.state.tensors)
        assert nxt.output_digest == _digest(want.logits)
        # and after the slot is gone, the stream reloads A's successor from the store
        retry.release_stream("s1")
        last = env.run(retry.advance_chunk, req.model_copy(update={
            "receipt": nxt.receipt, "request": AdvanceRequest(principal="alice", chunk_seq=3, tokens=[8])})).result
        want = reference.advance(want.state, [8])
        assert last.receipt.checksum == plaintext_checksum(want.state.tensors)
        assert last.output_digest == _digest(want.logits) and last.position == 6
        assert retry.metrics.migration_count == 1
    finally:
        other_cpu.close()
        retry.close()


def test_a_different_chunk_at_the_same_sequence_from_the_same_state_gets_its_own_result():
    """A chunk at seq N committed and its result was lost to the workflow (a rewind, a client
    that sends another chunk in its place): another chunk at seq N from the same input state
    derives another key, so it is advanced, not answered with the first chunk's record."""
    acts = _activities()
    model = load_model(MODEL, backend="reference")
    try:
        env = stream_env()
        opened = env.run(acts.open_stream, OpenStreamRequest(stream_id="s1", principal="alice", model_id=MODEL))

        def advance(tokens: list[int]) -> AdvanceResult:
            return env.run(acts.advance_chunk, AdvanceChunkRequest(
                stream_id="s1", principal="alice", receipt=opened.receipt,
                request=AdvanceRequest(principal="alice", chunk_seq=1, tokens=tokens))).result

        first = advance([3, 4, 5])
        second = advance([9, 10])
        want = model.advance(model.initial_state(), [9, 10])
        assert (second.n_tokens, second.position, second.chunk_seq) == (2, 2, 1) and not second.duplicate
        assert second.receipt.checksum == plaintext_checksum(want.state.tensors)
        assert second.output_digest == _digest(want.logits)
        assert second.receipt.state_key != first.receipt.state_key
        # the first chunk sent again is still answered from its record, unchanged
        again = advance([3, 4, 5])
        assert again == first
    finally:
        acts.close()


def test_recall_and_drops_touch_only_the_streams_own_keys():
    """Issue 26: a forged carry made `recall_result` return bob's text for alice's stream, and its
    `kept` made alice's next chunk's drops delete bob's checkpoint."""
    acts = _activities()
    try:
        bob = stream_env("s-bob").run(acts.open_stream, OpenStreamRequest(stream_id="s-bob", principal="bob",
                                                                          model_id=MODEL))
        fed = stream_env("s-bob").run(acts.advance_chunk, AdvanceChunkRequest(
            stream_id="s-bob", principal="bob", receipt=bob.receipt,
            request=AdvanceRequest(principal="bob", chunk_seq=1, tokens=[7, 7, 7])))
        alice = stream_env("s-alice").run(acts.open_stream, OpenStreamRequest(stream_id="s-alice", principal="alice",
                                                                              model_id=MODEL))
        before = acts.store.list_stream(stream_id="s-bob")
        # alice's stream asks for bob's chunk's record: refused, whoever it names as principal
        for principal in ("alice", "bob"):
            with pytest.raises(ApplicationError) as err:
                stream_env("s-alice").run(acts.recall_result, RecallResultRequest(
                    stream_id="s-alice", principal=principal, state_key=fed.result.receipt.state_key, kind="advance"))
            assert err.value.type == "StreamMismatch" and err.value.non_retryable
        # alice's chunk drops bob's checkpoints: they stay
        stream_env("s-alice").run(acts.advance_chunk, AdvanceChunkRequest(
            stream_id="s-alice", principal="alice", receipt=alice.receipt,
            request=AdvanceRequest(principal="alice", chunk_seq=1, tokens=[1]),
            drop_keys=[bob.receipt.state_key, fed.result.receipt.state_key]))
        assert acts.store.list_stream(stream_id="s-bob") == before
        # and a key that names alice's stream but is bob's object in the store: left alone too
        planted = f"s-alice.e0.c9.{'0' * 32}"
        assert acts.store.put_if_absent(key=planted, data=b"bob's", stream_id="s-bob", owner=acts.commits.owner("bob"))
        acts.commits.drop([planted], stream_id="s-alice", principal="alice")
        assert acts.store.get(key=planted, owner=acts.commits.owner("bob")) == b"bob's"
        acts.store.delete(key=planted, stream_id="s-bob", owner=acts.commits.owner("bob"))
        assert acts.store.list_stream(stream_id="s-bob") == before
        # an activity of one stream scheduled by another stream's workflow: refused before anything
        with pytest.raises(ApplicationError) as err:
            stream_env("s-alice").run(acts.advance_chunk, AdvanceChunkRequest(
                stream_id="s-bob", principal="bob", receipt=fed.result.receipt,
                request=AdvanceRequest(principal="bob", chunk_seq=2, tokens=[1])))
        assert err.value.type == "StreamMismatch"
        assert acts.store.list_stream(stream_id="s-bob") == before
    finally:
        acts.close()


def test_metrics_swapped_in_reach_the_commits_and_the_prefix_store():
    """A worker that serves given activities counts into its own endpoint (`use_metrics`): a
    checkpoint committed after the swap is counted there, not on the meter made at construction."""
    from mamba_stream.activities import StreamMetrics

    acts = StreamActivities(models=ModelRegistry([MODEL], backend="reference"), store=MemoryStateStore(),
                            keyring=Keyring.generate())
    mine = StreamMetrics()
    acts.use_metrics(mine)
    assert acts.metrics is mine and acts.commits.metrics is mine and acts.prefixes.metrics is mine
    opened = stream_env().run(acts.open_stream, OpenStreamRequest(stream_id="s1", principal="alice", model_id=MODEL))
    assert mine.committed_at(opened.receipt.state_key) is not None  # the open's checkpoint, counted here
    acts.close()
