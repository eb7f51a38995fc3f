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
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from mamba_stream.state_codec import (
        ChunkSequenceMismatch,
        EpochMismatch,
        Receipt,
        UnsealedRequest,
    )
    from mamba_stream.workflows._failures import (
        ConflictingChunk,
        InvalidRequest,
        OpenFailed,
        StreamCancelled,
        StreamOpening,
        UpdateIdMismatch,
        application_error,
    )
    from mamba_stream.workflows._model_stream import (
        PATCH_SEALED,
        ModelStream,
        StreamOwner,
        check_advance,
        check_generate,
        check_sender,
        check_stream_id,
        patched,
        refused_arguments,
        takes,
    )
    from mamba_stream.workflows._models import (
        STREAM_WORKFLOW_TYPE,
        AdvanceRequest,
        AdvanceResult,
        CancelRequest,
        CheckpointRequest,
        CheckpointResult,
        GenerateRequest,
        GenerateResult,
        OpenStreamInput,
        RecentResult,
        ReleaseRequest,
        ReleaseResult,
        ResetRequest,
        RewindRequest,
        RewindResult,
        StreamStats,
    )
    from mamba_stream.workflows.contract import (
        ACTIVITY_VERIFY,
        OpenStreamRequest,
        VerifyRequest,
        chunk_digest,
        parse_update_id,
    )

__all__ = ["MambaStreamWorkflow"]

T = TypeVar("T")

#: a history this large or this long moves the stream to a new run at once, a chunk in flight or not.
#: The server terminates a workflow at 50 MiB or 51,200 events and suggests continue-as-new at
#: 4 MiB or 4,096; every signal is written before the workflow sees it (up to 2 MiB each), and
#: continue-as-new otherwise waits for the chunk that holds the lock, which a flood of signals or
#: updates can outrun. These leave room for about 20 more of the largest payloads.
HISTORY_CRITICAL_BYTES = 8 * 1024 * 1024
HISTORY_CRITICAL_EVENTS = 10_240

#: how long a stream its principal cancelled (the `cancel` signal) waits for the Temporal cancel request
#: that follows it, so that its run ends cancelled; past it, the stream disposes and completes
CANCEL_GRACE_S = 10.0


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
            refused = refused_arguments(model, values)
            if refused is not None:
                refuse(self, refused)
                return
            await fn(self, *values)
        # the SDK reads the handler's hints: raw payloads, converted above
        checked.__annotations__ = {**fn.__annotations__, **{k: RawValue for k in fn.__annotations__ if k != "return"}}
        return checked
    return wrap


def _init_takes(fn: Callable[..., None]) -> Callable[..., None]:
    """`__init__`, which takes the start input raw (the SDK converts nothing) and converts it here.
    An input the workers' keys do not open (in clear it converts, and `check_sender` refuses it;
    under a key they do not hold, or altered: `UnknownKeyId`, `CorruptBlob`), one that does not
    validate, or not exactly one OpenStreamInput (none, JSON null, one too many) initializes the
    stream from a placeholder and keeps the refusal, which `run` raises at once (`_run_takes`):
    the run fails typed, and the refusal is counted. An exception here would fail the first
    workflow task instead, and every retry of it: a stream that neither ran nor ended; and a
    conversion the SDK made would fail the run before the stream's code ran, uncounted."""
    @functools.wraps(fn)
    def checked(self: Any, *args: Any) -> None:
        try:
            values = tuple(workflow.payload_converter().from_payload(a.payload, OpenStreamInput)
                           if isinstance(a, RawValue) else a for a in args)
        except ApplicationError as err:
            self._start_refused = err
        else:
            self._start_refused = refused_arguments(OpenStreamInput, values)
        self._start = values[0] if self._start_refused is None else OpenStreamInput(principal="", model_id="")
        fn(self, self._start)
    # the SDK reads the run's hints (these must equal them): raw payloads, converted above
    checked.__annotations__ = {**fn.__annotations__, **{k: RawValue for k in fn.__annotations__ if k != "return"}}
    return checked


