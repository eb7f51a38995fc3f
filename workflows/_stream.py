"""MambaStreamWorkflow: one workflow per stream; history is the record of what was committed.

Updates (`advance`, `generate`, `checkpoint`) and the `reset` signal run one at a time, in
arrival order, behind one lock. A validator rejects a wrong principal, a wrong chunk sequence,
bad or oversized input, a chunk that conflicts with one already committed or in flight, and a
cancelled stream before anything reaches history. The update id (`workflows.update_id`: kind,
chunk sequence, epoch, content digest, attempt) is the idempotency key: the server answers a
repeated id within a run, and the workflow keeps recent results across continue-as-new to answer
it after that too, and to answer the same chunk sent under another attempt. Failures are typed by
the catalogue's classes (`workflows._failures`).

Cancellation always completes: the handlers' activities are cancelled, then the stream's blobs
and hot states are disposed of.

Sandbox-safe: the standard library, temporalio, pydantic and the record half of state_codec.
"""

from __future__ import annotations

import asyncio
import functools
from datetime import timedelta
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, FailureError
from temporalio.exceptions import TimeoutError as ActivityTimeout

with workflow.unsafe.imports_passed_through():
    from state_codec import (
        CLEAR,
        MASTER,
        ChunkSequenceMismatch,
        EpochMismatch,
        PrincipalMismatch,
        Receipt,
        SealerMismatch,
        UnsealedRequest,
        arithmetic_moved,
        parse_state_key,
        sealer_of,
        stream_tag,
    )
    from workflows._failures import (
        ActivityFailed,
        ChunkTooLarge,
        ConflictingChunk,
        EmptyContext,
        InvalidRequest,
        LocalTooSlow,
        OpenFailed,
        RewindPastWindow,
        RewindUnavailable,
        StreamCancelled,
        StreamMoving,
        StreamOpening,
        TokenOutOfRange,
        UnknownRequest,
        UpdateIdMismatch,
        application_error,
    )
    from workflows._models import (
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
        AdvanceRequest,
        AdvanceResult,
        CancelRequest,
        CarrySeal,
        CarrySealRequest,
        CheckpointRequest,
        CheckpointResult,
        CheckpointStreamRequest,
        DisposeStreamRequest,
        DisposeStreamResult,
        GenerateChunkRequest,
        GenerateChunkResult,
        GenerateRequest,
        GenerateResult,
        ModelInfo,
        OpenStreamInput,
        OpenStreamRequest,
        OpenStreamResult,
        ReadTokensRequest,
        RecallResultRequest,
        RecallResultResult,
        RecentResult,
        ResetRequest,
        ResetStreamRequest,
        RewindRequest,
        RewindResult,
        RewindStreamRequest,
        StateResult,
        StreamCarry,
        StreamStats,
        TIMEOUT_FLOORS,
        TokenBatch,
        TokenEvent,
        VerifyRequest,
        carry_digest,
        chunk_digest,
        parse_update_id,
    )
    from workflows._records import RecentResults, TokenLog

__all__ = ["MambaStreamWorkflow"]

T = TypeVar("T")

#: a history this large or this long moves the stream to a new run at once, a chunk in flight or not.
#: The server terminates a workflow at 50 MiB or 51,200 events and suggests continue-as-new at
#: 4 MiB or 4,096; every signal is written before the workflow sees it (up to 2 MiB each), and
#: continue-as-new otherwise waits for the chunk that holds the lock, which a flood of signals or
#: updates can outrun. These leave room for about 20 more of the largest payloads.
HISTORY_CRITICAL_BYTES = 8 * 1024 * 1024
HISTORY_CRITICAL_EVENTS = 10_240

#: regular activities completed with results the workers did not seal, in a row, before the call fails
FORGED_RESULTS = 5

#: how long a stream its principal cancelled (the `cancel` signal) waits for the Temporal cancel request
#: that follows it, so that its run ends cancelled; past it, the stream disposes and completes
CANCEL_GRACE_S = 10.0

#: chunks of a stream sent the regular way after one of its local attempts timed out (a loaded worker)
LOCAL_PAUSE_CHUNKS = 8
PATCH_LOCAL_PAUSE = "local-pause-after-timeout"
#: histories recorded before requests were taken by their sealer, carries sealed and bare cancel
#: requests refused replay as they ran (`workflow.patched`: false only when replaying such a history)
PATCH_SEALED = "requests-by-sealer"



def _refused_arguments(model: type, args: tuple[Any, ...]) -> ApplicationError | None:
    """Why `args` are not what a handler takes, typed `InvalidRequest` (None: they are): exactly
    one `model`. A payload that does not validate as `model` is refused by the converter already;
    this catches what it lets through: no argument, JSON null, one too many. (The SDK drops the
    arguments of a handler that takes none.)"""
    if len(args) == 1 and isinstance(args[0], model):
        return None
    got = ", ".join(type(a).__name__ for a in args) or "no argument"
    return application_error(InvalidRequest(f"the request takes one {model.__name__}, not {got}",
                                            expected=model.__name__, actual=got))


def _takes(model: type) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A validator's or a query's arguments, checked before it runs (`_refused_arguments`): a
    refused update writes nothing to history, a refused query nothing at all. The signature stays
    the handler's, so the SDK converts the payloads as before."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def checked(self: Any, *args: Any) -> T:
            refused = _refused_arguments(model, args)
            if refused is not None:
                raise refused
            return fn(self, *args)
        return checked
    return wrap


