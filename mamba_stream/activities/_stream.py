"""StreamActivities: the side-effect half of a stream (load, advance, seal, store, dispose).

Every activity verifies the receipt it is given against the serving model and the caller's
principal. The model's `StreamEngine` advances the state: from its slot when the slot holds that
committed state (by state key, never by shape), otherwise after loading it from the store. It
batches the single-token steps of concurrent streams. The activity then commits the new
checkpoint by the commit protocol (`activities._commit.ChunkCommit`: derived keys, seal,
put-if-absent, adoption of an earlier attempt's write, result records, drops, and the commit
edges the crash tests use, `_edge`): a chunk is never advanced twice, whatever was lost.

Failures cross Temporal typed by reason (`workflows.application_error`): permanent ones
non-retryable, transient ones (a store outage) retried by the activity's retry policy. An
exception nobody foresaw is retried `UNTYPED_ATTEMPTS` times, then fails the chunk as
`InternalError`: a bug never retries forever behind the stream's lock. Unless it is judged the
worker's own (`WorkerHealth`: this worker fails other streams' chunks too, with no success
between): then it is retried, up to `WORKER_FAULT_ATTEMPTS`, and the worker stops taking work
once it trips.

Cancellation is cooperative. The SDK would cancel a thread-run activity by raising
CancelledError asynchronously inside its thread, wherever it is: in the middle of an import (a
model's first load imports torch._dynamo and sympy), which then stays half-done for the whole
process. So every activity is declared `no_thread_cancel_exception=True`, and checks
`activity.is_cancelled()` at safe points (`_cancel_point`): once its model is there, before it
hands the chunk to the engine, five times a second while it waits on the engine (`_beat`, which
heartbeats once a second), and before a commit starts. A local attempt that times out is
cancelled the same way (SDK 1.35.0 cancels it with `timed_out` set): it ends at its next safe
point, its pool thread free again within 0.2 s of waiting, and the engine drops its work, while
the regular attempt takes over. Models load at worker start (`warm`), or on first use under the
registry's lock, which nothing interrupts now.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from temporalio import activity
from temporalio.client import WorkflowHistoryEventFilterType
from temporalio.exceptions import ApplicationError, CancelledError

from mamba_stream.activities._commit import ChunkCommit
from mamba_stream.activities._engine import SeededSampler, StreamEngine, _multinomial_form_holds
from mamba_stream.activities._health import WorkerHealth
from mamba_stream.activities._live import LiveTokens
from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.activities._prefix import PREFIX_STREAM_PREFIX, Compute, PrefixStore, is_prefix_stream
from mamba_stream.activities._registry import ModelRegistry
from mamba_stream.activities._store import StateStore, StoreError, check_name
from mamba_stream.failures import Failure
from mamba_stream.scan import CheckpointError, Model, ScanError, State
from mamba_stream.state_codec import (
    BadSignature,
    EpochMismatch,
    ForgedCarry,
    InputTransformMismatch,
    Origin,
    PrincipalMismatch,
    Receipt,
    RequestRejected,
    StateRejected,
    StreamMismatch,
    parse_state_key,
    stream_tag,
    validate_resume,
)
from mamba_stream.state_codec.codec import Keyring, unseal
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
    PRESENTATION,
    AdvanceChunkRequest,
    AdvanceChunkResult,
    AdvanceResult,
    CarrySeal,
    CarrySealRequest,
    CheckpointStreamRequest,
    ChunkTooLarge,
    DisposeStreamRequest,
    DisposeStreamResult,
    EmptyContext,
    GenerateChunkRequest,
    GenerateChunkResult,
    GenerateResult,
    InternalError,
    InvalidRequest,
    LocalTooSlow,
    ModelInfo,
    OpenStreamRequest,
    OpenStreamResult,
    RecallResultRequest,
    RecallResultResult,
    ResetStreamRequest,
    ResultExpired,
    RewindStreamRequest,
    RewindUnavailable,
    StateResult,
    TokenLogprob,
    TokenProgress,
    UpdateIdMismatch,
    VerifyRequest,
    WorkerUnhealthy,
    application_error,
    id_digest,
    parse_update_id,
)

__all__ = ["StreamActivities"]

log = logging.getLogger(__name__)

#: tokens per engine call inside one chunk: between calls the activity heartbeats, so a
#: cancellation reaches a long prefill (the split is invisible: chunking never changes results)
PIECE_TOKENS = 512
#: seconds between heartbeats of an attempt that waits (heartbeat_timeout_s is at least twice it)
BEAT_S = 1.0
#: attempts of an activity that fails with an exception nobody foresaw, before it fails typed
UNTYPED_ATTEMPTS = 3
#: attempts of one whose failures are judged the worker's (`WorkerHealth.failed`), before it fails
#: typed all the same: a chunk that breaks every worker it reaches does not go round forever
WORKER_FAULT_ATTEMPTS = 10
#: the most engine rounds a local attempt takes on before its engine has measured its pace
UNMEASURED_LOCAL_ROUNDS = 16


@contextmanager
def _typed_errors(metrics: StreamMetrics | None = None, model_id: str = "",
                  worker_fault: Callable[[BaseException], bool] | None = None) -> Iterator[None]:
    """Our exceptions become ApplicationErrors typed by reason; permanent ones non-retryable.

    Refusals are counted on the way out: a signature's as a refused request, a receipt's or a
    checkpoint's as a refused resume. Any other exception is retried (re-raised) until the
    activity's `UNTYPED_ATTEMPTS`-th attempt, which fails it as a non-retryable `InternalError`
    naming the original; `worker_fault(exc)` is told of each, and where it answers True (the
    failure is the worker's, not the chunk's) retries go on up to `WORKER_FAULT_ATTEMPTS`.
    """
    try:
        yield
    except ApplicationError:
        raise
    except CancelledError:
        raise
    except Exception as exc:  # every exception leaves typed, or is retried a bounded number of times
        if isinstance(exc, Failure):  # a reason of its own: application_error types it
            if metrics is not None and isinstance(exc, StateRejected):
                if isinstance(exc, RequestRejected):
                    metrics.requests_rejected.add(1, {"reason": exc.reason})
                else:
                    metrics.refused(exc.reason, model_id)
            raise application_error(exc) from exc
        attempt = activity.info().attempt if activity.in_activity() else UNTYPED_ATTEMPTS
        theirs = worker_fault(exc) if worker_fault is not None else False
        if attempt < UNTYPED_ATTEMPTS or (theirs and attempt < WORKER_FAULT_ATTEMPTS):
            log.warning("untyped failure on attempt %d of %d%s: %r", attempt,
                        WORKER_FAULT_ATTEMPTS if theirs else UNTYPED_ATTEMPTS,
                        " (this worker fails other streams too)" if theirs else "", exc)
            raise
        log.error("untyped failure on attempt %d, failing the chunk: %r", attempt, exc, exc_info=exc)
        raise application_error(InternalError(
            f"{type(exc).__name__}: {exc} (after {attempt} attempts)", exception=type(exc).__name__,
            attempts=attempt)) from exc


def _cancel_point() -> None:
    """A safe point: raise CancelledError here if the attempt was cancelled (by the workflow, a
    timeout, the worker's shutdown). Nothing else raises it in our threads (module docstring)."""
    if activity.in_activity() and activity.is_cancelled():
        details = activity.cancellation_details()
        why = "timed out" if details is not None and details.timed_out else "cancelled"
        raise CancelledError(f"the attempt was {why}")


_beats = threading.local()  # (task token, when) of the last heartbeat sent from this thread


def _beat(*details: Any) -> None:
    """While waiting (several times a second): a safe point, then a heartbeat at most once a
    second (a local activity has none: its timeout still cancels it, and this is where it notices)."""
    _cancel_point()
    if activity.in_activity() and not activity.info().is_local:
        token, now = activity.info().task_token, time.monotonic()
        last = getattr(_beats, "last", None)
        if last is None or last[0] != token or now - last[1] >= BEAT_S:
            _beats.last = (token, now)
            activity.heartbeat(*details)


def _live_wait(live: LiveTokens) -> Callable[[], float | None]:
    """A streaming generate's wait: a safe point, then its progress heartbeated at its own pace."""
    def wait() -> float | None:
        _cancel_point()
        return live.on_wait()
    return wait


def _digest(logits: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(logits.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _own_key(stream_id: str, state_key: str) -> None:
    """A checkpoint key a request names is one of its stream's own (a forged carry or a recorded
    result could name any), else StreamMismatch."""
    owner = parse_state_key(state_key)
    if owner is None or owner.stream_id != stream_id:
        raise StreamMismatch(f"{state_key!r} is not a checkpoint of stream {stream_id}", field="state_key",
                             expected=stream_id, actual=owner.stream_id if owner else None)


def _top_k(last: torch.Tensor | None, k: int) -> list[TokenLogprob]:
    if last is None or k == 0:
        return []
    logp = torch.log_softmax(last.double(), dim=-1)
    vals, idx = torch.topk(logp, min(k, logp.numel()))
    return [TokenLogprob(token=int(i), logprob=float(v)) for v, i in zip(vals, idx, strict=True)]


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
            the drift histogram; 0: off.
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
                 shared_prefixes: dict[str, list[str | list[int]]] | None = None) -> None:
        self.models = models
        self.store = store
        self.keyring = keyring
        self.worker_queue = worker_queue
        self.principal_keys = principal_keys
        self.metrics = metrics or StreamMetrics()
        self.drift_check_every = drift_check_every
        self._advanced = itertools.count(1)  # chunks advanced, for the drift sampling
        self._engine_args = dict(capacity=slots, max_batch=max_batch, max_wait_s=max_wait_s,
                                 prefill_piece=prefill_piece)
        self.engines: dict[str, StreamEngine] = {}
        self._engines_lock = threading.Lock()
        self.loads_from_store = 0  # states that were not hot here: migrations and evictions
        self._counted: set[tuple[str, str, str]] = set()  # (model, revision, backend) counted as loaded
        # the edge callback late-bound, so that a subclass's `_edge` (the crash tests') is the one called
        self.commits = ChunkCommit(store, keyring, self.metrics,
                                   edge=lambda name, sid, seq: self._edge(name, sid, seq))
        self._carry_key = keyring.subkey("mamba-stream/carry/v1")
        self.prefixes = PrefixStore(store, keyring, self.metrics, max_bytes=prefix_bytes, ram_bytes=prefix_ram_bytes,
                                    shared=shared_prefixes)
        #: whether this worker's failures are its own; the plugin stops a tripped worker
        self.health = WorkerHealth()
        self.health.on_trip(lambda why: self.metrics.worker_unhealthy.add(1))

    def engine(self, model: Model) -> StreamEngine:
        with self._engines_lock:
            eng = self.engines.get(model.model_id)
            if eng is None:
                eng = self.engines[model.model_id] = StreamEngine(model, **self._engine_args)
            return eng

    def close(self) -> None:
        """Stop the engines (threads, slots). Idempotent; a later chunk starts a fresh engine."""
        with self._engines_lock:
            engines, self.engines = list(self.engines.values()), {}
        for eng in engines:
            eng.close()

    def activities(self) -> list[Callable[..., Any]]:
        return [self.open_stream, self.advance_chunk, self.generate_tokens, self.reset_stream,
                self.checkpoint_stream, self.dispose_stream, self.recall_result, self.rewind_stream,
                self.verify_request, self.seal_carry, self.open_carry]

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        """A commit edge (see the module docstring). Does nothing; tests kill a worker here."""

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

    @contextmanager
    def _guarded(self, stream_id: str, model_id: str = "") -> Iterator[None]:
        """An activity's body: refused at once on a tripped worker (retryable: another worker
        takes it), its exceptions typed (`_typed_errors`), and its outcome told to `health`."""
        why = self.health.tripped
        if why is not None:
            raise application_error(WorkerUnhealthy(f"this worker stopped taking work: {why}"))
        if activity.in_activity():
            # Only the stream's own workflow schedules its activities: the server says which
            # workflow did (a standalone activity, started by any caller of the frontend, names none)
            caller = activity.info().workflow_id
            if caller != stream_id:
                raise application_error(StreamMismatch(
                    f"an activity of stream {stream_id} scheduled by {caller or 'no workflow'}",
                    field="workflow_id", expected=stream_id, actual=caller))

        def worker_fault(exc: BaseException) -> bool:
            self.metrics.untyped_failures.add(1, {"exception": type(exc).__name__})
            theirs = self.health.failed(stream_id, exc)
            self.metrics.consecutive_failures.set(self.health.consecutive)
            return theirs

        with _typed_errors(self.metrics, model_id, worker_fault):
            yield
        self.health.succeeded()
        self.metrics.consecutive_failures.set(0)

    def _local_fits(self, model: Model, rounds: int) -> None:
        """In a local attempt, decline a chunk the engine would not finish within half the local
        timeout at its recent pace (a busy engine): the workflow takes the regular path at once,
        instead of holding its workflow task open and then racing a timed-out attempt."""
        if not activity.in_activity() or not activity.info().is_local:
            return
        timeout = activity.info().start_to_close_timeout
        expected = self.engine(model).expected_seconds(rounds)
        if expected is None and rounds > UNMEASURED_LOCAL_ROUNDS:
            # an engine that has not run yet has no pace: a long chunk on a large model could
            # hold the workflow task past the local timeout
            raise LocalTooSlow(f"{rounds} engine rounds on an engine that has not measured its pace yet")
        if timeout is not None and expected is not None and expected > 0.5 * timeout.total_seconds():
            raise LocalTooSlow(f"{rounds} engine rounds take about {expected:.2f} s now; the local timeout is "
                               f"{timeout.total_seconds():g} s", expected_s=round(expected, 3))

    # --- helpers ------------------------------------------------------------------------------

    def _verify(self, kind: str, stream_id: str, principal: str, request: Any) -> None:
        """The request's signature, before anything else (no-op when no principal keys are configured)."""
        if self.principal_keys is None:
            return
        claims = request.claims() if request is not None else {"principal": principal}
        if claims.get("principal") != principal:
            raise BadSignature(f"the {kind} request is signed for {claims.get('principal')!r}, sent for {principal!r}",
                               field="principal", expected=principal, actual=claims.get("principal"))
        self.principal_keys.verify(kind, stream_id, claims, request.signature if request is not None else None)

    def _check_update_id(self, kind: str, stream_id: str, update_id: str | None, request: Any) -> None:
        """An update id made by `workflows.update_id` names this chunk's content: its digest is the
        content's, keyed by the stream's id key (which only the principal and the workers hold)."""
        named = parse_update_id(update_id) if update_id else None
        if named is None:
            return
        want = id_digest(self.keyring.id_key(stream_tag(stream_id)), kind, request)
        if not hmac.compare_digest(named[3], want):
            raise UpdateIdMismatch(f"update id {update_id!r} does not name this {kind}'s content", update_id=update_id)

    def _model(self, model_id: str) -> Model:
        # loaded under the registry's lock, which no cancellation interrupts (the module docstring);
        # an attempt that was cancelled meanwhile ends here, not in the chunk's work
        model = self.models.get(model_id, on_wait=_beat)
        _cancel_point()
        seen = (model_id, model.revision, model.backend)
        if seen not in self._counted:
            with self._engines_lock:
                if seen not in self._counted:
                    self._counted.add(seen)
                    a = model.arithmetic()
                    self.metrics.models_loaded.add(1, {"model": model_id, "backend": model.backend,
                                                       "path": a.path, "arithmetic": a.id})
        return model

    def _info(self, model: Model) -> ModelInfo:
        ident = model.identity()
        return ModelInfo(
            model_id=model.model_id, model_revision=model.revision, architecture=model.schema.architecture,
            vocab_size=model.vocab_size, input_transform=ident.input_transform,
            input_transform_revision=ident.input_transform_revision, schema_fingerprint=ident.fingerprint,
            state_bytes=model.schema.state_bytes,
        )

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

    def _fetch(self, model: Model, receipt: Receipt, principal: str, *, current: bool = True
               ) -> tuple[State, torch.Tensor | None]:
        """A committed state (and its next-token logits) from the store, fully checked. `current`:
        the stream's own current receipt (a missing checkpoint may mean a rewind past the window)."""
        fetch = self.commits.fetch_current if current else self.commits.fetch
        state, logits, size = fetch(model, receipt, principal)
        self.loads_from_store += 1
        self.metrics.migrations.add(1, {"model": model.model_id})
        self.metrics.migration_bytes.add(size, {"model": model.model_id})
        return state, logits

    def _check(self, model: Model, receipt: Receipt, principal: str, stream_id: str) -> None:
        validate_resume(receipt, model.identity(), principal, stream_id=stream_id)
        self.metrics.used(receipt.state_key, model.model_id)

    def _start_epoch(self, model: Model, stream_id: str, principal: str, state: State, *, kind: str,
                     chunk_seq: int, epoch: int, key: str, before: Receipt | None,
                     last: torch.Tensor | None = None, origin: Origin | None = None) -> Receipt:
        """An epoch's first state, its own (`kind` "open": initial, a prefix's or resumed; "reset":
        initial), committed and held in the stream's slot; `origin` where it came from."""
        _cancel_point()
        done = self.commits.commit(model, state, stream_id=stream_id, principal=principal, chunk_seq=chunk_seq,
                                   epoch=epoch, key=key, backend=model.ran(kind), before=before, origin=origin)
        self.engine(model).put(stream_id, done.state, epoch=epoch, state_key=key, logits=last)
        return done.receipt

    def _complete(self, model: Model, stream_id: str, principal: str, before: Receipt, chunk_seq: int, key: str,
                  state: State, path: str, last: torch.Tensor | None,
                  make_result: Callable[[Receipt], Any], drop_keys: list[str]) -> Any:
        """A computed chunk through the commit protocol; the slot then holds exactly the committed state."""
        _cancel_point()  # the slot ran ahead of the store: the stream's next chunk reloads from there
        done = self.commits.complete(model, state, stream_id=stream_id, principal=principal, before=before,
                                     chunk_seq=chunk_seq, key=key, path=path, last=last, make_result=make_result,
                                     drop_keys=drop_keys)
        engine, committed = self.engine(model), done.committed
        if committed.adopted:  # the engine wrote ours; the store holds an earlier attempt's
            engine.put(stream_id, committed.state, epoch=before.epoch, state_key=key, logits=last)
        else:
            engine.mark_committed(stream_id, key)
        return done.result

    def _reference_input(self, model: Model, receipt: Receipt, principal: str) -> State | None:
        """The chunk's input state, read from the store for the reference check (None if gone)."""
        blob = self.store.get(key=receipt.state_key, owner=self.commits.owner(principal), legacy=principal)
        return None if blob is None else unseal(blob, receipt, self.keyring, model=model, principal=principal)

    def _drift_sample(self, model: Model, state: State, tokens: list[int], logits: torch.Tensor,
                      served: State) -> None:
        """Run the chunk again from the same input state; record how far the served results are.

        Where the arithmetic is exact, the chunk runs again on the same backend in another
        partition (its first token alone, then two uneven pieces) and must give the same bits,
        logits and state; any difference is counted as an exact mismatch. Elsewhere the reference
        backend runs it and max |logits difference| goes to the drift histogram.
        """
        if not tokens:
            return
        labels = {"model": model.model_id, "backend": model.backend}
        if model.arithmetic().exact:
            cut = 1 + (len(tokens) - 1) // 3
            rows, st = [], state
            for piece in (tokens[:1], tokens[1:cut], tokens[cut:]):
                if piece:
                    step = model.advance(st, piece)
                    rows.append(step.logits)
                    st = step.state
            again = torch.cat(rows)
            same = torch.equal(again, logits) and all(torch.equal(st.tensors[k], served.tensors[k])
                                                       for k in served.tensors)
            diff = float((again.to(torch.float64) - logits.to(torch.float64)).abs().max())
            self.metrics.drift.record(diff, labels)
            if not same:
                self.metrics.exact_mismatches.add(1, labels)
                log.error("exact backend: %s gave other bits for a chunk of %d tokens in another partition "
                          "(max |logits difference| %.3e)", model.model_id, len(tokens), diff)
            return
        ref = model.with_backend("reference").advance(state, tokens).logits
        diff = float((logits.to(torch.float64) - ref.to(torch.float64)).abs().max())
        self.metrics.drift.record(diff, labels)
        log.debug("drift sample %s: max |logits - reference| %.3e over %d tokens", model.model_id, diff, len(tokens))

    # --- activities ---------------------------------------------------------------------------

    @activity.defn(name=ACTIVITY_OPEN, no_thread_cancel_exception=True)
    def open_stream(self, req: OpenStreamRequest) -> OpenStreamResult:
        """Bind a new stream to a model: its initial state, or a validated checkpoint to resume."""
        with self._guarded(req.stream_id, req.model_id):
            check_name("stream id", req.stream_id)
            if is_prefix_stream(req.stream_id):
                raise InvalidRequest(f"stream id {req.stream_id!r} is in the prefix store's namespace",
                                     field="stream_id")
            self._verify("open", req.stream_id, req.principal, req)
            tag = stream_tag(req.stream_id)
            if tag is not None and tag != self.keyring.principal_tag(req.principal):
                # the id names another principal than the stream is opened for: its payloads
                # would be under that principal's key
                raise PrincipalMismatch(f"stream {req.stream_id} is tagged for another principal than "
                                        f"{req.principal!r}", field="principal", expected=tag,
                                        actual=req.principal)
            model = self._model(req.model_id)
            info = self._info(model)
            if req.input_transform not in (None, info.input_transform):
                raise InputTransformMismatch(
                    f"model {req.model_id} reads {info.input_transform!r}, not {req.input_transform!r}",
                    field="input_transform", expected=info.input_transform, actual=req.input_transform)
            prefix = self._prefix_tokens(model, req)
            if prefix and req.resume is not None:
                raise InvalidRequest("a stream opens from a prefix or from a checkpoint, not both", field="prefix")
            last, origin, what = None, None, "initial"
            if prefix:
                opened = self.prefixes.state_for(model, req.principal, prefix, self._prefill(model), on_wait=_beat)
                state, last, origin = opened.state, opened.logits, opened.origin
                what = f"prefix|{origin.digest}"
            elif req.resume is not None:
                # another stream's checkpoint: everything but the stream id must match
                validate_resume(req.resume, model.identity(), req.principal)
                state, last = self._fetch(model, req.resume, req.principal, current=False)
                origin = Origin(kind="checkpoint", stream_id=req.resume.stream_id, chunk_seq=req.resume.chunk_seq,
                                epoch=req.resume.epoch, checksum=req.resume.checksum)
                what = req.resume.checksum
            else:
                state = model.initial_state()
            key = self.commits.state_key(req.stream_id, 0, 0, f"open|{what}")
            receipt = self._start_epoch(model, req.stream_id, req.principal, state, kind="open", chunk_seq=0,
                                        epoch=0, key=key, before=req.resume, last=last, origin=origin)
            # its receipt recorded beside it, as a chunk's is: what a rewind to it goes back to
            self.commits.write_record(receipt, {"kind": "open", "receipt": receipt.model_dump(mode="json")}, last)
            self._gauge()
            return OpenStreamResult(receipt=receipt, info=info, worker_queue=self.worker_queue)

    def _prefix_tokens(self, model: Model, req: OpenStreamRequest) -> list[int]:
        """An open's prefix as checked token ids ([]: none, or an empty one): refused typed before
        anything is computed or stored (a token outside the vocabulary, too many tokens)."""
        if req.prefix is None:
            return []
        if isinstance(req.prefix, str):
            if model.transform is None:
                raise InvalidRequest("this model has no input transform; send the prefix as tokens", field="prefix")
            tokens = model.transform.encode(req.prefix)
        else:
            tokens = list(req.prefix)
        if len(tokens) > req.max_prefix_tokens:
            raise ChunkTooLarge(f"the prefix's {len(tokens)} tokens exceed max_prefix_tokens {req.max_prefix_tokens}",
                                limit=req.max_prefix_tokens, actual=len(tokens))
        model.check_tokens(tokens)
        return tokens

    def _prefill(self, model: Model) -> Compute:
        """A prefix's computation, by the model's engine like any chunk (in `prefill_piece` pieces
        between the other streams' decode rounds, this thread heartbeating while it waits: a long
        prefix on a loaded worker never outlasts the heartbeat timeout), in a slot of its own that
        is freed after; only the last row of logits is kept."""
        def compute(state: State, tokens: list[int]) -> tuple[State, torch.Tensor | None, str]:
            engine = self.engine(model)
            slot = f"{PREFIX_STREAM_PREFIX}compute.{uuid.uuid4().hex}"
            _cancel_point()
            try:
                out = engine.advance(slot, tokens, expected_key=f"{slot}/start", epoch=0,
                                     load=lambda: (state, None), on_wait=_beat, keep_rows=False)
            finally:
                engine.release(slot)
            return out.state, out.last_logits, out.path
        return compute

    def _chunk_model(self, kind: str, req: AdvanceChunkRequest | GenerateChunkRequest) -> Model:
        """The prologue of a chunk (advance or generate), before any work: the request is the
        principal's (`_verify`) under the update id that names it, and the receipt is this
        stream's, of the model that serves it (returned)."""
        self._verify(kind, req.stream_id, req.principal, req.request)
        self._check_update_id(kind, req.stream_id, req.update_id, req.request)
        model = self._model(req.receipt.model_id)
        self._check(model, req.receipt, req.principal, req.stream_id)
        return model

    def _prior(self, req: AdvanceChunkRequest | GenerateChunkRequest, model: Model, digest: str
               ) -> tuple[str, Any | None]:
        """The chunk's key in the commit protocol (its stream, receipt, sequence and content
        `digest`), and the result an earlier attempt committed under it, if one did (None: this
        attempt computes it). An earlier attempt may have died before its bookkeeping: its drops
        are done again."""
        key = self.commits.chunk_key(req.stream_id, req.receipt, req.request.chunk_seq, digest)
        prior = self.commits.prior(key, req.principal)
        if prior is None:
            return key, None
        self.metrics.duplicate_chunks.add(1, {"model": model.model_id})
        self.commits.drop(req.drop_keys, stream_id=req.stream_id, principal=req.principal)
        return key, prior.result

    @activity.defn(name=ACTIVITY_ADVANCE, no_thread_cancel_exception=True)
    def advance_chunk(self, req: AdvanceChunkRequest) -> AdvanceChunkResult:
        """Advance the stream by one chunk, exactly once."""
        t0 = time.perf_counter()
        with self._guarded(req.stream_id, req.receipt.model_id):
            model = self._chunk_model("advance", req)
            ask = req.request
            if ask.text is not None:
                if model.transform is None:
                    raise InvalidRequest("this model has no input transform; send tokens")
                tokens = model.transform.encode(ask.text)
            else:
                tokens = list(ask.tokens or [])
            if len(tokens) > req.max_chunk_tokens:
                raise ChunkTooLarge(f"{len(tokens)} tokens exceed the chunk limit {req.max_chunk_tokens}",
                                    limit=req.max_chunk_tokens, actual=len(tokens))
            model.check_tokens(tokens)  # typed InvalidInput before any work
            digest = hashlib.sha256(f"advance|{ask.top_k}|".encode() + torch.tensor(tokens, dtype=torch.int64)
                                    .numpy().tobytes()).hexdigest()
            key, prior = self._prior(req, model, digest)
            if prior is not None:  # an earlier attempt finished: its result, not a second advance
                return AdvanceChunkResult(result=AdvanceResult.model_validate(prior), worker_queue=self.worker_queue)
            self._local_fits(model, 1 + len(tokens) // max(self._engine_args["prefill_piece"], 1))
            _cancel_point()
            self._edge("admitted", req.stream_id, ask.chunk_seq)
            nth = next(self._advanced)
            reference = (self._reference_input(model, req.receipt, req.principal)
                         if self.drift_check_every and nth % self.drift_check_every == 0 else None)
            out = self.engine(model).advance(
                req.stream_id, tokens, expected_key=req.receipt.state_key, epoch=req.receipt.epoch,
                load=lambda: self._fetch(model, req.receipt, req.principal), on_wait=_beat)
            state, logits, last = out.state, out.logits, out.last_logits
            labels = {"model": model.model_id, "kind": "advance"}
            self.metrics.time_to_first_output.record(time.perf_counter() - t0, labels)
            self.metrics.tokens.add(len(tokens), {"model": model.model_id, "kind": "prefill"})
            if reference is not None:
                self._drift_sample(model, reference, tokens, logits, state)
            backend = model.ran(out.path)

            def result(receipt: Receipt) -> AdvanceResult:
                return AdvanceResult(
                    stream_id=req.stream_id, chunk_seq=ask.chunk_seq, position=receipt.position,
                    n_tokens=len(tokens), receipt=receipt, top_k=_top_k(last, ask.top_k),
                    output_digest=_digest(logits), backend=backend)

            done = self._complete(model, req.stream_id, req.principal, req.receipt, ask.chunk_seq, key, state,
                                  out.path, last, result, req.drop_keys)
            self._gauge()
            return AdvanceChunkResult(result=done, worker_queue=self.worker_queue)

    @activity.defn(name=ACTIVITY_GENERATE, no_thread_cancel_exception=True)
    def generate_tokens(self, req: GenerateChunkRequest) -> GenerateChunkResult:
        """Sample tokens with a seeded generator; each one advances the state like input.

        The generation ends after `max_tokens` ("length"), after the token that completes one of
        the `stop` texts ("stop"), or after the model's end-of-sequence token
        (`Model.eos_token_ids`: "eos"), whichever comes first; a token that completes a stop
        text and is an end-of-sequence token too ends it as "stop". The token that ends it, stop
        text's or end-of-sequence, is one of the chunk's tokens: it was sampled, so it advanced
        the state like any other, and the committed position is the input's plus every token
        returned. Where the stop is decided (in this activity, between the engine's rounds) and
        what it depends on (the sampled tokens, the model) are deterministic, so a retry stops at
        the same token, and the chunk commits once.
        """
        t0 = time.perf_counter()
        with self._guarded(req.stream_id, req.receipt.model_id):
            model = self._chunk_model("generate", req)
            ask = req.request
            seed = ask.seed if ask.seed is not None else int.from_bytes(
                hashlib.sha256(f"{req.stream_id}|{ask.chunk_seq}".encode()).digest()[:8], "little") >> 1
            digest = hashlib.sha256(  # how the chunk is shown (PRESENTATION) is not what it is
                json.dumps(ask.model_dump(mode="json", exclude={"principal", *PRESENTATION}) | {"seed": seed},
                           sort_keys=True).encode()
            ).hexdigest()
            key, prior = self._prior(req, model, digest)
            if prior is not None:  # an earlier attempt finished: its result, not a second generate
                return GenerateChunkResult(result=GenerateResult.model_validate(prior), worker_queue=self.worker_queue)
            self._local_fits(model, ask.max_tokens)
            _cancel_point()
            self._edge("admitted", req.stream_id, ask.chunk_seq)
            gen = torch.Generator().manual_seed(seed)
            transform = model.transform
            live = None
            if ask.stream and activity.in_activity() and not activity.info().is_local:
                # its tokens go out as this activity's heartbeats (a local activity has none: its
                # tokens come whole, with its result)
                live = LiveTokens(TokenProgress(chunk_seq=ask.chunk_seq, epoch=req.receipt.epoch,
                                                update_id=req.update_id, offset=req.log_offset,
                                                attempt=activity.info().attempt),
                                  transform.decode if transform is not None else None)
            sampled: list[int] = []
            finish = "length"
            eos = frozenset(model.eos_token_ids)
            step_labels = {"model": model.model_id}
            last_t = t0

            def proceed() -> bool:
                nonlocal finish, last_t
                now = time.perf_counter()
                if sampled:
                    self.metrics.decode_step.record(now - last_t, step_labels)
                else:
                    self.metrics.time_to_first_output.record(now - t0, {**step_labels, "kind": "generate"})
                last_t = now
                if sampled and ask.stop and transform is not None \
                        and any(s_ and s_ in transform.decode(sampled) for s_ in ask.stop):
                    finish = "stop"
                    return False
                if sampled and sampled[-1] in eos:
                    finish = "eos"
                    return False
                return True

            def taken(tok: int) -> None:
                sampled.append(tok)
                if live is not None:
                    live.take(tok)

            # the engine samples the streams of one round together (same tokens as one by one)
            sampler = SeededSampler(ask.temperature, ask.top_k, gen, proceed=proceed, taken=taken)
            try:
                out = self.engine(model).generate(
                    req.stream_id, sampler, ask.max_tokens, expected_key=req.receipt.state_key,
                    epoch=req.receipt.epoch, load=lambda: self._fetch(model, req.receipt, req.principal),
                    on_wait=_beat if live is None else _live_wait(live), wake=live.wake if live is not None else None)
            except ValueError as exc:
                raise EmptyContext(str(exc)) from None
            tokens, state, logits, rows = out.tokens, out.state, out.last_logits, [out.logits]
            if ask.stop and transform is not None and finish == "length" and \
                    any(s_ and s_ in transform.decode(tokens) for s_ in ask.stop):
                finish = "stop"  # the last sampled token completed a stop text
            if finish == "length" and tokens and tokens[-1] in eos:
                finish = "eos"  # the last token the length allowed was the end of the sequence
            backend = model.ran(out.path)
            text = transform.decode(tokens) if transform is not None else None

            def result(receipt: Receipt) -> GenerateResult:
                return GenerateResult(
                    stream_id=req.stream_id, chunk_seq=ask.chunk_seq, position=receipt.position, tokens=tokens,
                    text=text, finish_reason=finish, receipt=receipt, output_digest=_digest(torch.cat(rows)),
                    backend=backend)

            done = self._complete(model, req.stream_id, req.principal, req.receipt, ask.chunk_seq, key, state,
                                  out.path, logits, result, req.drop_keys)
            self.metrics.tokens.add(len(tokens), {"model": model.model_id, "kind": "decode"})
            self._gauge()
            return GenerateChunkResult(result=done, worker_queue=self.worker_queue)

    @activity.defn(name=ACTIVITY_RESET, no_thread_cancel_exception=True)
    def reset_stream(self, req: ResetStreamRequest) -> StateResult:
        """A new epoch at position 0: the model's initial state, sealed for the stream."""
        with self._guarded(req.stream_id, req.receipt.model_id):
            self._verify("reset", req.stream_id, req.principal, req.request)
            if req.request is not None and req.request.epoch not in (None, req.epoch):
                raise EpochMismatch(f"the reset was signed for epoch {req.request.epoch}, not {req.epoch}",
                                    field="epoch", expected=req.epoch, actual=req.request.epoch)
            model = self._model(req.receipt.model_id)
            self._check(model, req.receipt, req.principal, req.stream_id)
            if req.epoch <= req.receipt.epoch:
                raise EpochMismatch(f"epoch {req.epoch} does not follow {req.receipt.epoch}",
                                    field="epoch", expected=req.receipt.epoch + 1, actual=req.epoch)
            key = self.commits.state_key(req.stream_id, req.epoch, req.receipt.chunk_seq, "reset|initial")
            receipt = self._start_epoch(model, req.stream_id, req.principal, model.initial_state(), kind="reset",
                                        chunk_seq=req.receipt.chunk_seq, epoch=req.epoch, key=key, before=None)
            self.commits.write_record(receipt, {"kind": "reset", "receipt": receipt.model_dump(mode="json")}, None)
            if req.request is not None and req.request.revoke:
                n = self.commits.revoke_before(req.stream_id, req.principal, req.epoch)
                log.info("reset of %s revoked %d checkpoints of the epochs before %d", req.stream_id, n, req.epoch)
            self.metrics.resets.add(1, {"model": model.model_id})
            self._gauge()
            return StateResult(receipt=receipt, worker_queue=self.worker_queue)

    @activity.defn(name=ACTIVITY_CHECKPOINT, no_thread_cancel_exception=True)
    def checkpoint_stream(self, req: CheckpointStreamRequest) -> StateResult:
        """Prove the stream's current checkpoint (or an earlier one, `state_key`: its recorded
        receipt) is in the store and authentic; return its receipt."""
        with self._guarded(req.stream_id, req.receipt.model_id):
            self._verify("checkpoint", req.stream_id, req.principal, req.request)
            model = self._model(req.receipt.model_id)
            self._check(model, req.receipt, req.principal, req.stream_id)
            if req.state_key is None:
                self.commits.fetch_current(model, req.receipt, req.principal)
                return StateResult(receipt=req.receipt, worker_queue=self.worker_queue)
            target = self._recorded(model, req.stream_id, req.principal, req.state_key)
            self.commits.fetch(model, target, req.principal)  # there, authentic, this stream's
            return StateResult(receipt=target, worker_queue=self.worker_queue)

    def _recorded(self, model: Model, stream_id: str, principal: str, state_key: str) -> Receipt:
        """The recorded receipt of one of the stream's own checkpoints, checked against the model."""
        _own_key(stream_id, state_key)
        prior = self.commits.prior(state_key, principal)
        if prior is None or "receipt" not in prior.result:
            raise RewindUnavailable(f"checkpoint {state_key} has no recorded receipt (gone, or written "
                                    f"before rewinds recorded one)", state_key=state_key)
        target = Receipt.model_validate(prior.result["receipt"])
        self._check(model, target, principal, stream_id)
        return target

    @activity.defn(name=ACTIVITY_RECALL, no_thread_cancel_exception=True)
    def recall_result(self, req: RecallResultRequest) -> RecallResultResult:
        """A committed chunk's recorded result (a repeated update id whose full result was not
        carried across continue-as-new)."""
        with self._guarded(req.stream_id):
            _own_key(req.stream_id, req.state_key)  # never another stream's record
            prior = self.commits.prior(req.state_key, req.principal)
            if prior is None:
                raise ResultExpired(f"chunk result {req.state_key} is no longer kept (its checkpoint left the window)",
                                    state_key=req.state_key)
            model = AdvanceResult if req.kind == "advance" else GenerateResult
            return RecallResultResult(**{req.kind: model.model_validate(prior.result)})

    @activity.defn(name=ACTIVITY_REWIND, no_thread_cancel_exception=True)
    def rewind_stream(self, req: RewindStreamRequest) -> StateResult:
        """The receipt of one of the stream's earlier checkpoints (its recorded receipt), checked
        to be stored and authentic: what the stream goes back to. The undone chunks' checkpoints
        (`drop_keys`) are deleted."""
        with self._guarded(req.stream_id, req.receipt.model_id):
            self._verify("rewind", req.stream_id, req.principal, req.request)
            model = self._model(req.receipt.model_id)
            self._check(model, req.receipt, req.principal, req.stream_id)
            target = self._recorded(model, req.stream_id, req.principal, req.state_key)
            self.commits.fetch_current(model, target, req.principal)  # there, authentic, this stream's
            self.commits.drop(req.drop_keys, stream_id=req.stream_id, principal=req.principal)
            log.info("stream %s rewound to chunk %d (position %d)", req.stream_id, target.chunk_seq, target.position)
            return StateResult(receipt=target, worker_queue=self.worker_queue)

    @activity.defn(name=ACTIVITY_VERIFY, no_thread_cancel_exception=True)
    def verify_request(self, req: VerifyRequest) -> VerifyRequest:
        """A request's signature, verified (no-op when requests are not signed here)."""
        with self._guarded(req.stream_id):
            self._verify(req.kind, req.stream_id, req.principal, req.request)
            return req

    # --- continue-as-new: the carry, sealed by the workers ------------------------------------

    def _carry_mac(self, stream_id: str, run_id: str, digest: str) -> str:
        return hmac.new(self._carry_key, f"{stream_id}|{run_id}|{digest}".encode(), hashlib.sha256).hexdigest()

    @activity.defn(name=ACTIVITY_SEAL_CARRY, no_thread_cancel_exception=True)
    def seal_carry(self, req: CarrySealRequest) -> CarrySeal:
        """Seal what the stream carries to its next run, for its stream and this run (the run
        that schedules it, as the server says)."""
        with self._guarded(req.stream_id):
            run_id = activity.info().workflow_run_id if activity.in_activity() else None
            if not run_id:
                raise InvalidRequest("a carry is sealed by the run that continues as new")
            return CarrySeal(run_id=run_id, mac=self._carry_mac(req.stream_id, run_id, req.digest))

    @activity.defn(name=ACTIVITY_OPEN_CARRY)
    async def open_carry(self, req: CarrySealRequest) -> CarrySeal:
        """Verify a carry before the run that received it trusts any of it: sealed by the workers,
        for this stream, by the run this one continues. Raises ForgedCarry otherwise.

        A carry with no seal at all is one a version that did not seal carries made (a versioned
        rollout continues its streams as new onto this one): it is taken when the server's
        history says the run this one continues ended by continuing as new into this very run,
        which only the workflow's own code can do."""
        with self._guarded(req.stream_id):
            seal = req.seal
            if seal is None and req.continued_run_id and await self._continued_into_this_run(req):
                return CarrySeal(run_id=req.continued_run_id, mac="")
            if seal is None or not req.continued_run_id or seal.run_id != req.continued_run_id:
                raise ForgedCarry("the start input carries a carry, but this run does not continue the run that "
                                  "sealed it", field="run_id", expected=req.continued_run_id,
                                  actual=seal.run_id if seal else None)
            if not hmac.compare_digest(seal.mac, self._carry_mac(req.stream_id, seal.run_id, req.digest)):
                raise ForgedCarry("the carry's seal does not verify: not the workers' carry of this stream",
                                  field="mac")
            return seal

    @staticmethod
    async def _continued_into_this_run(req: CarrySealRequest) -> bool:
        """Whether run `continued_run_id` of the stream ended by continuing as new into the run
        that scheduled this activity (the server's history: its close event)."""
        try:
            client = activity.client()
        except RuntimeError:  # not in a worker: nothing to ask
            return False
        handle = client.get_workflow_handle(req.stream_id, run_id=req.continued_run_id)
        async for event in handle.fetch_history_events(event_filter_type=WorkflowHistoryEventFilterType.CLOSE_EVENT):
            if event.HasField("workflow_execution_continued_as_new_event_attributes"):
                moved = event.workflow_execution_continued_as_new_event_attributes
                return moved.new_execution_run_id == activity.info().workflow_run_id
            return False
        return False

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

