"""Fair tenants inside a worker (issue 50): the engine shares its rounds between principals, the
quotas refuse typed before anything runs, and scheduling never changes a bit."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from mamba_stream.activities import Bursts, Fairness, Quotas, TenancyConfigError
from mamba_stream.activities._engine import StreamEngine, _Shares, _Work, owner_of
from mamba_stream.activities._fairness import InFlight
from mamba_stream.workflows import QuotaExceeded
from tests.scan._helpers import model_for, tokens

MODEL = "tiny-mamba2"
ALICE, BOB = "a" * 32, "b" * 32


def sid(tag: str) -> str:
    return f"ms.{tag}.{uuid.uuid4().hex}"


def _work(owner: str, n: int = 1) -> _Work:
    return _Work(sid(owner), [0] * n, "k", 0, None, owner=owner)


def test_shares_alternate_owners_by_weight_and_forget_the_idle():
    shares = _Shares({ALICE: 2.0})
    works = [_work(ALICE) for _ in range(6)] + [_work(BOB) for _ in range(3)]
    shares.settle(works)
    order = shares.order(works, lambda w: 1, 8)
    # alice (weight 2) is served two for each of bob's; each owner's in its own arrival order
    assert [w.owner for w in order] == [ALICE, BOB, ALICE, ALICE, BOB, ALICE, ALICE, BOB]
    assert [w for w in order if w.owner == ALICE] == works[:5]
    assert shares.order(works, lambda w: 1, 9) == works  # room for all: nothing to choose
    for w in order[:3]:
        shares.charge(w.owner, 1)
    # bob goes idle: forgotten; he comes back at the least virtual time of those waiting, not at 0
    shares.settle(works[:6])
    assert BOB not in shares.vt
    shares.charge(ALICE, 10)
    shares.settle([works[0], _work(BOB)])
    assert shares.vt[BOB] == shares.vt[ALICE]
    # one owner alone: arrival order, whatever the limit
    assert shares.order(works[:6], lambda w: 1, 4) == works[:4]


def _held_engine(engine: StreamEngine) -> threading.Event:
    """Hold the engine's thread in a control call until the returned event is set: works sent
    meanwhile wait in its inbox, in the order they were sent."""
    release, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(30)

    threading.Thread(target=lambda: engine._call(hold), daemon=True).start()
    assert holding.wait(10)
    return release


def _send(engine: StreamEngine, model, streams: list[str], n: int, done: list[str],
          outs: dict) -> list[threading.Thread]:
    """One thread per stream advancing it by `n` tokens, each sent once the previous is in the inbox."""
    threads = []
    for s in streams:
        def run(s: str = s) -> None:
            outs[s] = engine.advance(s, tokens(n, 1), expected_key="k0", epoch=0,
                                     load=lambda: (model.initial_state(), None))
            done.append(s)

        before = engine._inbox.qsize()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while engine._inbox.qsize() == before and time.monotonic() < deadline:  # sent, in this order
            time.sleep(0.001)
        threads.append(t)
    return threads


@pytest.mark.parametrize("fair", [True, False])
def test_a_quiet_principals_chunk_is_served_next_not_after_the_floods_backlog(fair):
    """Six of alice's 40-token chunks wait in the engine, then bob's: fair, bob's is the second
    served (one piece after the one running); first come first served, it is the last. Either way
    every stream's logits and state are those of its chunk advanced alone."""
    model = model_for(MODEL)
    engine = StreamEngine(model, capacity=16, max_wait_s=0.0, fair=fair)
    try:
        floods = [sid(ALICE) for _ in range(6)]
        quiet = sid(BOB)
        release = _held_engine(engine)
        done: list[str] = []
        outs: dict = {}
        threads = _send(engine, model, [*floods, quiet], 40, done, outs)
        release.set()
        for t in threads:
            t.join(30)
        assert len(done) == 7
        assert done.index(quiet) == (1 if fair else 6), done
        alone = model.advance(model.initial_state(), tokens(40, 1))
        for s in [*floods, quiet]:
            assert outs[s].logits.equal(alone.logits) and outs[s].state.equal(alone.state), s
    finally:
        engine.close()


def test_weights_give_a_principal_its_share_of_the_rounds():
    """Weight 3 for alice: of the first eight chunks served, six are hers and two bob's."""
    from mamba_stream.state_codec.keyring import Keyring

    ring = Keyring.generate()
    # the operator names principals; the engine (and the server) are given their tags
    assert Fairness(weights={"alice": 3.0}).tag_weights(ring) == {ring.principal_tag("alice"): 3.0}
    model = model_for(MODEL)
    engine = StreamEngine(model, capacity=32, max_wait_s=0.0, weights={ALICE: 3.0})
    try:
        release = _held_engine(engine)
        done: list[str] = []
        outs: dict = {}
        streams = [sid(ALICE) for _ in range(8)] + [sid(BOB) for _ in range(8)]
        threads = _send(engine, model, streams, 20, done, outs)
        release.set()
        for t in threads:
            t.join(30)
        first = [owner_of(s) for s in done[:8]]
        assert first.count(ALICE) == 6 and first.count(BOB) == 2, first
    finally:
        engine.close()