def _signal_takes(model: type, refuse: Callable[[Any, ApplicationError], None]
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A signal's arguments, decoded and checked before it runs. A signal has no caller to answer,
    and an exception in its handler would fail the workflow (a typed one) or its task (any other,
    on every retry), not the sender; and the SDK drops a signal whose payload does not convert,
    with a log line only. So the handler takes its payloads raw (the SDK converts nothing) and
    converts them here: what does not convert (not valid, under a key the workers do not hold)
    or is not exactly one `model` goes to `refuse(workflow, typed error)` instead: counted,
    recorded in the stats, nothing changed."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def checked(self: Any, *args: Any) -> None:
            try:
                values = tuple(workflow.payload_converter().from_payload(a.payload, model)
                               if isinstance(a, RawValue) else a for a in args)
            except ApplicationError as err:
                refuse(self, err)
                return
            refused = _refused_arguments(model, values)
            if refused is not None:
                refuse(self, refused)
                return
            await fn(self, *values)
        # the SDK reads the handler's hints: raw payloads, converted above
        checked.__annotations__ = {**fn.__annotations__, **{k: RawValue for k in fn.__annotations__ if k != "return"}}
        return checked
    return wrap


def _unknown(kind: str, name: str) -> ApplicationError:
    return application_error(UnknownRequest(f"the stream has no {kind} {name!r}", kind=kind, name=name))


def _init_takes(fn: Callable[..., None]) -> Callable[..., None]:
    """`__init__` of a start input that is not one OpenStreamInput (none, JSON null, one too
    many): it initializes from a placeholder and keeps the refusal, which `run` raises at once
    (`_run_takes`): the run fails typed `InvalidRequest`. An exception here would fail the first
    workflow task instead, and every retry of it: a stream that neither ran nor ended."""
    @functools.wraps(fn)
    def checked(self: Any, *args: Any) -> None:
        self._start_refused = _refused_arguments(OpenStreamInput, args)
        fn(self, *(args if self._start_refused is None else (OpenStreamInput(principal="", model_id=""),)))
    return checked


def _run_takes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`run`, which fails typed with the start input's refusal, if `__init__` kept one."""
    @functools.wraps(fn)
    async def checked(self: Any, *args: Any) -> Any:
        if self._start_refused is not None:
            raise self._start_refused
        return await fn(self, *args)
    return checked


def _arithmetic(before: Receipt | None, receipt: Receipt, stats: StreamStats) -> dict[str, Any]:
    """The stats' arithmetic fields after `receipt` (which continues `before`) is committed."""
    return {"arithmetic": receipt.arithmetic.id if receipt.arithmetic else "",
            "arithmetic_changes": stats.arithmetic_changes + int(arithmetic_moved(before, receipt))}


# Pinned by the versioned worker's default behavior (worker.deployment_config), not here: a
# behavior on the definition is refused by unversioned workers.
@workflow.defn(name="MambaStream")
class MambaStreamWorkflow:
    @workflow.init
    @_init_takes
    def __init__(self, inp: OpenStreamInput) -> None:
        self._inp = inp
        self._opts = inp.options
        self._lock = asyncio.Lock()
        self._cancelled = False
        carry = inp.carry
        # what a carry says is trusted once the workers verified it (`_verify_carry`, first in `run`):
        # until then no request is admitted, and queries show it as it came
        self._verified = carry is None
        self._receipt: Receipt | None = carry.receipt if carry else None
        self._info: ModelInfo | None = carry.info if carry else None
        self._stats = carry.stats if carry else StreamStats(
            stream_id=workflow.info().workflow_id, principal=inp.principal, model_id=inp.model_id)
        self._recent = RecentResults(self._opts.recent_results, carry.recent if carry else ())
        self._kept: list[str] = list(carry.kept) if carry else []
        self._pinned: list[str] = list(carry.pinned) if carry else []
        self._worker_queue: str | None = carry.worker_queue if carry else None
        self._in_flight: dict[int, str] = {}  # chunk_seq -> digest, of handlers started, not finished
        self._tasks: dict[asyncio.Task, bool] = {}  # handlers running activities -> whether a forced move stops them
        self._moving = False  # continuing as new before its time (`_history_critical`): chunks go to the next run
        self._cancel_by: str | None = None  # who sent a `cancel` that passed: "principal" or "operator"
        self._cancel_requested = False  # a Temporal cancel request came (bare, or after `cancel`)
        self._cancel_checks = 0  # `cancel` signals whose signature the workers are checking
        self._rewound: tuple[Receipt, int] | None = None  # a rewind's target and chunk, for the next run
        self._leaving = False  # settled what moves to the next run: continuing as new
        self._open_error: ApplicationError | None = None
        # the token log: each finished generate's tokens, for readers (`read_tokens`, a query).
        # Tokens of a generate still running reach readers as its activity's heartbeats, not
        # through here.
        self._log = TokenLog(self._opts.token_log_events, carry.token_base if carry else 0,
                             carry.token_log if carry else ())

    # --- lifecycle -------------------------------------------------------------------------------

    @workflow.run
    @_run_takes
    async def run(self, inp: OpenStreamInput) -> StreamStats:
        # the start input is the principal's (or the operator's), as its key says: a stream tagged
        # for bob that alice's client started fails here, before any activity
        self._sealed_by(inp, "open", replayable=True)
        while True:
            try:
                await self._live(inp)
                break  # cancelled by its principal or the operator (the `cancel` signal)
            except asyncio.CancelledError:
                # A Temporal cancel request carries no key: anyone who reaches the frontend can
                # send one. It ends the stream only after its principal's or the operator's
                # `cancel` (sent first: `StreamClient.cancel`); a bare one is refused, counted, and
                # the stream goes on where it was.
                self._cancel_requested = True
                # a `cancel` that came first may still be having its signature checked
                await workflow.wait_condition(lambda: not self._cancel_checks)
                if self._cancel_by is not None:
                    break
                if not workflow.patched(PATCH_SEALED):  # replaying a run that took a bare cancel
                    self._cancel_by, self._cancelled = "operator", True
                    break
                self._refuse("cancel", application_error(UnsealedRequest(
                    "a Temporal cancel request carries no key: the stream's principal or the operator sends "
                    "`cancel` first (StreamClient.cancel, `mamba-stream cancel`)")))
        return await self._end()

    async def _live(self, inp: OpenStreamInput) -> None:
        """The stream's life in this run: its carry verified, or its first state opened; then
        until it moves on (continue-as-new: raised) or its principal or the operator cancels it
        (returns). Interrupted by a refused Temporal cancel, it is entered again and goes on from
        where it was."""
        if not self._verified:
            if workflow.patched(PATCH_SEALED):
                await self._verify_carry(inp)
            else:
                self._verified = True  # replaying a run that took its carry as it came
        if self._receipt is None:
            try:
                await self._open()
            except ApplicationError as err:
                # e.g. a resume from an incompatible checkpoint: the run fails with the reason,
                # after telling whoever waits in `ready`
                self._open_error = err
                await workflow.wait_condition(workflow.all_handlers_finished)
                raise
        if not self._leaving:
            await self._until_it_moves()
            if self._cancel_by is not None:
                return
        moving = self._version_changed()
        while True:
            carry = self._carry()
            seal = await self._seal_carry(carry)
            if self._cancel_by is not None:
                return
            if workflow.all_handlers_finished():
                break
            # a signal came while the carry was sealed (a reset): it goes in the carry too
            await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            self._inp.model_copy(update={"resume": None, "carry": carry, "carry_seal": seal}),
            initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE if moving else None)

    async def _until_it_moves(self) -> None:
        """Wait for the stream to move to a new run (or to be cancelled: `_cancel_by`), then settle
        what moves with it (`_leaving`: entered again after a refused cancel, `_live` goes on to
        the move at once)."""
        # Pinned to the worker deployment version it started on; it moves (continue-as-new
        # onto the current version) at a chunk boundary once that version changes, or when
        # its history is long, or after a rewind. The next chunk's activity validates the carried
        # receipt against the new workers' model: another revision or schema is refused, typed.
        await workflow.wait_condition(
            lambda: self._cancel_by is not None or self._rewound is not None or
            ((workflow.info().is_continue_as_new_suggested() or self._version_changed())
             and not self._lock.locked()) or self._history_critical())
        if self._cancel_by is not None:
            return
        if self._lock.locked() and self._rewound is None:
            # the history nears the server's limits while a chunk holds the lock: waiting for
            # it could end the stream (terminated), so the chunk is stopped uncommitted and its
            # caller sends it again to the next run (StreamMoving); a reset signal, which
            # nobody would send again, is let finish
            self._moving = True
            self._stats = self._stats.model_copy(update={"forced_moves": self._stats.forced_moves + 1})
            workflow.logger.warning("history at %d events, %d bytes: moving to a new run now",
                                    workflow.info().get_current_history_length(),
                                    workflow.info().get_current_history_size())
            for task, movable in list(self._tasks.items()):
                if movable:
                    task.cancel()
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._cancel_by is not None:
            return
        self._moving = True  # from here the stream takes nothing more in this run
        if self._rewound is not None:
            self._rewind_line()
        self._stats = self._stats.model_copy(update={
            "continued_as_new": self._stats.continued_as_new + 1,
            "version_moves": self._stats.version_moves + int(self._version_changed())})
        self._leaving = True

    async def _end(self) -> StreamStats:
        """The stream's principal or the operator cancelled it: no further advancement
        (validators refuse from now on), admitted work is stopped, then the stream's blobs and hot
        states are destroyed. The run ends cancelled when a Temporal cancel request came (the one
        `StreamClient.cancel` sends after the signal; it is waited for a moment), else completed,
        its stats saying who cancelled it."""
        if not self._cancel_requested:
            try:
                await workflow.wait_condition(lambda: False, timeout=timedelta(seconds=CANCEL_GRACE_S))
            except asyncio.TimeoutError:
                pass
            except asyncio.CancelledError:
                self._cancel_requested = True
        self._cancelled = True
        self._stats = self._stats.model_copy(update={"cancelled": True, "cancelled_by": self._cancel_by or ""})
        for task in list(self._tasks):  # a handler stuck in a retrying activity must not hold up the end
            task.cancel()
        while True:  # the Temporal cancel request may come in the middle: it changes nothing here
            try:
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._dispose()
                break
            except asyncio.CancelledError:
                self._cancel_requested = True
        if self._cancel_requested:
            raise asyncio.CancelledError()
        return self._stats

    async def _dispose(self) -> None:
        """The cancel's last step: the stream's blobs deleted, its hot states zeroed.

        First on the worker that holds the hot states (one attempt: it zeroes them before it
        touches the store), then on any worker until it passes. A cancel has no caller to send it
        again, so nothing the store does may end it: the activity reports every store fault as
        retryable (a read-only or unreachable store, a permission an operator restores), and the
        attempts are not bounded by `retry_max_attempts` (a client's choice for its chunks).
        Waiting costs no history: Temporal retries an activity without new events. Should the
        dispose still fail for good (an unforeseen error, typed `InternalError`), the run ends
        cancelled all the same, as a cancel does, and the orphan sweep deletes what is left."""
        o, req = self._opts, DisposeStreamRequest(stream_id=self._stream_id)
        common: dict[str, Any] = dict(start_to_close_timeout=timedelta(seconds=o.activity_timeout_s),
                                      heartbeat_timeout=timedelta(seconds=o.heartbeat_timeout_s),
                                      result_type=RawValue)
        if o.affinity and self._worker_queue:
            try:
                await _converted(DisposeStreamResult, self._mine, workflow.execute_activity(
                    ACTIVITY_DISPOSE, req, task_queue=self._worker_queue,
                    schedule_to_start_timeout=timedelta(seconds=o.schedule_to_start_s),
                    retry_policy=RetryPolicy(maximum_attempts=1), **common))
                return
            except (ActivityError, _Unconverted) as err:
                workflow.logger.warning("dispose on %s failed (%s); any worker disposes",
                                        self._worker_queue, getattr(err, "cause", None) or err)
        for _ in range(FORGED_RESULTS):
            try:
                out = await _converted(DisposeStreamResult, self._mine, workflow.execute_activity(
                    ACTIVITY_DISPOSE, req, retry_policy=_retry(0), **common))
                if sealer_of(out) == self._mine:
                    return
            except _Unconverted:
                pass
            except ActivityError as err:
                workflow.logger.error("dispose of %s failed for good (%s); the orphan sweep deletes what is left",
                                      self._stream_id, err.cause or err)
                return
            # an outcome the workers did not seal (the activity completed by its id): run it again
            self._stats = self._stats.model_copy(update={"forged_results": self._stats.forged_results + 1})
        workflow.logger.error("dispose of %s ended %d times with outcomes the workers did not seal; the orphan "
                              "sweep deletes what is left", self._stream_id, FORGED_RESULTS)

    async def _open(self) -> None:
        inp = self._inp
        # the options' timeouts were checked where the input was decoded; the workflow task timeout
        # is the start request's own (a raw client may set it apart from the options)
        floor, given = TIMEOUT_FLOORS["task_timeout_s"], workflow.info().task_timeout
        if given is not None and given.total_seconds() < floor:
            raise application_error(InvalidRequest(
                f"the start request's task_timeout (the workflow task timeout) {given.total_seconds():g} s is "
                f"under its floor {floor:g} s",
                field="task_timeout", floor=floor, actual=given.total_seconds()))
        res = await self._call(
            ACTIVITY_OPEN,
            OpenStreamRequest(stream_id=self._stream_id, principal=inp.principal, model_id=inp.model_id,
                              input_transform=inp.input_transform, resume=inp.resume, signature=inp.signature),
            OpenStreamResult, affine=False)
        self._receipt, self._info = res.receipt, res.info
        self._bind(res.worker_queue)
        self._kept = [res.receipt.state_key]
        self._stats = self._stats.model_copy(update={"position": res.receipt.position,
                                                     "last_backend": res.receipt.backend,
                                                     **_arithmetic(None, res.receipt, self._stats)})

    @property
    def _mine(self) -> str:
        """Who seals this stream's payloads: the tag of the principal its id names (the workers
        encode for the stream under that principal's history key), or the master key's."""
        tag = stream_tag(self._stream_id)
        return tag if tag is not None else MASTER

    @property
    def _open_now(self) -> bool:
        """The stream has a receipt it may trust: opened, or carried over and verified."""
        return self._receipt is not None and self._verified

    async def _verify_carry(self, inp: OpenStreamInput) -> None:
        """The carry is the workers' own, sealed by the run this one continues (`seal_carry`),
        or the run fails `ForgedCarry` before anything of it is used: a client can start a
        stream with any input, a carry included."""
        assert inp.carry is not None
        await self._quick(ACTIVITY_OPEN_CARRY, CarrySealRequest(
            stream_id=self._stream_id, digest=carry_digest(inp.carry), seal=inp.carry_seal,
            continued_run_id=workflow.info().continued_run_id), CarrySeal)
        self._verified = True

    async def _seal_carry(self, carry: StreamCarry) -> CarrySeal | None:
        """The workers' seal on what this run carries to the next (None: replaying a run that
        continued as new before carries were sealed)."""
        if not workflow.patched(PATCH_SEALED):
            return None
        return await self._quick(ACTIVITY_SEAL_CARRY, CarrySealRequest(
            stream_id=self._stream_id, digest=carry_digest(carry)), CarrySeal)

    async def _quick(self, name: str, req: Any, result_type: type[T]) -> T:
        """A short activity of the stream's own bookkeeping (a carry sealed or verified, a
        request's signature checked): on this worker when chunks run locally (where the stream's
        workflow is, with no task queue in between), else on the shared queue; its refusal is
        raised typed."""
        timeout = timedelta(seconds=self._opts.local_deadline_s if self._opts.local_chunks
                            else self._opts.activity_timeout_s)
        try:
            if self._opts.local_chunks:
                return await workflow.execute_local_activity(
                    name, req, result_type=result_type, start_to_close_timeout=timeout, retry_policy=_retry(0))
            return await workflow.execute_activity(name, req, result_type=result_type,
                                                   start_to_close_timeout=timeout, retry_policy=_retry(0))
        except FailureError as err:
            cause = err.cause if isinstance(err, ActivityError) else err
            raise self._failed(cause) or err from err

    @staticmethod
    def _history_critical() -> bool:
        info = workflow.info()
        return info.get_current_history_size() >= HISTORY_CRITICAL_BYTES or \
            info.get_current_history_length() >= HISTORY_CRITICAL_EVENTS

    def _interrupted(self, what: str) -> ApplicationError:
        """A handler's activity was cancelled under it: by the stream's cancel, or a forced move."""
        if self._moving and not self._cancelled:
            return application_error(StreamMoving(f"the stream moved to a new run while {what}; send it again"))
        return application_error(StreamCancelled(f"the stream was cancelled while {what}"))

    @staticmethod
    def _version_changed() -> bool:
        return workflow.info().is_target_worker_deployment_version_changed()

    def _carry(self) -> StreamCarry:
        """What crosses continue-as-new, bounded by bytes: the newest results in full while they fit
        `carry_bytes`, older ones (up to `recent_results` in all) as digests, answered from the
        store's records, while those fit another `carry_bytes`: at most twice `carry_bytes` of
        results whatever the chunks' sizes."""
        assert self._receipt is not None and self._info is not None
        log, base = self._log.carried(self._opts.carry_bytes // 4)
        return StreamCarry(receipt=self._receipt, info=self._info, stats=self._stats,
                           recent=self._recent.carried(self._opts.carry_bytes), kept=self._kept, pinned=self._pinned,
                           worker_queue=self._worker_queue, token_log=log, token_base=base)

    @property
    def _stream_id(self) -> str:
        return workflow.info().workflow_id

    # --- activities, with affinity ---------------------------------------------------------------

    def _bind(self, queue: str | None) -> None:
        if self._opts.affinity and queue:
            self._worker_queue = queue

    async def _call(self, name: str, arg: Any, result_type: type[T], *, affine: bool = True) -> T:
        """A regular activity (`_attempt`), its outcome taken only when the workers sealed it:
        anyone who reaches the frontend can complete or fail a running activity by its id, with a
        result or failure of their own. Such an outcome is dropped and the activity run again,
        which the commit protocol makes harmless (a chunk's second run returns its first result)."""
        for _ in range(FORGED_RESULTS):
            try:
                out = await self._attempt(name, arg, result_type, affine=affine)
            except _Unconverted as err:  # a result that does not even convert is no worker's
                sealer: str | None = f"unconverted ({err.args[0]})"
            else:
                sealer = sealer_of(out)
                if sealer == self._mine:
                    return out
            self._stats = self._stats.model_copy(update={"forged_results": self._stats.forged_results + 1})
            workflow.logger.warning("activity %s completed with a result the workers did not seal (sealer %s): "
                                    "dropped, run again", name, sealer)
        raise application_error(ActivityFailed(f"activity {name} ended {FORGED_RESULTS} times with outcomes the "
                                               f"workers did not seal"))

    async def _attempt(self, name: str, arg: Any, result_type: type[T], *, affine: bool = True) -> T:
        o = self._opts
        common: dict[str, Any] = dict(
            start_to_close_timeout=timedelta(seconds=o.activity_timeout_s),
            heartbeat_timeout=timedelta(seconds=o.heartbeat_timeout_s),
            # taken raw and converted here (`_converted`): a result the SDK failed to convert
            # would fail the workflow task itself, again on every retry
            result_type=RawValue,
        )
        try:
            if affine and o.affinity and self._worker_queue:
                try:
                    return await _converted(result_type, self._mine, workflow.execute_activity(
                        name, arg, task_queue=self._worker_queue,
                        schedule_to_start_timeout=timedelta(seconds=o.schedule_to_start_s),
                        retry_policy=RetryPolicy(maximum_attempts=1), **common))
                except ActivityError as err:
                    # an activity the stream's cancellation cancelled is not retried elsewhere; any
                    # other failure of the affine worker (gone, failing) is, dispose included
                    if self._final(err.cause):
                        raise
                    # the worker holding the hot state is gone or failing: any worker resumes
                    # from the store
                    workflow.logger.warning("activity %s on %s failed (%s); rebinding to the shared queue",
                                            name, self._worker_queue, err.cause or err)
                    self._worker_queue = None
                    self._stats = self._stats.model_copy(update={"migrations": self._stats.migrations + 1})
            return await _converted(result_type, self._mine, workflow.execute_activity(
                name, arg, retry_policy=_retry(o.retry_max_attempts), **common))
        except ActivityError as err:
            raise self._failed(err.cause) or err from err

    def _final(self, cause: BaseException | None) -> bool:
        """A failure no other path may retry: the chunk's own (non-retryable), or a cancellation by
        the stream's own cancel or a forced move."""
        return (isinstance(cause, ApplicationError) and cause.non_retryable) or \
            ((self._cancelled or self._moving) and isinstance(cause, CancelledError))

    def _failed(self, cause: BaseException | None) -> BaseException | None:
        """An activity's final failure as the handler's, typed by the activity's reason and
        non-retryable; None if `cause` is not final (the chunk may be tried another way)."""
        if (self._cancelled or self._moving) and isinstance(cause, CancelledError):
            return self._interrupted("the activity ran")
        if isinstance(cause, ApplicationError):
            details = list(cause.details) if cause.details else []
            return ApplicationError(cause.message, *details, type=cause.type or ActivityFailed.reason,
                                    non_retryable=True)
        return None

    async def _run_chunk(self, name: str, arg: Any, result_type: type[T], size: int, chunk_seq: int, *,
                         local: bool = True) -> T:
        """A chunk's activity: local when it is short (it runs on this worker, which holds the
        stream's hot state, with no task queue in between), else, or when the local attempt fails
        for a reason that is not the chunk's own, the regular path (`_call`). Either way the
        commit protocol makes it exactly once: a local activity re-runs on replay if the worker
        died before its workflow task completed, and finds the chunk's record.

        Which path a chunk takes is a function of history alone: the options, the chunk's size,
        and the recorded outcomes of earlier local attempts (a local attempt that timed out sends
        the stream's next `LOCAL_PAUSE_CHUNKS` chunks the regular way, `StreamStats.regular_until`).
        A local attempt's deadline counts from when it is scheduled (`schedule_to_close`), so one
        that waits for a free slot on a loaded worker cannot hold its workflow task open past half
        the task timeout (`StreamOptions.local_deadline_s`): the SDK does not have to keep the task
        alive with heartbeat tasks while it runs."""
        o = self._opts
        if local and o.local_chunks and size <= o.local_max_tokens and chunk_seq > self._stats.regular_until:
            timeout = timedelta(seconds=o.local_deadline_s)
            try:
                out = await workflow.execute_local_activity(
                    name, arg, result_type=result_type, schedule_to_close_timeout=timeout,
                    start_to_close_timeout=timeout, retry_policy=RetryPolicy(maximum_attempts=1))
                self._stats = self._stats.model_copy(update={"local_chunks": self._stats.local_chunks + 1})
                return out
            except FailureError as err:
                # The SDK hands a local activity's failure over in two shapes: live, a timeout
                # arrives wrapped (ActivityError, cause TimeoutError); replayed from its marker, bare
                # (TimeoutError). Both must lead to the same decision, or a replay takes another
                # path than the history it replays (a nondeterminism error). Every failure of
                # Temporal's is a FailureError; the builtin TimeoutError is not one.
                cause = err.cause if isinstance(err, ActivityError) else err
                if self._final(cause):
                    raise self._failed(cause) or err from err
                update: dict[str, Any] = {"local_fallbacks": self._stats.local_fallbacks + 1}
                if isinstance(cause, ApplicationError) and cause.type == LocalTooSlow.reason:
                    workflow.logger.info("local %s declined (%s); taking the regular path", name, cause)
                else:
                    workflow.logger.warning("local %s failed (%s); taking the regular path", name, cause)
                    if isinstance(cause, ActivityTimeout) and workflow.patched(PATCH_LOCAL_PAUSE):
                        # the worker is too loaded for local attempts to fit: stop trying for a while
                        # (patched: a history recorded before this rule replays without it)
                        update["regular_until"] = chunk_seq + LOCAL_PAUSE_CHUNKS
                self._stats = self._stats.model_copy(update=update)
        return await self._call(name, arg, result_type)

    async def _cancellable(self, work: Any, *, movable: bool = True) -> Any:
        """Await a handler's activity; the stream's cancellation cancels it, and a forced move does
        when `movable` (`run`)."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks[task] = movable
        try:
            return await work
        finally:
            if task is not None:
                self._tasks.pop(task, None)

    # --- admission (validators: no side effects) --------------------------------------------------

    def _check_chunk(self, kind: str, req: AdvanceRequest | GenerateRequest) -> None:
        """Refuse what cannot be this stream's next chunk, or the same chunk again (a duplicate passes:
        its handler answers it with the first result)."""
        self._taking()
        if not self._open_now:
            # Refused, not failed: a refused update is not stored, so the same id can come again.
            raise application_error(StreamOpening("the stream is still opening; try again"))
        seq, digest = req.chunk_seq, chunk_digest(kind, req)
        info = workflow.current_update_info()
        named = parse_update_id(info.id) if info is not None else None
        if named is not None:
            # the id's content digest is keyed (`workflows.update_id`): the workers check it, here
            # the kind and the chunk
            if (named[0], named[1]) != (kind, seq):
                raise application_error(UpdateIdMismatch(f"update id {info.id!r} does not name this {kind} of chunk {seq}",
                                               update_id=info.id))
            if named[2] != self._receipt.epoch:
                # refused, not stored: the client asks for the epoch and sends the chunk again
                raise application_error(EpochMismatch(f"update id {info.id!r} is for epoch {named[2]}; the stream is at "
                                            f"epoch {self._receipt.epoch}", field="epoch",
                                            expected=self._receipt.epoch, actual=named[2]))
        other = self._in_flight.get(seq)
        if other is None and seq <= self._stats.chunk_seq:
            known = self._recent.by_seq(seq)
            other = known.digest if known is not None else None
            if other is None:
                raise application_error(ChunkSequenceMismatch(f"chunk_seq {seq} is already committed", field="chunk_seq",
                                                    expected=self._next_seq(), actual=seq))
        if other is not None:
            if other != digest:
                raise application_error(ConflictingChunk(f"chunk {seq} is already {'in flight' if seq in self._in_flight else 'committed'} "
                                               f"with other content", chunk_seq=seq))
            return  # the same chunk again: its handler answers it
        expected = self._next_seq()
        if seq != expected:
            raise application_error(ChunkSequenceMismatch(f"chunk_seq {seq} is not the next one ({expected})",
                                                field="chunk_seq", expected=expected, actual=seq))

    def _taking(self) -> None:
        """A validator's first refusals: a cancelled stream takes nothing more, and one moving to a
        new run refuses without storing (the same update id goes to the next run)."""
        if self._cancelled:
            raise application_error(StreamCancelled("the stream is cancelled"))
        if self._moving:
            raise application_error(StreamMoving("the stream is moving to a new run; send it again"))

    def _next_seq(self) -> int:
        return max(self._stats.chunk_seq, *self._in_flight) + 1 if self._in_flight else self._stats.chunk_seq + 1

    def _known(self) -> RecentResult | None:
        """The recent result of the current update's id, if it has one (a carry's only once verified)."""
        info = workflow.current_update_info()
        return self._recent.by_id(info.id) if info is not None and self._verified else None

    @workflow.update
    async def advance(self, req: AdvanceRequest) -> AdvanceResult:
        """Feed a chunk (tokens or text); returns the new receipt and an output summary."""
        return await self._chunk(req, "advance", ACTIVITY_ADVANCE, AdvanceChunkResult, lambda: AdvanceChunkRequest(
            stream_id=self._stream_id, principal=req.principal, receipt=self._receipt, request=req,
            max_chunk_tokens=self._opts.max_chunk_tokens, drop_keys=self._to_drop(),
            update_id=_current_update_id()))

    @advance.validator
    @_takes(AdvanceRequest)
    def _validate_advance(self, req: AdvanceRequest) -> None:
        self._sealed_by(req, "advance")
        if self._known() is not None:
            return
        self._check_chunk("advance", req)
        o = self._opts
        if req.tokens is not None:
            if len(req.tokens) > o.max_chunk_tokens:
                raise application_error(ChunkTooLarge(f"{len(req.tokens)} tokens exceed the chunk limit {o.max_chunk_tokens}",
                                            limit=o.max_chunk_tokens, actual=len(req.tokens)))
            vocab = self._info.vocab_size if self._info else None
            bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise application_error(TokenOutOfRange(f"token {bad[0]} is outside [0, {vocab})", value=bad[0]))
        elif req.text is not None and len(req.text.encode("utf-8")) > o.max_text_bytes:
            raise application_error(ChunkTooLarge(f"text exceeds {o.max_text_bytes} bytes", limit=o.max_text_bytes))

    @workflow.update
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Sample up to max_tokens (seeded); the generated tokens advance the state like input."""
        return await self._chunk(req, "generate", ACTIVITY_GENERATE, GenerateChunkResult, lambda: GenerateChunkRequest(
            stream_id=self._stream_id, principal=req.principal, receipt=self._receipt, request=req,
            drop_keys=self._to_drop(), update_id=_current_update_id(), log_offset=self._log.end))

    @generate.validator
    @_takes(GenerateRequest)
    def _validate_generate(self, req: GenerateRequest) -> None:
        self._sealed_by(req, "generate")
        if self._known() is not None:
            return
        self._check_chunk("generate", req)
        if req.max_tokens > self._opts.max_generate_tokens:
            raise application_error(ChunkTooLarge(f"max_tokens {req.max_tokens} exceeds {self._opts.max_generate_tokens}",
                                        limit=self._opts.max_generate_tokens, actual=req.max_tokens))
        if self._receipt is not None and self._receipt.position == 0 and self._recent.by_seq(req.chunk_seq) is None:
            raise application_error(EmptyContext("nothing to continue from: feed a prompt before generating"))

    @workflow.update
    async def checkpoint(self, req: CheckpointRequest) -> CheckpointResult:
        """A portable receipt: verified in the store, kept until the stream is cancelled."""
        async with self._lock:
            await workflow.wait_condition(lambda: self._open_now)
            if self._cancelled or self._moving:
                raise self._interrupted("the checkpoint waited")
            try:
                out = await self._cancellable(self._call(ACTIVITY_CHECKPOINT, CheckpointStreamRequest(
                    stream_id=self._stream_id, principal=req.principal, receipt=self._receipt, request=req),
                    StateResult))
            except asyncio.CancelledError:
                raise self._interrupted("the checkpoint ran") from None
            if out.receipt.state_key not in self._pinned:
                self._pinned.append(out.receipt.state_key)
            return CheckpointResult(stream_id=self._stream_id, receipt=out.receipt)

    @checkpoint.validator
    @_takes(CheckpointRequest)
    def _validate_checkpoint(self, req: CheckpointRequest) -> None:
        self._sealed_by(req, "checkpoint")
        self._taking()

    @workflow.signal
    @_signal_takes(ResetRequest, lambda wf, err: wf._refuse("reset", err))
    async def reset(self, req: ResetRequest) -> None:
        """New epoch at position 0: by the stream's principal, or the operator (the workers' key).
        Anything else (sealed by another key or by none, naming another principal, for another
        epoch, a missing or invalid argument, a bad signature) changes nothing: it is counted
        (`rejected_resets`), the stats say why (`last_refusal`), and the workers' metric
        `mamba_stream_refused_requests` counts it."""
        try:
            who = self._sealed_by(req, "reset", replayable=True)
        except ApplicationError as err:
            self._refuse("reset", err)
            return
        if self._cancelled:
            self._refuse("reset", application_error(StreamCancelled("the stream is cancelled")))
            return
        async with self._lock:
            await workflow.wait_condition(lambda: self._open_now)
            assert self._receipt is not None
            if req.epoch is not None and req.epoch != self._receipt.epoch + 1:
                # a reset meant for another epoch: a replayed or stale signal resets nothing
                self._refuse("reset", application_error(EpochMismatch(
                    f"the reset is for epoch {req.epoch}; the stream is at epoch {self._receipt.epoch}",
                    field="epoch", expected=self._receipt.epoch + 1, actual=req.epoch)))
                return
            try:
                out = await self._cancellable(self._call(ACTIVITY_RESET, ResetStreamRequest(
                    stream_id=self._stream_id, principal=req.principal, receipt=self._receipt,
                    epoch=self._receipt.epoch + 1, request=req), StateResult), movable=False)
            except asyncio.CancelledError:
                return  # the stream is being cancelled: nothing to reset
            except ApplicationError as err:
                # a signal has no caller to fail: refused (e.g. a bad signature), counted, nothing changed
                self._refuse("reset", err)
                return
            self._receipt = out.receipt
            self._bind(out.worker_queue)
            if req.revoke:  # the worker deleted every checkpoint of the earlier epochs
                self._kept, self._pinned = [], []
            self._kept.append(out.receipt.state_key)
            self._stats = self._stats.model_copy(update={
                "position": 0, "epoch": out.receipt.epoch, "resets": self._stats.resets + 1,
                "operator_resets": self._stats.operator_resets + int(who == "operator"),
                "last_backend": out.receipt.backend, **_arithmetic(None, out.receipt, self._stats)})

    @workflow.signal
    @_signal_takes(CancelRequest, lambda wf, err: wf._refuse("cancel", err))
    async def cancel(self, req: CancelRequest) -> None:
        """End the stream and destroy its state: by its principal, or the operator. The workers
        check the request's signature first (where they verify signatures); then validators
        refuse new work, admitted work is stopped, and the stream disposes (`_end`). Anything
        else is refused as `reset` refusals are: counted (`refused_cancels`), `last_refusal`."""
        try:
            who = self._sealed_by(req, "cancel", replayable=True)
        except ApplicationError as err:
            self._refuse("cancel", err)
            return
        if self._cancel_by is not None:
            return  # already cancelled
        self._cancel_checks += 1
        try:
            await self._quick(ACTIVITY_VERIFY, VerifyRequest(stream_id=self._stream_id, principal=req.principal,
                                                             kind="cancel", request=req), VerifyRequest)
        except ApplicationError as err:
            self._refuse("cancel", err)
            return
        finally:
            self._cancel_checks -= 1
        if self._cancel_by is None:
            self._cancel_by = who
            self._cancelled = True  # validators refuse from now on; `_end` stops what was admitted

    @workflow.update
    async def rewind(self, req: RewindRequest) -> RewindResult:
        """Go back to just after chunk `to_seq` (0: the opened state), by the stream's principal or
        the operator: the stream continues, in a new run, from that chunk's checkpoint, with the
        same outputs and checksum as a fresh stream fed the same tokens. Any chunk of the rewind
        window (`rewind_window`: the line's newest `checkpoints_kept` checkpoints) can be reached,
        and after a rewind any of the new window's; the undone chunks' checkpoints are deleted."""
        async with self._lock:
            await workflow.wait_condition(lambda: self._open_now)
            if self._cancelled or self._moving:
                raise self._interrupted("the rewind waited")
            assert self._receipt is not None
            key, index = self._rewind_target(req.to_seq)
            undone = [k for k in self._kept[index + 1:] if k not in self._pinned]
            try:
                out = await self._cancellable(self._call(ACTIVITY_REWIND, RewindStreamRequest(
                    stream_id=self._stream_id, principal=req.principal, receipt=self._receipt, state_key=key,
                    drop_keys=undone, request=req), StateResult))
            except asyncio.CancelledError:
                raise self._interrupted("the rewind ran") from None
            # the undone line is gone from the store: the stream takes no more chunks in this run
            # (StreamMoving: they are sent again to the next, which continues from here)
            self._rewound = (out.receipt, index)
            self._moving = True
            return RewindResult(stream_id=self._stream_id, chunk_seq=req.to_seq, position=out.receipt.position,
                                receipt=out.receipt)

    @rewind.validator
    @_takes(RewindRequest)
    def _validate_rewind(self, req: RewindRequest) -> None:
        self._sealed_by(req, "rewind")
        self._taking()
        if not self._open_now:
            raise application_error(StreamOpening("the stream is still opening; try again"))
        self._rewind_target(req.to_seq)

    def _rewind_target(self, to_seq: int) -> tuple[str, int]:
        """The checkpoint a rewind to `to_seq` goes back to (the first of the window committed at
        that chunk: the chunk's own, before any reset at it) and its index in the line."""
        if to_seq > self._stats.chunk_seq:
            raise application_error(RewindUnavailable(f"chunk {to_seq} is not committed (the stream is at chunk "
                                                      f"{self._stats.chunk_seq})", chunk_seq=to_seq))
        window = self._kept[-self._opts.checkpoints_kept:]
        for key in window:
            parsed = parse_state_key(key)
            if parsed is not None and parsed.chunk_seq == to_seq:
                return key, self._kept.index(key)
        raise application_error(RewindPastWindow(
            f"chunk {to_seq} is outside the stream's rewind window (its newest {len(window)} checkpoints); "
            f"nothing was rewound", chunk_seq=to_seq, window=len(window)))

    def _rewind_line(self) -> None:
        """The bookkeeping of the line a rewind went back to, for the next run: its receipt, its
        stored checkpoints up to the target, the results of its chunks up to it."""
        assert self._rewound is not None
        receipt, index = self._rewound
        self._kept = self._kept[: index + 1]
        self._recent.up_to(receipt.epoch, receipt.chunk_seq)
        self._receipt = receipt
        self._stats = self._stats.model_copy(update={
            "position": receipt.position, "chunk_seq": receipt.chunk_seq, "epoch": receipt.epoch,
            "rewinds": self._stats.rewinds + 1, "last_backend": receipt.backend,
            "arithmetic": receipt.arithmetic.id if receipt.arithmetic else ""})
        self._rewound = None

    def _sealed_by(self, req: Any, what: str, *, replayable: bool = False) -> str:
        """Who sent `req`, by the key that sealed it (`state_codec.sealer_of`): "principal" (the
        stream's principal's history key; on a stream whose id names no principal, the workers'
        key) or "operator" (the workers' key, on a stream whose id names a principal: the codec
        server's operator token, say). Refused typed otherwise: `UnsealedRequest` (in clear),
        `SealerMismatch` (another principal's key). The body's `principal` must name the stream's
        principal either way (`PrincipalMismatch`). `replayable`: a signal's or the start input's
        check, which a history recorded before requests were taken by their sealer replays."""
        sealer, mine = sealer_of(req), self._mine
        if replayable and sealer != mine and not workflow.patched(PATCH_SEALED):
            # replaying a run that took what it was sent by what it said (a signal, a start input:
            # they replay; an update's validator does not, and may not mark history)
            sealer = mine
        if sealer is None or sealer == CLEAR:
            raise application_error(UnsealedRequest(
                f"the {what} request is not encrypted: only the stream's principal or the operator may send it",
                field="sealer", expected=mine, actual=sealer))
        if sealer == mine:
            who = "principal"
        elif sealer == MASTER:
            who = "operator"
        else:
            raise application_error(SealerMismatch(
                f"the {what} request is sealed under another principal's key: only the stream's principal or the "
                f"operator may send it", field="sealer", expected=mine, actual=sealer))
        if req.principal != self._inp.principal:
            raise application_error(PrincipalMismatch(f"principal {req.principal!r} does not own this stream",
                                                      field="principal", expected=self._inp.principal,
                                                      actual=req.principal))
        return who

    def _refuse(self, kind: str, err: ApplicationError) -> None:
        """A signal refused (it has no caller to tell): counted, its reason in the stats, logged,
        and counted by the workers' metric."""
        reason = err.type or InvalidRequest.reason
        update: dict[str, Any] = {"last_refusal": f"{kind}: {reason}: {err.message}"[:512]}
        if kind == "reset":
            update["rejected_resets"] = self._stats.rejected_resets + 1
        elif kind == "cancel":
            update["refused_cancels"] = self._stats.refused_cancels + 1
        self._stats = self._stats.model_copy(update=update)
        workflow.logger.warning("%s refused: %s (%s)", kind, err.message, reason)
        workflow.metric_meter().create_counter(
            "mamba_stream_refused_requests", "requests a stream refused that had no caller to tell").add(
            1, {"kind": kind, "reason": reason})

    # --- requests of no known name: refused typed, and a signal counted ---------------------------

    @workflow.update(dynamic=True)
    async def _unknown_update(self, name: str, args: Sequence[RawValue]) -> None:
        raise _unknown("update", name)  # never reached: the validator refuses

    @_unknown_update.validator
    def _refuse_unknown_update(self, name: str, args: Sequence[RawValue]) -> None:
        # refused by the validator: nothing reaches history
        raise _unknown("update", name)

    @workflow.signal(dynamic=True)
    def _unknown_signal(self, name: str, args: Sequence[RawValue]) -> None:
        # counted and dropped: without a handler the SDK would buffer it for the run's lifetime
        self._stats = self._stats.model_copy(update={"unknown_signals": self._stats.unknown_signals + 1})
        workflow.logger.warning("signal %r refused: the stream has no such signal", name)

    @workflow.query(dynamic=True)
    def _unknown_query(self, name: str, args: Sequence[RawValue]) -> None:
        raise _unknown("query", name)

    @workflow.update
    async def ready(self) -> Receipt:
        """Returns once the stream is open (its first receipt exists)."""
        await workflow.wait_condition(
            lambda: self._open_now or self._cancelled or self._open_error is not None)
        if self._open_error is not None:
            err = self._open_error
            raise ApplicationError(err.message, *(list(err.details) if err.details else []),
                                   type=err.type or OpenFailed.reason, non_retryable=True)
        if self._receipt is None:
            raise application_error(StreamCancelled("the stream was cancelled before it opened"))
        return self._receipt

    @workflow.query
    def receipt(self) -> Receipt | None:
        return self._receipt

    @workflow.query
    def stats(self) -> StreamStats:
        return self._stats

    @workflow.query
    def rewind_window(self) -> list[str]:
        """The state keys a rewind may go back to, oldest first: the line's newest
        `checkpoints_kept` checkpoints (`StreamClient.rewind` refuses any other before it resets)."""
        return self._kept[-self._opts.checkpoints_kept :]

    # --- the token log ---------------------------------------------------------------------------

    @workflow.query
    @_takes(ReadTokensRequest)
    def read_tokens(self, req: ReadTokensRequest) -> TokenBatch:
        """The log's entries from `from_offset` (of one chunk or update, if named), now."""
        return self._log.read(req, closed=self._cancelled)

    @workflow.query
    def token_offset(self) -> int:
        """Where the token log ends: a reader that starts here gets what comes next."""
        return self._log.end

    @property
    def _epoch(self) -> int:
        return self._receipt.epoch if self._receipt is not None else 0

    def _log_result(self, result: GenerateResult) -> None:
        """A committed generate's entry: all its tokens and text (a reader that showed some of them
        live yields the rest, or all of them again as a `restart` if they differ)."""
        self._log.append(TokenEvent(chunk_seq=result.chunk_seq, epoch=result.receipt.epoch, tokens=result.tokens,
                                text=result.text, done=True, finish_reason=result.finish_reason,
                                update_id=_current_update_id()))

    def _log_failed(self, kind: str, chunk_seq: int, reason: str) -> None:
        """A generate that failed: its readers are told, and stop."""
        if kind != "generate":
            return
        self._log.append(TokenEvent(chunk_seq=chunk_seq, epoch=self._epoch, done=True, error=reason,
                                update_id=_current_update_id()))

    # --- bookkeeping -----------------------------------------------------------------------------

    async def _chunk(self, req: AdvanceRequest | GenerateRequest, kind: str, activity: str, result_type: type,
                     make_request: Callable[[], Any]) -> Any:
        """Answer a known update id from memory, or run the chunk's activity and commit it, in order."""
        known = self._known()
        if known is not None and (getattr(known, kind) is not None or known.kind == kind):
            return await self._answer(known, kind)
        digest = chunk_digest(kind, req)
        mine = req.chunk_seq not in self._in_flight  # else the same chunk is in flight under another id
        if mine:
            self._in_flight[req.chunk_seq] = digest
        try:
            async with self._lock:
                await workflow.wait_condition(lambda: self._open_now)
                same = self._recent.by_seq(req.chunk_seq)
                if same is not None and same.digest == digest and (getattr(same, kind) is not None
                                                                    or same.kind == kind):
                    return await self._answer(same, kind)  # the same chunk, sent again under another id
                self._recheck(req.principal, req.chunk_seq)
                streamed = isinstance(req, GenerateRequest) and req.stream
                try:
                    # a streamed generate heartbeats its tokens while it runs: a regular activity
                    # (a local one has no heartbeat)
                    out = await self._cancellable(self._run_chunk(activity, make_request(), result_type,
                                                                  _size(req), req.chunk_seq, local=not streamed))
                except asyncio.CancelledError:
                    err = self._interrupted("the chunk ran")
                    self._log_failed(kind, req.chunk_seq, err.type or StreamCancelled.reason)
                    raise err from None
                except ApplicationError as err:
                    self._log_failed(kind, req.chunk_seq, err.type or ActivityFailed.reason)
                    raise
                result = out.result
                if kind == "advance":
                    self._record_commit(result.receipt, out.worker_queue, tokens=result.n_tokens)
                else:
                    self._record_commit(result.receipt, out.worker_queue, generated=len(result.tokens))
                    self._log_result(result)
                self._recent.remember(RecentResult(update_id=workflow.current_update_info().id, digest=digest,
                                            **{kind: result}))
                return result
        finally:
            if mine:
                self._in_flight.pop(req.chunk_seq, None)

    def _recheck(self, principal: str, chunk_seq: int) -> None:
        """Validators ran at admission; by the time a handler holds the lock, an earlier one may have
        failed, or the stream may be cancelled or moving."""
        if self._cancelled or self._moving:
            raise self._interrupted("the chunk waited")
        expected = self._stats.chunk_seq + 1
        if chunk_seq != expected:
            raise application_error(ChunkSequenceMismatch(f"chunk_seq {chunk_seq} does not follow the committed {expected - 1}",
                                                field="chunk_seq", expected=expected, actual=chunk_seq))

    def _to_drop(self) -> list[str]:
        """Checkpoints that leave the store once the next one is committed: those that have been
        out of the rewind window (the line's newest `checkpoints_kept`) for a whole window, so
        the store holds up to 2 x checkpoints_kept - 1 of the line.

        A rewind (a Temporal reset) restores this bookkeeping, never the store: the undone
        chunks' drops stay done. Keeping the window before the window means they only ever took
        checkpoints that no chunk of the window needs for its own window: a first rewind lands on
        a chunk whose whole window is stored, and a rewind after it reaches any chunk of that
        window. A third step back may find a checkpoint the first line deleted (no bounded store
        holds every chain's): its next chunk is refused `RewindPastWindow`."""
        stored = 2 * self._opts.checkpoints_kept - 1
        excess = len(self._kept) + 1 - stored
        return [k for k in self._kept[: max(excess, 0)] if k not in self._pinned]

    def _record_commit(self, receipt: Receipt, worker_queue: str | None, *, tokens: int = 0, generated: int = 0) -> None:
        dropped = set(self._to_drop())  # the activity deleted these after committing
        self._kept = [k for k in self._kept if k not in dropped] + [receipt.state_key]
        before, self._receipt = self._receipt, receipt
        self._bind(worker_queue)
        s = self._stats
        self._stats = s.model_copy(update={
            "position": receipt.position, "chunk_seq": receipt.chunk_seq, "chunks": s.chunks + 1,
            "tokens": s.tokens + tokens, "generated_tokens": s.generated_tokens + generated,
            "last_backend": receipt.backend, **_arithmetic(before, receipt, s)})

    async def _answer(self, rec: RecentResult, kind: str) -> Any:
        """A committed chunk's result again: from memory, or (a digest-only entry) from its record."""
        result = getattr(rec, kind)
        if result is None:
            assert rec.state_key is not None
            out = await self._call(ACTIVITY_RECALL, RecallResultRequest(
                stream_id=self._stream_id, principal=self._inp.principal, state_key=rec.state_key, kind=kind),
                RecallResultResult)
            result = getattr(out, kind)
        return self._duplicate(result)

    def _duplicate(self, result: Any) -> Any:
        self._stats = self._stats.model_copy(update={"duplicates": self._stats.duplicates + 1})
        return result.model_copy(update={"duplicate": True})


