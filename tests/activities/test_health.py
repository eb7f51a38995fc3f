"""A worker is never poisoned, without a server: cancellation only at safe points, a model's load
that no cancellation interrupts, and the health check that stops a worker failing every chunk."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.testing import ActivityEnvironment

import mamba_stream.activities._registry as registry_module
from mamba_stream.activities import MemoryStateStore, ModelRegistry, StreamActivities, StreamMetrics, WorkerHealth
from mamba_stream.activities._guards import UNTYPED_ATTEMPTS, WORKER_FAULT_ATTEMPTS
from mamba_stream.activities._health import FAILURES_TO_TRIP
from mamba_stream.scan import load_model
from mamba_stream.state_codec import record_key
from mamba_stream.state_codec.codec import Keyring, plaintext_checksum
from mamba_stream.workflows import AdvanceRequest
from mamba_stream.workflows.contract import AdvanceChunkRequest, OpenStreamRequest
from tests.activities._env import stream_env
from tests.workflows.test_metrics import free_port, scrape, total

MODEL = "tiny-mamba2"
BUG = AttributeError("module 'sympy' has no attribute 'core'")


# --- WorkerHealth ------------------------------------------------------------------------------


def test_one_streams_failures_never_trip_the_worker():
    health = WorkerHealth()
    assert not any(health.failed("s1", BUG) for _ in range(100))
    assert health.tripped is None and health.consecutive == 100


def test_failures_across_streams_trip_it_once_naming_them_and_a_success_between_starts_over():
    health, heard = WorkerHealth(), []
    health.on_trip(heard.append)
    assert [health.failed(f"s{i % 2}", BUG) for i in range(3)] == [False, True, True]  # s0 alone, then both
    health.succeeded()  # the worker did something right: the run starts over
    assert health.consecutive == 0 and not health.failed("s0", BUG)
    for i in range(FAILURES_TO_TRIP - 2):
        health.failed(f"s{i % 3}", BUG)
    assert health.tripped is None and heard == []  # one short
    health.failed("s9", RuntimeError("other"))
    assert heard == [health.tripped]
    assert health.tripped == (f"{FAILURES_TO_TRIP} attempts in a row across 4 streams failed with exceptions that "
                              f"are not the chunks' own, and none succeeded between ({FAILURES_TO_TRIP - 1} x "
                              f"AttributeError: {BUG}; 1 x RuntimeError: other)")
    assert health.failed("s0", BUG) and heard == [health.tripped]  # told once
    late = []
    health.on_trip(late.append)  # a listener that comes after the trip hears it at once
    assert late == [health.tripped]


# --- the activities ----------------------------------------------------------------------------


class Breakable(StreamActivities):
    broken = False

    def engine(self, model):
        if self.broken:
            raise BUG
        return super().engine(model)


def _acts(cls: type[StreamActivities] = StreamActivities, **kw) -> StreamActivities:
    return cls(models=ModelRegistry([MODEL], backend="reference"), store=MemoryStateStore(),
               keyring=Keyring.generate(), **kw)


def _advance(env: ActivityEnvironment, acts: StreamActivities, sid: str, opened, tokens: list[int]):
    return env.run(acts.advance_chunk, AdvanceChunkRequest(
        stream_id=sid, principal="alice", receipt=opened.receipt,
        request=AdvanceRequest(principal="alice", chunk_seq=1, tokens=tokens)))


def _cancel_after(env: ActivityEnvironment, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, env.cancel)
    timer.start()
    return timer


def test_a_cancellation_never_interrupts_a_models_first_load(monkeypatch):
    """The attempt is cancelled while its model loads (slowly: 1.5 s): the load runs to its end,
    once, and the attempt ends at the next safe point; the next attempt finds the model there.
    The SDK used to raise CancelledError inside the load (into an import, on a real first load)."""
    loads = []

    def slow_load(*args, **kwargs):
        loads.append(args[0])
        for _ in range(150):  # many bytecodes: an exception raised into this thread lands in here
            time.sleep(0.01)
        return load_model(*args, **kwargs)

    monkeypatch.setattr(registry_module, "load_model", slow_load)
    acts = _acts()
    try:
        env = stream_env()
        timer = _cancel_after(env, 0.3)
        with pytest.raises(CancelledError):
            env.run(acts.open_stream, OpenStreamRequest(stream_id="s1", principal="alice", model_id=MODEL))
        timer.join()
        assert loads == [MODEL] and acts.store.list_stream(stream_id="s1") == []  # loaded; nothing committed
        opened = stream_env().run(acts.open_stream,
                                           OpenStreamRequest(stream_id="s1", principal="alice", model_id=MODEL))
        assert loads == [MODEL] and opened.receipt.position == 0
    finally:
        acts.close()


def test_a_cancelled_chunk_ends_at_its_next_safe_point_commits_nothing_and_the_next_attempt_is_right():
    """Cancelled while the engine runs it (three pieces, 2.5 s each), the attempt ends at its next
    wait on the engine: nothing is committed, the engine drops the chunk after the piece it was
    running (and the half-advanced state with it), and the retry advances from the committed
    state to what one scan gives."""
    acts = _acts(prefill_piece=2)
    model = load_model(MODEL, backend="reference")
    try:
        env = stream_env()
        opened = env.run(acts.open_stream, OpenStreamRequest(stream_id="s1", principal="alice", model_id=MODEL))
        served = acts.models.get(MODEL)
        real = served.advance

        pieces = []

        def slow(state, tokens, **kw):  # the engine thread's long piece
            pieces.append(list(tokens))
            time.sleep(2.5)
            return real(state, tokens, **kw)

        served.advance = slow
        env = stream_env()
        timer = _cancel_after(env, 0.3)
        t0 = time.monotonic()
        with pytest.raises(CancelledError, match="cancelled"):
            _advance(env, acts, "s1", opened, [3, 4, 5, 6, 7, 8])
        assert time.monotonic() - t0 < 2.4  # at the next wait on the engine, not when the piece is done
        timer.join()
        assert acts.store.list_stream(stream_id="s1") == [opened.receipt.state_key,
                                                          record_key(opened.receipt.state_key)]
        engine = acts.engine(served)
        deadline = time.monotonic() + 10
        while engine.slots.handle("s1") is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the piece in progress ends; then the engine drops the chunk and its slot
        assert pieces == [[3, 4]] and engine.slots.handle("s1") is None
        del served.advance
        done = _advance(stream_env(), acts, "s1", opened, [3, 4, 5, 6, 7, 8]).result
        truth = model.advance(model.initial_state(), [3, 4, 5, 6, 7, 8])
        assert done.receipt.checksum == plaintext_checksum(truth.state.tensors) and done.position == 6
    finally:
        acts.close()


def test_a_failure_judged_the_workers_is_retried_and_a_tripped_worker_refuses_work_and_says_so():
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    acts = _acts(Breakable, metrics=StreamMetrics(runtime.metric_meter))
    try:
        env = stream_env()
        opened = {s: stream_env(s).run(acts.open_stream, OpenStreamRequest(stream_id=s, principal="alice",
                                                                           model_id=MODEL)) for s in ("s1", "s2")}
        acts.broken = True

        def attempt(sid: str, n: int):
            env.info = dataclasses.replace(env.info, attempt=n, workflow_id=sid)
            return _advance(env, acts, sid, opened[sid], [1])

        # one stream's bug: its last attempt fails for good, typed
        with pytest.raises(ApplicationError) as err:
            attempt("s1", UNTYPED_ATTEMPTS)
        assert err.value.type == "InternalError" and err.value.non_retryable
        # another stream fails too, none succeeding between: the worker's fault, retried ...
        with pytest.raises(AttributeError):
            attempt("s2", UNTYPED_ATTEMPTS)
        # ... a bounded number of times
        with pytest.raises(ApplicationError) as err:
            attempt("s2", WORKER_FAULT_ATTEMPTS)
        assert err.value.type == "InternalError"
        series = scrape(port)
        assert total(series, "mamba_stream_untyped_failures", exception="AttributeError") == 3
        assert total(series, "mamba_stream_consecutive_failures") == 3
        assert total(series, "mamba_stream_worker_unhealthy") == 0
        for i in range(FAILURES_TO_TRIP - 3):
            with pytest.raises(AttributeError):
                attempt(f"s{1 + i % 2}", 1)
        assert acts.health.tripped is not None
        assert total(scrape(port), "mamba_stream_worker_unhealthy") == 1
        acts.broken = False  # whatever it is asked now, a tripped worker refuses it, retryable
        with pytest.raises(ApplicationError) as err:
            attempt("s1", 1)
        assert err.value.type == "WorkerUnhealthy" and not err.value.non_retryable
        assert acts.health.tripped in err.value.message
        assert acts.store.list_stream(stream_id="s1") == [opened["s1"].receipt.state_key,
                                                           record_key(opened["s1"].receipt.state_key)]
    finally:
        acts.close()