def test_a_long_prefill_is_cut_to_pieces_that_hold_the_engine_a_bounded_time():
    """A piece that took longer than `piece_s` makes the next ones shorter (never below
    MIN_PIECE), and they grow back as pieces speed up; the chunk's bits do not change."""
    model = model_for(MODEL)
    engine = StreamEngine(model, capacity=4, max_wait_s=0.0, piece_s=1e-6, prefill_piece=256)
    try:
        s = sid(ALICE)
        out = engine.advance(s, tokens(300, 3), expected_key="k0", epoch=0, load=lambda: (model.initial_state(), None))
        alone = model.advance(model.initial_state(), tokens(300, 3))
        assert out.logits.equal(alone.logits) and out.state.equal(alone.state)
        assert engine._piece == 16 and engine.stats.pieces > 2
        engine.piece_s = 1e6
        engine._next_piece(16, 0.001)
        assert engine._piece == 256
    finally:
        engine.close()


def test_the_state_quota_evicts_the_principals_own_idle_streams_then_refuses():
    """Room for one of alice's states: her second stream's chunk evicts her first (idle, its
    checkpoint in the store), never bob's; a chunk that would need a second slot while her first
    one runs is refused QuotaExceeded, naming the quota, its limit and the use; bob is not bound
    by alice's use."""
    model = model_for(MODEL)
    probe = StreamEngine(model, capacity=1)
    per_slot = probe._per_slot
    probe.close()
    engine = StreamEngine(model, capacity=8, max_wait_s=0.0, state_quota=per_slot)
    try:
        a1, a2, b1 = sid(ALICE), sid(ALICE), sid(BOB)
        load = lambda: (model.initial_state(), None)  # noqa: E731
        engine.advance(a1, tokens(5, 1), expected_key="k0", epoch=0, load=load)
        engine.mark_committed(a1, "k1")
        engine.advance(b1, tokens(5, 1), expected_key="k0", epoch=0, load=load)
        engine.mark_committed(b1, "k1")
        engine.advance(a2, tokens(5, 1), expected_key="k0", epoch=0, load=load)
        engine.mark_committed(a2, "k1")
        assert not engine.holds(a1, "k1") and engine.holds(a2, "k1") and engine.holds(b1, "k1")
        # a committed state kept hot past the quota is dropped instead (it is in the store)
        engine.put(a1, model.initial_state(), epoch=0, state_key="k0")
        assert engine.holds(a1, "k0") and not engine.holds(a2, "k1")
        # both of alice's chunks admitted in one round: the second finds her only slot running
        release = _held_engine(engine)
        done: list[str] = []
        outs: dict = {}
        errors: dict = {}

        def run(s: str) -> None:
            try:
                outs[s] = engine.advance(s, tokens(30, 2), expected_key="k0", epoch=0, load=load)
            except QuotaExceeded as exc:
                errors[s] = exc
            done.append(s)

        threads = []
        for s in (a1, a2):
            before = engine._inbox.qsize()
            t = threading.Thread(target=run, args=(s,), daemon=True)
            t.start()
            while engine._inbox.qsize() == before:
                time.sleep(0.001)
            threads.append(t)
        release.set()
        for t in threads:
            t.join(30)
        assert set(outs) == {a1} and set(errors) == {a2}
        exc = errors[a2]
        assert exc.details() == {"quota": "state_bytes", "limit": per_slot, "used": per_slot}
        assert not QuotaExceeded.retryable
        assert engine.holds(b1, "k1")  # bob's stream was never a candidate
    finally:
        engine.close()


def test_chunks_in_flight_are_bounded_per_principal():
    gate = InFlight(2)
    with gate.chunk(ALICE), gate.chunk(ALICE):
        with pytest.raises(QuotaExceeded) as err, gate.chunk(ALICE):
            pass
        assert err.value.details() == {"quota": "chunks_in_flight", "limit": 2, "used": 2}
        with gate.chunk(BOB):  # another principal's places are its own
            assert gate.used(BOB) == 1
    assert gate.used(ALICE) == 0 and gate.used(BOB) == 0  # released on the way out, errors included