def _run_takes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`run`, on the start input `__init__` converted, once the start is admitted: not under a
    reserved id (`check_stream_id`, whoever sealed it), converted (`_init_takes`), and sealed by the
    stream's principal or the operator (`check_sender`: a stream tagged for bob that alice's client
    started fails here). A refused start fails the run typed at its first workflow task, before any
    activity, and is counted as refused requests are (`_refuse`, kind "open")."""
    @functools.wraps(fn)
    async def checked(self: Any, *args: Any) -> Any:
        try:
            check_stream_id()
            if self._start_refused is not None:
                raise self._start_refused
            self._sealed_by(self._start, "open", replayable=True)
        except ApplicationError as err:
            self._refuse("open", err)
            raise
        return await fn(self, self._start)
    checked.__annotations__ = {**fn.__annotations__, **{k: RawValue for k in fn.__annotations__ if k != "return"}}
    return checked


# Pinned by the versioned worker's default behavior (worker.deployment_config), not here: a
# behavior on the definition is refused by unversioned workers.
@workflow.defn(name=STREAM_WORKFLOW_TYPE)
class MambaStreamWorkflow(StreamOwner):  # its queries (receipt, stats, the token log's); unknown requests refused
    @workflow.init
    @_init_takes
    def __init__(self, inp: OpenStreamInput) -> None:
        self._inp = inp
        # the stream itself (its record, its activities); what the carry says is trusted once the
        # workers verified it (`ModelStream.verify_carry`, first in `run`): until then no request is
        # admitted, and queries show it as it came
        self.stream = ModelStream(OpenStreamRequest(
            stream_id=workflow.info().workflow_id, principal=inp.principal, model_id=inp.model_id,
            input_transform=inp.input_transform, resume=inp.resume, signature=inp.signature, prefix=inp.prefix,
            max_prefix_tokens=inp.options.max_prefix_tokens), inp.options, inp.carry)
        self._lock = asyncio.Lock()
        self._in_flight: dict[int, str] = {}  # chunk_seq -> digest, of handlers started, not finished
        self._tasks: dict[asyncio.Task, bool] = {}  # handlers running activities -> whether a forced move stops them
        self._cancel_by: str | None = None  # who sent a `cancel` that passed: "principal" or "operator"
        self._cancel_requested = False  # a Temporal cancel request came (bare, or after `cancel`)
        self._cancel_checks = 0  # `cancel` signals whose signature the workers are checking
        self._rewound: tuple[Receipt, int] | None = None  # a rewind's target and chunk, for the next run
        self._leaving = False  # settled what moves to the next run: continuing as new
        self._open_error: ApplicationError | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    @workflow.run
    @_run_takes
    async def run(self, inp: OpenStreamInput) -> StreamStats:
        # the start was admitted (`_run_takes`): its id is not reserved, and its input is the
        # principal's (or the operator's), as its key says
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
                if not patched(PATCH_SEALED):  # replaying a run that took a bare cancel
                    self._cancel_by, self.stream.cancelled = "operator", True
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
        if not self.stream.verified:
            if patched(PATCH_SEALED):
                await self.stream.verify_carry(inp.carry, inp.carry_seal)
            else:
                self.stream.verified = True  # replaying a run that took its carry as it came
        if self.stream.receipt is None:
            try:
                await self.stream.start()
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
            carry = self.stream.carry()
            seal = await self.stream.seal_carry(carry)
            if self._cancel_by is not None:
                return
            if workflow.all_handlers_finished():
                break
            # a signal came while the carry was sealed (a reset): it goes in the carry too
            await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            self._inp.model_copy(update={"resume": None, "prefix": None, "carry": carry, "carry_seal": seal}),
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
            self.stream.moving = True
            self.stream.stats = self.stream.stats.model_copy(
                update={"forced_moves": self.stream.stats.forced_moves + 1})
            workflow.logger.warning("history at %d events, %d bytes: moving to a new run now",
                                    workflow.info().get_current_history_length(),
                                    workflow.info().get_current_history_size())
            for task, movable in list(self._tasks.items()):
                if movable:
                    task.cancel()
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._cancel_by is not None:
            return
        self.stream.moving = True  # from here the stream takes nothing more in this run
        if self._rewound is not None:
            self.stream.rewound(*self._rewound)
            self._rewound = None
        self.stream.stats = self.stream.stats.model_copy(update={
            "continued_as_new": self.stream.stats.continued_as_new + 1,
            "version_moves": self.stream.stats.version_moves + int(self._version_changed())})
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
            except TimeoutError:
                pass
            except asyncio.CancelledError:
                self._cancel_requested = True
        self.stream.cancelled = True
        self.stream.stats = self.stream.stats.model_copy(
            update={"cancelled": True, "cancelled_by": self._cancel_by or ""})
        for task in list(self._tasks):  # a handler stuck in a retrying activity must not hold up the end
            task.cancel()
        while True:  # the Temporal cancel request may come in the middle: it changes nothing here
            try:
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self.stream.destroy()
                break
            except asyncio.CancelledError:
                self._cancel_requested = True
        if self._cancel_requested:
            raise asyncio.CancelledError()
        return self.stream.stats

    @staticmethod
    def _history_critical() -> bool:
        info = workflow.info()
        return info.get_current_history_size() >= HISTORY_CRITICAL_BYTES or \
            info.get_current_history_length() >= HISTORY_CRITICAL_EVENTS

    @staticmethod
    def _version_changed() -> bool:
        return workflow.info().is_target_worker_deployment_version_changed()

    # --- activities, with affinity ---------------------------------------------------------------

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
        self.stream.taking()
        if not self.stream.open_now:
            # Refused, not failed: a refused update is not stored, so the same id can come again.
            raise application_error(StreamOpening("the stream is still opening; try again"))
        seq, digest = req.chunk_seq, chunk_digest(kind, req)
        info = workflow.current_update_info()
        named = parse_update_id(info.id) if info is not None else None
        if named is not None:
            # the id's content digest is keyed (`workflows.update_id`): the workers check it, here
            # the kind and the chunk
            if (named[0], named[1]) != (kind, seq):
                raise application_error(UpdateIdMismatch(
                    f"update id {info.id!r} does not name this {kind} of chunk {seq}", update_id=info.id))
            if named[2] != self.stream.receipt.epoch:
                # refused, not stored: the client asks for the epoch and sends the chunk again
                raise application_error(EpochMismatch(
                    f"update id {info.id!r} is for epoch {named[2]}; the stream is at "
                    f"epoch {self.stream.receipt.epoch}", field="epoch",
                    expected=self.stream.receipt.epoch, actual=named[2]))
        other = self._in_flight.get(seq)
        if other is None and seq <= self.stream.stats.chunk_seq:
            known = self.stream.recent.by_seq(seq)
            other = known.digest if known is not None else None
            if other is None:
                raise application_error(ChunkSequenceMismatch(
                    f"chunk_seq {seq} is already committed", field="chunk_seq",
                    expected=self._next_seq(), actual=seq))
        if other is not None:
            if other != digest:
                raise application_error(ConflictingChunk(
                    f"chunk {seq} is already {'in flight' if seq in self._in_flight else 'committed'} "
                    f"with other content", chunk_seq=seq))
            return  # the same chunk again: its handler answers it
        expected = self._next_seq()
        if seq != expected:
            raise application_error(ChunkSequenceMismatch(f"chunk_seq {seq} is not the next one ({expected})",
                                                field="chunk_seq", expected=expected, actual=seq))

    def _next_seq(self) -> int:
        return (max(self.stream.stats.chunk_seq, *self._in_flight) + 1 if self._in_flight
                else self.stream.stats.chunk_seq + 1)

    def _next_chunk_seq(self) -> int:  # the `stats` query's next_seq: after the chunks in flight too
        return self._next_seq()

    def _known(self) -> RecentResult | None:
        """The recent result of the current update's id, if it has one (a carry's only once verified)."""
        info = workflow.current_update_info()
        return self.stream.recent.by_id(info.id) if info is not None and self.stream.verified else None

    @workflow.update
    async def advance(self, req: AdvanceRequest) -> AdvanceResult:
        """Feed a chunk (tokens or text); returns the new receipt and an output summary."""
        return await self._chunk(req, "advance")

    @advance.validator
    @takes(AdvanceRequest)
    def _validate_advance(self, req: AdvanceRequest) -> None:
        self._sealed_by(req, "advance")
        if self._known() is not None:
            return
        self._check_chunk("advance", req)
        check_advance(req, self.stream.opts, self.stream.info)

    @workflow.update
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """Sample up to max_tokens (seeded); the generated tokens advance the state like input."""
        return await self._chunk(req, "generate")

    @generate.validator
    @takes(GenerateRequest)
    def _validate_generate(self, req: GenerateRequest) -> None:
        self._sealed_by(req, "generate")
        if self._known() is not None:
            return
        self._check_chunk("generate", req)
        # a chunk answered from its record needs no context (`None`: not checked)
        known = self.stream.recent.by_seq(req.chunk_seq) is not None or self.stream.receipt is None
        # the model's vocabulary, once the stream has one: a logit bias outside it is refused here,
        # before the update is accepted (nothing in history)
        check_generate(req, self.stream.opts, None if known else self.stream.receipt.position, self.stream.info)

    @workflow.update
    async def checkpoint(self, req: CheckpointRequest) -> CheckpointResult:
        """A portable receipt: verified in the store, kept until the stream is cancelled."""
        async with self._lock:
            await workflow.wait_condition(lambda: self.stream.open_now)
            if self.stream.cancelled or self.stream.moving:
                raise self.stream.interrupted("the checkpoint waited")
            try:
                receipt = await self._cancellable(self.stream.pin(req))
            except asyncio.CancelledError:
                raise self.stream.interrupted("the checkpoint ran") from None
            return CheckpointResult(stream_id=self.stream.stream_id, receipt=receipt)

    @checkpoint.validator
    @takes(CheckpointRequest)
    def _validate_checkpoint(self, req: CheckpointRequest) -> None:
        self._sealed_by(req, "checkpoint")
        self.stream.taking()
        if req.at_seq is not None:
            if not self.stream.open_now:
                raise application_error(StreamOpening("the stream is still opening; try again"))
            self.stream.kept_at(req.at_seq, "checkpoint")

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
        if self.stream.cancelled:
            self._refuse("reset", application_error(StreamCancelled("the stream is cancelled")))
            return
        async with self._lock:
            await workflow.wait_condition(lambda: self.stream.open_now)
            assert self.stream.receipt is not None
            if req.epoch is not None and req.epoch != self.stream.receipt.epoch + 1:
                # a reset meant for another epoch: a replayed or stale signal resets nothing
                self._refuse("reset", application_error(EpochMismatch(
                    f"the reset is for epoch {req.epoch}; the stream is at epoch {self.stream.receipt.epoch}",
                    field="epoch", expected=self.stream.receipt.epoch + 1, actual=req.epoch)))
                return
            try:
                await self._cancellable(self.stream.reset_state(req, by_operator=who == "operator"), movable=False)
            except asyncio.CancelledError:
                return  # the stream is being cancelled: nothing to reset
            except ApplicationError as err:
                # a signal has no caller to fail: refused (e.g. a bad signature), counted, nothing changed
                self._refuse("reset", err)
                return

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
            await self.stream.quick(ACTIVITY_VERIFY, VerifyRequest(stream_id=self.stream.stream_id,
                                                                   principal=req.principal, kind="cancel",
                                                                   request=req), VerifyRequest)
        except ApplicationError as err:
            self._refuse("cancel", err)
            return
        finally:
            self._cancel_checks -= 1
        if self._cancel_by is None:
            self._cancel_by = who
            self.stream.cancelled = True  # validators refuse from now on; `_end` stops what was admitted

    @workflow.update
    async def release(self, req: ReleaseRequest) -> ReleaseResult:
        """A checkpoint handed out by `checkpoint` (a fork's) is no longer needed: the stream stops
        keeping it, and it leaves the store with the stream's next chunk (or as the rewind window
        moves on, if it is still in it). By the stream's principal or the operator; the workers
        check its signature where they verify signatures."""
        async with self._lock:
            await workflow.wait_condition(lambda: self.stream.open_now)
            if self.stream.cancelled or self.stream.moving:
                raise self.stream.interrupted("the release waited")
            self._releasable(req.state_key)
            await self.stream.quick(ACTIVITY_VERIFY, VerifyRequest(
                stream_id=self.stream.stream_id, principal=req.principal, kind="release", request=req), VerifyRequest)
            self.stream.release(req.state_key)
            return ReleaseResult(stream_id=self.stream.stream_id, state_key=req.state_key,
                                 pinned=len(self.stream.pinned))

    @release.validator
    @takes(ReleaseRequest)
    def _validate_release(self, req: ReleaseRequest) -> None:
        self._sealed_by(req, "release")
        self.stream.taking()
        self._releasable(req.state_key)

    def _releasable(self, state_key: str) -> None:
        if state_key not in self.stream.pinned:
            raise application_error(InvalidRequest("not a checkpoint this stream keeps for others (handed out by "
                                                   "`checkpoint` and not released)", field="state_key"))

    @workflow.update
    async def rewind(self, req: RewindRequest) -> RewindResult:
        """Go back to just after chunk `to_seq` (0: the opened state), by the stream's principal or
        the operator: the stream continues, in a new run, from that chunk's checkpoint, with the
        same outputs and checksum as a fresh stream fed the same tokens. Any chunk of the rewind
        window (`rewind_window`: the line's newest `checkpoints_kept` checkpoints) can be reached,
        and after a rewind any of the new window's; the undone chunks' checkpoints are deleted."""
        async with self._lock:
            await workflow.wait_condition(lambda: self.stream.open_now)
            if self.stream.cancelled or self.stream.moving:
                raise self.stream.interrupted("the rewind waited")
            assert self.stream.receipt is not None
            key, index = self.stream.kept_at(req.to_seq)
            undone = [k for k in self.stream.kept[index + 1:] if k not in self.stream.pinned]
            try:
                receipt = await self._cancellable(self.stream.rewind_state(req, key, undone))
            except asyncio.CancelledError:
                raise self.stream.interrupted("the rewind ran") from None
            # the undone line is gone from the store: the stream takes no more chunks in this run
            # (StreamMoving: they are sent again to the next, which continues from here)
            self._rewound = (receipt, index)
            self.stream.moving = True
            return RewindResult(stream_id=self.stream.stream_id, chunk_seq=req.to_seq, position=receipt.position,
                                receipt=receipt)

    @rewind.validator
    @takes(RewindRequest)
    def _validate_rewind(self, req: RewindRequest) -> None:
        self._sealed_by(req, "rewind")
        self.stream.taking()
        if not self.stream.open_now:
            raise application_error(StreamOpening("the stream is still opening; try again"))
        self.stream.kept_at(req.to_seq)

    def _sealed_by(self, req: Any, what: str, *, replayable: bool = False) -> str:
        """Who sent `req` (`check_sender`): "principal" or "operator", or refused typed."""
        return check_sender(req, self._inp.principal, what, replayable=replayable)

    def _refuse(self, kind: str, err: ApplicationError) -> None:
        """A signal refused (it has no caller to tell), or the start (`_run_takes`, kind "open":
        the run fails with it, but a starter without the workers' keys cannot read why): counted,
        its reason in the stats, logged, and counted by the workers' metric."""
        reason = err.type or InvalidRequest.reason
        update: dict[str, Any] = {"last_refusal": f"{kind}: {reason}: {err.message}"[:512]}
        if kind == "reset":
            update["rejected_resets"] = self.stream.stats.rejected_resets + 1
        elif kind == "cancel":
            update["refused_cancels"] = self.stream.stats.refused_cancels + 1
        self.stream.stats = self.stream.stats.model_copy(update=update)
        workflow.logger.warning("%s refused: %s (%s)", kind, err.message, reason)
        workflow.metric_meter().create_counter(
            "mamba_stream_refused_requests", "requests a stream refused that had no caller to tell").add(
            1, {"kind": kind, "reason": reason})

    @workflow.update
    async def ready(self) -> Receipt:
        """Returns once the stream is open (its first receipt exists)."""
        await workflow.wait_condition(
            lambda: self.stream.open_now or self.stream.cancelled or self._open_error is not None)
        if self._open_error is not None:
            err = self._open_error
            raise ApplicationError(err.message, *(list(err.details) if err.details else []),
                                   type=err.type or OpenFailed.reason, non_retryable=True)
        if self.stream.receipt is None:
            raise application_error(StreamCancelled("the stream was cancelled before it opened"))
        return self.stream.receipt

    @workflow.query
    def rewind_window(self) -> list[str]:
        """The state keys a rewind may go back to, oldest first: the line's newest
        `checkpoints_kept` checkpoints (`StreamClient.rewind` refuses any other before it resets)."""
        return self.stream.kept[-self.stream.opts.checkpoints_kept :]

    # --- bookkeeping -----------------------------------------------------------------------------

    async def _chunk(self, req: AdvanceRequest | GenerateRequest, kind: str) -> Any:
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
                await workflow.wait_condition(lambda: self.stream.open_now)
                same = self.stream.recent.by_seq(req.chunk_seq)
                if same is not None and same.digest == digest and (getattr(same, kind) is not None
                                                                    or same.kind == kind):
                    return await self._answer(same, kind)  # the same chunk, sent again under another id
                result = await self._cancellable(self.stream.run_chunk(kind, req))
                self.stream.recent.remember(RecentResult(update_id=workflow.current_update_info().id, digest=digest,
                                                     **{kind: result}))
                return result
        finally:
            if mine:
                self._in_flight.pop(req.chunk_seq, None)

    async def _answer(self, rec: RecentResult, kind: str) -> Any:
        """A committed chunk's result again: from memory, or (a digest-only entry) from its record."""
        return self._duplicate(await self.stream.recall(rec, kind))

    def _duplicate(self, result: Any) -> Any:
        self.stream.stats = self.stream.stats.model_copy(update={"duplicates": self.stream.stats.duplicates + 1})
        return result.model_copy(update={"duplicate": True})





