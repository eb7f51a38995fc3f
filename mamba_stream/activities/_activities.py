"""StreamActivities: the side-effect half of a stream (load, advance, seal, store, dispose), the
Temporal-facing class. Its `@activity.defn` methods are thin: each runs its body under
`_guards.guarded` (typed failures, the worker's health, cooperative cancellation), and the body
lives where its kind of work does:

    _chunk.py      advance and generate: prepared, run by the engine, committed (exactly once)
    _open.py       open and reset: an epoch's first state, committed and held in the stream's slot
    _recorded.py   checkpoint, rewind, recall: what the stream committed earlier, read back
    _carry.py      the continue-as-new carry, sealed and verified
    _guards.py     the guard, cancellation points and heartbeats

Every activity verifies the receipt it is given against the serving model and the caller's
principal (`_check`), and a signed request against the principal's key (`_verify`). What they
share lives here: the models (`_model`), one `StreamEngine` per model (`engine`), states loaded
from the store (`_fetch`), the commit protocol (`commits`), the prefix store (`prefixes`), the
worker's health and metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from temporalio import activity

from mamba_stream.activities import _chunk, _open, _recorded
from mamba_stream.activities._alloc import release_freed
from mamba_stream.activities._carry import CarrySeals
from mamba_stream.activities._commit import ChunkCommit
from mamba_stream.activities._drift import DriftCheck
from mamba_stream.activities._engine import SeededSampler, StreamEngine, _multinomial_form_holds, owner_of
from mamba_stream.activities._fairness import Bursts, Fairness, InFlight, Quotas, apply_weights, demote
from mamba_stream.activities._guards import beat, cancel_point, guarded
from mamba_stream.activities._health import WorkerHealth
from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.activities._prefix import PrefixStore
from mamba_stream.activities._registry import ModelRegistry
from mamba_stream.activities._store import StateStore, StoreError, check_name
from mamba_stream.scan import CheckpointError, Model, ScanError, State
from mamba_stream.state_codec import BadSignature, Receipt, stream_tag, validate_resume
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.state_codec.signing import PrincipalKeys
from mamba_stream.workflows import (
    ACTIVITY_ADVANCE,
    ACTIVITY_CHECKPOINT,
    ACTIVITY_DISPOSE,
    ACTIVITY_GENERATE,
    ACTIVITY_OPEN,
    ACTIVITY_OPEN_CARRY,
    ACTIVITY_RECALL,
    ACTIVITY_RESET,
    ACTIVITY_REWIND,
    ACTIVITY_SEAL_CARRY,
    ACTIVITY_VERIFY,
    AdvanceChunkRequest,
    AdvanceChunkResult,
    CarrySeal,
    CarrySealRequest,
    CheckpointStreamRequest,
    DisposeStreamRequest,
    DisposeStreamResult,
    GenerateChunkRequest,
    GenerateChunkResult,
    OpenStreamRequest,
    OpenStreamResult,
    RecallResultRequest,
    RecallResultResult,
    ResetStreamRequest,
    RewindStreamRequest,
    StateResult,
    VerifyRequest,
    application_error,
)

__all__ = ["StreamActivities"]

log = logging.getLogger(__name__)


class StreamActivities:
    """The activities of MambaStreamWorkflow, sharing one worker's models, store, keys and engines.

    Args:
        models: the models this worker serves.
        store: where checkpoints live (shared by all workers of a deployment).
        keyring: encrypts checkpoints and records.
        worker_queue: this worker's own task queue, returned to workflows for affinity; None
            disables affinity.
        slots: streams each model keeps hot (its engine's slot table).
        max_batch, max_wait_s, prefill_piece: the engines' batching (see `StreamEngine`).
        principal_keys: the principals' Ed25519 public keys; when given, every open, advance,
            generate, reset and checkpoint must be signed by its principal for its stream, and is
            verified before it touches any state. None: requests are not signed.
        metrics: the meters to report to (`StreamMetrics` on the worker runtime's meter); None:
            counted nowhere.
        drift_check_every: every Nth advanced chunk is run again from the same input state: on an
            exact backend in another partition, which must give the same bits (else counted as an
            exact mismatch), elsewhere on the reference backend; max |logits difference| goes to
            the drift histogram; 0: off (`activities._drift.DriftCheck`).
        prefix_bytes, prefix_ram_bytes, shared_prefixes: the prefix store's bound per scope (0:
            prefixes are computed for each stream, never stored), the decoded prefix states kept
            in memory, and the operator's shared prefixes (texts or token ids, by model id), served
            to every principal (`activities.PrefixStore`).
    """

    def __init__(self, *, models: ModelRegistry, store: StateStore, keyring: Keyring,
                 worker_queue: str | None = None, slots: int = 256, max_batch: int = 64,
                 max_wait_s: float = 0.002, prefill_piece: int = 256,
                 principal_keys: PrincipalKeys | None = None, metrics: StreamMetrics | None = None,
                 drift_check_every: int = 0, prefix_bytes: int = 1 << 30, prefix_ram_bytes: int = 256 << 20,
                 shared_prefixes: dict[str, list[str | list[int]]] | None = None,
                 fairness: Fairness | None = None, quotas: Quotas | None = None) -> None:
        self.models = models
        self.store = store
        self.keyring = keyring
        self.worker_queue = worker_queue
        self.principal_keys = principal_keys
        self.metrics = metrics or StreamMetrics()
        self.drift = DriftCheck(drift_check_every)
        self.fairness = fairness or Fairness()
        #: the operator's weights by principal tag: the engines' and the server's (`apply_weights`)
        self.fair_weights = self.fairness.tag_weights(keyring)
        self.quotas = quotas or Quotas()
        self.in_flight = InFlight(self.quotas.chunks_in_flight)
        self.bursts = Bursts(self.fairness.burst if self.fairness.enabled else 0)
        self._temporal: tuple[Any, asyncio.AbstractEventLoop] | None = None  # the worker's client, its loop
        self._engine_args = dict(capacity=slots, max_batch=max_batch, max_wait_s=max_wait_s,
                                 prefill_piece=prefill_piece, fair=self.fairness.enabled, weights=self.fair_weights,
                                 state_quota=self.quotas.state_bytes)
        self.engines: dict[str, StreamEngine] = {}
        self._engines_lock = threading.Lock()
        self._counted: set[tuple[str, str, str]] = set()  # (model, revision, backend) counted as loaded
        # the edge callback late-bound, so that a subclass's `_edge` (the crash tests') is the one called
        self.commits = ChunkCommit(store, keyring, self.metrics,
                                   edge=lambda name, sid, seq: self._edge(name, sid, seq))
        self.carries = CarrySeals(keyring)
        self.prefixes = PrefixStore(store, keyring, self.metrics, max_bytes=prefix_bytes, ram_bytes=prefix_ram_bytes,
                                    shared=shared_prefixes, segments=self.commits.segments)
        #: whether this worker's failures are its own; the plugin stops a tripped worker
        self.health = WorkerHealth()
        self.health.on_trip(lambda why: self.metrics.worker_unhealthy.add(1))

    def activities(self) -> list[Callable[..., Any]]:
        return [self.open_stream, self.advance_chunk, self.generate_tokens, self.reset_stream,
                self.checkpoint_stream, self.dispose_stream, self.recall_result, self.rewind_stream,
                self.verify_request, self.seal_carry, self.open_carry]

    # --- the activities -----------------------------------------------------------------------

    @activity.defn(name=ACTIVITY_OPEN, no_thread_cancel_exception=True)
    def open_stream(self, req: OpenStreamRequest) -> OpenStreamResult:
        """Bind a new stream to a model: its initial state, a prefix's, or a validated checkpoint to resume."""
        with self._guarded(req.stream_id, req.model_id):
            return _open.open_stream(self, req)

    @activity.defn(name=ACTIVITY_ADVANCE, no_thread_cancel_exception=True)
    def advance_chunk(self, req: AdvanceChunkRequest) -> AdvanceChunkResult:
        """Advance the stream by one chunk, exactly once."""
        t0 = time.perf_counter()
        with self._guarded(req.stream_id, req.receipt.model_id), self.in_flight.chunk(owner_of(req.stream_id)):
            return _chunk.advance(self, req, t0)

    @activity.defn(name=ACTIVITY_GENERATE, no_thread_cancel_exception=True)
    def generate_tokens(self, req: GenerateChunkRequest) -> GenerateChunkResult:
        """Sample tokens with a seeded generator, each advancing the state like input, up to
        `max_tokens`, a stop text or the end of the sequence; exactly once (`_chunk.generate`)."""
        t0 = time.perf_counter()
        with self._guarded(req.stream_id, req.receipt.model_id), self.in_flight.chunk(owner_of(req.stream_id)):
            return _chunk.generate(self, req, t0)

    @activity.defn(name=ACTIVITY_RESET, no_thread_cancel_exception=True)
    def reset_stream(self, req: ResetStreamRequest) -> StateResult:
        """A new epoch at position 0: the model's initial state, sealed for the stream."""
        with self._guarded(req.stream_id, req.receipt.model_id):
            return _open.reset_stream(self, req)

    @activity.defn(name=ACTIVITY_CHECKPOINT, no_thread_cancel_exception=True)
    def checkpoint_stream(self, req: CheckpointStreamRequest) -> StateResult:
        """Prove the stream's current checkpoint (or an earlier one, `state_key`: its recorded
        receipt) is in the store and authentic; return its receipt."""
        with self._guarded(req.stream_id, req.receipt.model_id):
            return _recorded.checkpoint_stream(self, req)

    @activity.defn(name=ACTIVITY_RECALL, no_thread_cancel_exception=True)
    def recall_result(self, req: RecallResultRequest) -> RecallResultResult:
        """A committed chunk's recorded result (a repeated update id whose full result was not
        carried across continue-as-new)."""
        with self._guarded(req.stream_id):
            return _recorded.recall_result(self, req)

    @activity.defn(name=ACTIVITY_REWIND, no_thread_cancel_exception=True)
    def rewind_stream(self, req: RewindStreamRequest) -> StateResult:
        """The receipt of one of the stream's earlier checkpoints, checked to be stored and
        authentic: what the stream goes back to. The undone chunks' checkpoints are deleted."""
        with self._guarded(req.stream_id, req.receipt.model_id):
            return _recorded.rewind_stream(self, req)

    @activity.defn(name=ACTIVITY_VERIFY, no_thread_cancel_exception=True)
    def verify_request(self, req: VerifyRequest) -> VerifyRequest:
        """A request's signature, verified (no-op when requests are not signed here)."""
        with self._guarded(req.stream_id):
            self._verify(req.kind, req.stream_id, req.principal, req.request)
            return req

    @activity.defn(name=ACTIVITY_SEAL_CARRY, no_thread_cancel_exception=True)
    def seal_carry(self, req: CarrySealRequest) -> CarrySeal:
        """Seal what the stream carries to its next run, for its stream and the run that
        continues as new (`_carry.CarrySeals.seal`)."""
        with self._guarded(req.stream_id):
            return self.carries.seal(req)

    @activity.defn(name=ACTIVITY_OPEN_CARRY)
    async def open_carry(self, req: CarrySealRequest) -> CarrySeal:
        """Verify a carry before the run that received it trusts any of it; ForgedCarry
        otherwise (`_carry.CarrySeals.open`)."""
        with self._guarded(req.stream_id):
            return await self.carries.open(req)

    @activity.defn(name=ACTIVITY_DISPOSE, no_thread_cancel_exception=True)
    def dispose_stream(self, req: DisposeStreamRequest) -> DisposeStreamResult:
        """Zero the stream's hot states and delete every blob of it.

        The hot states go first: they are this worker's, and a store fault must not keep them.
        A store fault is reported retryable whatever its kind (read-only, unreachable, a
        permission): a cancel has no caller to send it again, so its dispose waits until the
        store takes the delete (the workflow retries it without bound)."""
        with self._guarded(req.stream_id):
            check_name("stream id", req.stream_id)
            evicted = self.release_stream(req.stream_id)
            try:
                deleted = self.store.delete_stream(stream_id=req.stream_id)
            except StoreError as exc:
                log.warning("dispose of stream %s waits for the store: %s", req.stream_id, exc)
                raise application_error(exc, retryable=True) from exc
            log.info("disposed stream %s: %d blobs deleted, %d hot states zeroed", req.stream_id, deleted, evicted)
            return DisposeStreamResult(deleted=deleted, evicted=evicted)

    # --- engines ------------------------------------------------------------------------------

    def engine(self, model: Model) -> StreamEngine:
        with self._engines_lock:
            eng = self.engines.get(model.model_id)
            if eng is None:
                eng = self.engines[model.model_id] = StreamEngine(model, **self._engine_args)
            return eng

    async def share_queue(self, client: Any, task_queue: str) -> bool:
        """Set the operator's fairness weights (`Fairness.weights`, by principal tag) as the
        server's overrides of `task_queue` (`apply_weights`; the plugin does it for each queue its
        worker serves), and keep `client` for moving bursts of streams (`opened`). True when there
        are no weights to set."""
        self._temporal = (client, asyncio.get_running_loop())
        return await apply_weights(client, task_queue, self.fair_weights)

    def opened(self, stream_id: str) -> None:
        """A stream of `stream_id`'s principal opened on this worker: past the principal's burst
        (`Fairness.burst` within `BURST_WINDOW_S`) it is moved to the bulk priority level
        (`demote`, on the worker's loop, not waited for; counted in `mamba_stream_bulk_streams`).
        A worker that has no client (its activities not run by the plugin) moves nothing."""
        tag = stream_tag(stream_id)
        if tag is None or not self.bursts.opened(tag) or self._temporal is None:
            return
        client, loop = self._temporal

        def moved(done: Any) -> None:
            if not done.cancelled() and done.exception() is None and done.result():
                self.metrics.bulk_streams.add(1)

        coro = demote(client, stream_id, tag)
        try:
            asyncio.run_coroutine_threadsafe(coro, loop).add_done_callback(moved)
        except RuntimeError:  # the worker's loop is closed (it is shutting down): the open stands
            coro.close()
            log.debug("stream %s opened as its worker stops: not moved to the bulk level", stream_id)

    def use_metrics(self, metrics: StreamMetrics) -> None:
        """Count into `metrics` from now on (a worker's own endpoint): the commits and the prefix
        store with the activities, so that no counter is left on the one made at construction."""
        self.metrics = self.commits.metrics = self.prefixes.metrics = metrics

    def close(self) -> None:
        """Stop the engines (threads, slots). Idempotent; a later chunk starts a fresh engine."""
        with self._engines_lock:
            engines, self.engines = list(self.engines.values()), {}
        for eng in engines:
            eng.close()

    def warm(self, model_ids: list[str] | None = None) -> dict[str, float]:
        """Load the models (default: every one this worker serves) and run each through its
        engine once, before the worker takes work: what first use builds (lazy imports, the
        exact backend's kernels and their probe, the engine's thread, slots and sampler check)
        is then never inside an attempt that a timeout or a cancellation ends. Seconds per model.
        """
        took: dict[str, float] = {}
        _multinomial_form_holds()
        for mid in model_ids if model_ids is not None else self.models.ids:
            t0 = time.perf_counter()
            try:
                model = self._model(mid)
            except ScanError as exc:  # the worker refuses to start (worker.py): say which model
                raise CheckpointError(f"model {mid!r} cannot be loaded: {type(exc).__name__}: {exc}") from exc
            engine = self.engine(model)
            # one token in, one sampled: the batched step, the sampler and the engine's pace
            sid = f"warm-{mid}"
            engine.put(sid, model.initial_state(), epoch=0, state_key="warm/0")
            try:  # advance and generate wait: their `load` runs within this iteration (B023)
                engine.advance(sid, [0], expected_key="warm/0", epoch=0, load=lambda: (model.initial_state(), None))  # noqa: B023
                engine.mark_committed(sid, "warm/1")
                engine.generate(sid, SeededSampler(1.0, 0, torch.Generator().manual_seed(0)), 1,
                                expected_key="warm/1", epoch=0, load=lambda: (model.initial_state(), None))  # noqa: B023
            finally:
                engine.release(sid)
            took[mid] = time.perf_counter() - t0
            log.info("model %s ready in %.2f s (%s)", mid, took[mid], model.backend)
        return took

    def _engine_list(self) -> list[StreamEngine]:
        with self._engines_lock:
            return list(self.engines.values())

    def hot_stream_ids(self) -> set[str]:
        """Streams whose state some engine of this worker holds hot."""
        return {sid for e in self._engine_list() for sid in e.hot_stream_ids()}

    def release_stream(self, stream_id: str) -> int:
        """Zero and free the stream's hot states here; how many there were."""
        released = sum(eng.release(stream_id) for eng in self._engine_list())
        self._gauge()
        return released

    def _gauge(self) -> None:
        self.metrics.active_states.set(sum(len(e.hot_stream_ids()) for e in self._engine_list()))

    # --- what the activities share --------------------------------------------------------------

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        """A commit edge (`activities._commit`'s docstring; "admitted" is passed in `_chunk`).
        Does nothing; tests kill a worker here."""

    @contextmanager
    def _guarded(self, stream_id: str, model_id: str = "") -> Iterator[None]:
        """An activity's body, under this worker's health and metrics (`_guards.guarded`); after
        it, with the body's frames gone, a big model's freed state copies go back to the system
        (`release_freed`)."""
        try:
            with guarded(self.health, self.metrics, stream_id, model_id):
                yield
        finally:
            model = self.models.loaded(model_id) if model_id else None
            if model is not None:
                release_freed(model.schema.state_bytes)

    def _verify(self, kind: str, stream_id: str, principal: str, request: Any) -> None:
        """The request's signature, before anything else (no-op when no principal keys are configured)."""
        if self.principal_keys is None:
            return
        claims = request.claims() if request is not None else {"principal": principal}
        if claims.get("principal") != principal:
            raise BadSignature(f"the {kind} request is signed for {claims.get('principal')!r}, sent for {principal!r}",
                               field="principal", expected=principal, actual=claims.get("principal"))
        self.principal_keys.verify(kind, stream_id, claims, request.signature if request is not None else None)

    def _model(self, model_id: str) -> Model:
        # loaded under the registry's lock, which no cancellation interrupts (`_guards`);
        # an attempt that was cancelled meanwhile ends here, not in the chunk's work
        model = self.models.get(model_id, on_wait=beat)
        cancel_point()
        seen = (model_id, model.revision, model.backend)
        if seen not in self._counted:
            with self._engines_lock:
                if seen not in self._counted:
                    self._counted.add(seen)
                    a = model.arithmetic()
                    self.metrics.models_loaded.add(1, {"model": model_id, "backend": model.backend,
                                                       "path": a.path, "arithmetic": a.id})
        return model

    def _check(self, model: Model, receipt: Receipt, principal: str, stream_id: str) -> None:
        validate_resume(receipt, model.identity(), principal, stream_id=stream_id)
        self.metrics.used(receipt.state_key, model.model_id)

    def _fetch(self, model: Model, receipt: Receipt, principal: str, *, current: bool = True
               ) -> tuple[State, torch.Tensor | None]:
        """A committed state (and its next-token logits) from the store, fully checked: a
        migration (`StreamMetrics.migrated`). `current`: the stream's own current receipt (a
        missing checkpoint may mean a rewind past the window)."""
        fetch = self.commits.fetch_current if current else self.commits.fetch
        state, logits, size = fetch(model, receipt, principal)
        self.metrics.migrated(size, model.model_id)
        return state, logits