def test_a_burst_is_the_streams_past_the_limit_within_the_window_per_principal():
    now = [100.0]
    bursts = Bursts(2, window=10.0, clock=lambda: now[0])
    assert [bursts.opened(ALICE) for _ in range(4)] == [False, False, True, True]
    assert bursts.opened(BOB) is False  # another principal's count is its own
    now[0] += 5.0
    assert bursts.opened(ALICE) is True  # the four before are still within the window
    now[0] += 5.5
    assert bursts.opened(ALICE) is False  # the first four left it: two in it now (at 105 and 110.5)
    assert bursts.opened(ALICE) is True
    now[0] += 60.0
    assert bursts.opened(ALICE) is False and BOB not in bursts._opened  # idle principals forgotten
    never = Bursts(0, clock=lambda: now[0])
    assert not any(never.opened(ALICE) for _ in range(100))


@pytest.mark.parametrize(("var", "value"), [("MAMBA_STREAM_QUOTA_STREAMS", "ten"),
                                            ("MAMBA_STREAM_QUOTA_CHUNKS", "-1"),
                                            ("MAMBA_STREAM_QUOTA_STATE_BYTES", "1.5")])
def test_a_quota_that_does_not_parse_is_refused_in_one_line_naming_it(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(TenancyConfigError) as err:
        Quotas.from_env()
    assert str(err.value).startswith(f"{var}: ") and "\n" not in str(err.value)


def test_quotas_and_fairness_from_the_environment(monkeypatch):
    monkeypatch.setenv("MAMBA_STREAM_QUOTA_STREAMS", "3")
    monkeypatch.setenv("MAMBA_STREAM_QUOTA_STATE_BYTES", "1_000_000")
    assert Quotas.from_env() == Quotas(streams=3, chunks_in_flight=256, state_bytes=1_000_000)
    f = Fairness.from_spec("off", " alice=2, bob=0.5 ")
    assert not f.enabled and dict(f.weights) == {"alice": 2.0, "bob": 0.5}
    for bad in ("alice", "alice=0", "=2", "alice=nan", "alice=-1"):
        with pytest.raises(TenancyConfigError, match=r"^MAMBA_STREAM_FAIRNESS_WEIGHTS: "):
            Fairness.from_spec("on", bad)
    with pytest.raises(TenancyConfigError, match=r"^MAMBA_STREAM_FAIRNESS: "):
        Fairness.from_spec("sometimes")
    assert Fairness.from_spec("on", "", " 4 ").burst == 4 and Fairness.from_spec().burst == Fairness().burst == 16
    for bad in ("many", "-1", "2.5"):
        with pytest.raises(TenancyConfigError, match=r"^MAMBA_STREAM_FAIRNESS_BURST: "):
            Fairness.from_spec("on", "", bad)


def test_the_worker_refuses_to_start_on_a_bad_tenancy_setting(monkeypatch):
    """WorkerConfig checks them (worker.py exits EXIT_CONFIG with the one line)."""
    from mamba_stream.serving import WorkerConfig

    monkeypatch.setenv("MAMBA_STREAM_FAIRNESS_WEIGHTS", "alice=lots")
    with pytest.raises(ValueError, match=r"^MAMBA_STREAM_FAIRNESS_WEIGHTS: "):
        WorkerConfig()


def test_a_server_that_refuses_to_move_a_stream_leaves_it_where_it_is(caplog):
    """`demote` on a server that refuses (a cluster whose authorizer denies the worker
    UpdateWorkflowExecutionOptions): False, logged, nothing raised: the stream serves on at the
    default level. What it asks for when the server takes it: the bulk level, the key kept."""
    import asyncio

    from temporalio.service import RPCError, RPCStatusCode

    from mamba_stream.activities import demote
    from mamba_stream.workflows import BULK_PRIORITY_LEVEL

    sent = []

    class Service:
        def __init__(self, refuse: bool) -> None:
            self.refuse = refuse

        async def update_workflow_execution_options(self, req):
            sent.append(req)
            if self.refuse:
                raise RPCError("permission denied", RPCStatusCode.PERMISSION_DENIED, b"")

    class Client:
        namespace, identity = "default", "w"

        def __init__(self, refuse: bool) -> None:
            self.workflow_service = Service(refuse)

    assert asyncio.run(demote(Client(True), "ms.t.1", "t")) is False
    assert "not moved to the bulk priority level" in caplog.text
    assert asyncio.run(demote(Client(False), "ms.t.2", "t")) is True
    req = sent[-1]
    assert req.workflow_execution.workflow_id == "ms.t.2" and list(req.update_mask.paths) == ["priority"]
    p = req.workflow_execution_options.priority
    assert (p.priority_key, p.fairness_key, p.fairness_weight) == (BULK_PRIORITY_LEVEL, "t", 0.0)