class _Unconverted(Exception):
    """An activity's outcome no worker of the stream made (`_converted`)."""


async def _converted(result_type: type[T], mine: str, work: Any) -> T:
    """`await work` (an activity, its result raw), converted to `result_type`. What no worker of
    the stream made is `_Unconverted`: a result that does not convert (plaintext of another shape,
    another keyring's, none at all), or a failure the workers did not seal (`mine`: who seals the
    stream's payloads). Anyone can put either there, by completing or failing the activity by its
    id. (The SDK would have converted the result while applying the activation, where its refusal
    fails the workflow task, on every retry.)"""
    try:
        raw = await work
    except ActivityError as err:
        if isinstance(err.cause, ApplicationError) and sealer_of(err.cause) != mine:
            raise _Unconverted(f"a failure sealed by {sealer_of(err.cause)}") from err
        raise
    if not isinstance(raw, RawValue):
        raise _Unconverted("no result")
    try:
        return workflow.payload_converter().from_payload(raw.payload, result_type)
    except Exception as err:  # noqa: BLE001 - any refusal to convert: not the workers' result
        raise _Unconverted(getattr(err, "type", None) or type(err).__name__) from err


def _retry(attempts: int) -> RetryPolicy:
    """The regular path's retries: backoff from 200 ms to 10 s, `attempts` in all (0: unbounded)."""
    return RetryPolicy(initial_interval=timedelta(milliseconds=200), backoff_coefficient=2.0,
                       maximum_interval=timedelta(seconds=10), maximum_attempts=attempts)


def _current_update_id() -> str | None:
    info = workflow.current_update_info()
    return info.id if info is not None else None


def _size(req: AdvanceRequest | GenerateRequest) -> int:
    """The chunk's work in tokens, at most: fed tokens, a text's bytes, or a generate's max_tokens."""
    if isinstance(req, GenerateRequest):
        return req.max_tokens
    if req.tokens is not None:
        return len(req.tokens)
    return len(req.text.encode("utf-8")) if req.text is not None else 0
