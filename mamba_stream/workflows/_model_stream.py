"""ModelStream: a model stream inside the workflow that owns it.

A workflow holds a `ModelStream` as state, and each of its chunks is an activity that takes the
stream's receipt and returns the next one, exactly once through the commit protocol: local when
it is short (on the worker that holds the stream's hot state), regular otherwise, affine to that
worker while it lives. Chunk sequence and idempotency follow the owning workflow's history (a
replay, a workflow-task retry or a worker's SIGKILL finds the chunk's record and answers it from
there); continue-as-new carries the stream (`carry_over`, then `open(..., carried=)`, sealed by the workers);
`dispose` destroys its state.

    stream = await ModelStream.open(inp.principal, inp.model_id, options)
    await stream.advance(text="hello")
    reply = await stream.generate(32, stream=True)   # tokens shown live to the workflow's readers
    ...
    await stream.dispose()

The stream's id is its owning workflow's id: its payloads are sealed under the principal's history
key when that id names the principal (start the workflow with `StreamClient.new_id(principal)`),
and the workers run its activities only when that workflow scheduled them. A streamed generate
publishes its tokens to the owning workflow's token log: a workflow that inherits
`StreamOwner` is read by `StreamClient.tokens` as a `MambaStreamWorkflow` is.

`MambaStreamWorkflow` is this class behind updates and signals from outside: its handlers admit
a client's request (who sealed it, its sequence, its update id) and hand it to the same methods.

Sandbox-safe: the standard library, temporalio, pydantic and the record half of state_codec.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import Priority, RawValue, RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, FailureError
from temporalio.exceptions import TimeoutError as ActivityTimeout

with workflow.unsafe.imports_passed_through():
    from mamba_stream.state_codec import (
        CLEAR,
        MASTER,
        ChunkSequenceMismatch,
        PrincipalMismatch,
        Receipt,
        SealerMismatch,
        UnsealedRequest,
        arithmetic_moved,
        parse_state_key,
        sealer_of,
        stream_tag,
    )
    from mamba_stream.workflows._failures import (
        ActivityFailed,
        ChunkTooLarge,
        EmptyContext,
        InvalidRequest,
        LocalTooSlow,
        PriorityMismatch,
        ReservedStreamId,
        RewindPastWindow,
        RewindUnavailable,
        StreamCancelled,
        StreamMoving,
        TokenOutOfRange,
        UnknownRequest,
        application_error,
        invalid_request,
    )
    from mamba_stream.workflows._fairness import DEFAULT_PRIORITY_LEVEL, stream_priority
    from mamba_stream.workflows._models import (
        STREAM_MEMO,
        TIMEOUT_FLOORS,
        AdvanceRequest,
        AdvanceResult,
        CarriedStream,
        CarrySeal,
        CheckpointRequest,
        GenerateRequest,
        GenerateResult,
        Grammar,
        ModelInfo,
        OpenStreamInput,
        ReadTokensRequest,
        RecentResult,
        ResetRequest,
        RewindRequest,
        StreamCarry,
        StreamOptions,
        StreamStats,
        TokenBatch,
        TokenEvent,
    )
    from mamba_stream.workflows._records import RecentResults, TokenLog
    from mamba_stream.workflows.contract import (
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
        AdvanceChunkRequest,
        AdvanceChunkResult,
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
        carry_digest,
    )

__all__ = ["FORGED_RESULTS", "LOCAL_PAUSE_CHUNKS", "RESERVED_ID_PREFIXES", "ModelStream", "StreamOwner",
           "check_advance", "check_generate", "check_logit_bias", "check_sender", "check_stream_id",
           "generate_request", "refused_arguments", "takes"]

T = TypeVar("T")

#: regular activities completed with results the workers did not seal, in a row, before the call fails
FORGED_RESULTS = 5

#: chunks of a stream sent the regular way after one of its local attempts timed out (a loaded worker)
LOCAL_PAUSE_CHUNKS = 8
PATCH_LOCAL_PAUSE = "local-pause-after-timeout"
#: histories recorded before requests were taken by their sealer, carries sealed and bare cancel
#: requests refused replay as they ran (`workflow.patched`: false only when replaying such a history)
PATCH_SEALED = "requests-by-sealer"
#: marks a run whose every patch above is decided at its first workflow task (`mark_patches`)
PATCH_AT_START = "patches-at-start"
#: the markers recorded in a run's first workflow task, each with the patches it stands for. A patch
#: added later gets a marker of its own here, never a place in an existing marker's list: a run
#: recorded with that marker before the patch existed would replay as if it had taken it.
#: a workflow that opens a stream (`ModelStream.open`) says so in its memo (`STREAM_MEMO`): histories
#: recorded before replay without the memo's upsert
PATCH_STREAM_MEMO = "stream-memo"
PATCH_MEMO_AT_START = "stream-memo-at-start"
START_MARKERS: dict[str, tuple[str, ...]] = {PATCH_AT_START: (PATCH_SEALED, PATCH_LOCAL_PAUSE),
                                             PATCH_MEMO_AT_START: (PATCH_STREAM_MEMO,)}
#: histories recorded before a start of a reserved id was refused at once (`check_stream_id`) replay
#: as they ran. Asked of a reserved id's run only, first thing in it (so in its first workflow task):
#: not one of `START_MARKERS`, whose markers every run records.
PATCH_RESERVED_IDS = "reserved-ids-refused"
#: histories recorded before a start of another priority than its principal's fairness key was
#: refused (`check_stream_id`) replay as they ran. Asked only of such a start, first thing in its run.
PATCH_PRIORITY = "priority-refused"
#: the workers' own stream ids: the prefix store's entries (`activities.PREFIX_STREAM_PREFIX`, which
#: the sandbox may not import) and each owner's KV segments (`activities.SEGMENT_STREAM_PREFIX`). No
#: workflow's stream runs under one.
RESERVED_ID_PREFIXES = ("pfx.", "seg.")


def mark_patches() -> None:
    """Decide the patches of the stream's code in the run's first workflow task, from the stream's
    construction (the stream workflow's init, `ModelStream.open`): the markers of `START_MARKERS`
    stand for the patches they list (`patched`).

    `workflow.patched` is answered from the markers of the workflow task it is called in. A run
    that first asks right after a local activity's result (a cancel's check, a timed-out chunk)
    records its marker in whichever task that result was handed over in; a replay may hand the
    result over a task earlier, find no marker there yet, answer False, and fail nondeterministic
    when it meets the marker. Asked at construction, the marker lies in the first task, where
    every replay finds it."""
    for marker in START_MARKERS:
        workflow.patched(marker)


def patched(patch_id: str) -> bool:
    """Whether the run takes `patch_id`'s code (one of `START_MARKERS`' patches): yes for a run
    marked at its start (`mark_patches`); a history recorded before its marker existed asks
    `workflow.patched(patch_id)` where it asked when it was recorded."""
    marker = next(m for m, patches in START_MARKERS.items() if patch_id in patches)
    return workflow.patched(marker) or workflow.patched(patch_id)


def check_stream_id() -> None:
    """Refuse, typed `ReservedStreamId`, a stream under an id of the workers' own namespace
    (`RESERVED_ID_PREFIXES`): the workflow's id is its stream's, and a stream there would write, and
    dispose of, the prefix store's entries or an owner's KV segments. Whoever sealed the start: the
    id alone decides. Refuse, typed `PriorityMismatch`, a start whose priority names another
    fairness key than the id's principal tag (`stream_priority`), a weight, or a level above the
    default; none at all is taken, and an id that names no principal (the operator's) may carry any.
    Call it first thing in the run, before any activity (the stream workflow's start,
    `ModelStream.open`)."""
    wid = workflow.info().workflow_id
    if wid.startswith(RESERVED_ID_PREFIXES) and workflow.patched(PATCH_RESERVED_IDS):
        raise application_error(ReservedStreamId(
            f"stream id {wid!r} is in the workers' own namespace ({' and '.join(RESERVED_ID_PREFIXES)}: the prefix "
            f"store's entries, the KV segments): no stream runs there", field="stream_id", actual=wid))
    # The start's priority is the client's to set, so a client holding alice's keys could start
    # her stream under bob's fairness key (taking bob's turns), with a weight of its own choosing
    # or at a priority level above everyone's. Its activities carry the id's key whatever the
    # start said (`ModelStream.priority`); its workflow tasks carry the start's, so such a start
    # is refused here, in its first task. Weights are the operator's, set on the queues; a level
    # below the default is taken (a worker moves a burst of streams there; continue-as-new keeps it).
    given, tag = workflow.info().priority, stream_tag(wid)
    taken = (given.fairness_key in (None, tag) and given.fairness_weight is None
             and (given.priority_key is None or given.priority_key >= DEFAULT_PRIORITY_LEVEL))
    if tag is not None and not taken and workflow.patched(PATCH_PRIORITY):
        raise application_error(PriorityMismatch(
            f"stream {wid!r} was started with priority level {given.priority_key!r}, fairness key "
            f"{given.fairness_key!r} and weight {given.fairness_weight!r}: a stream's fairness key is its "
            f"principal's ({tag!r}; `workflows.stream_priority`), its weight the operator's, its level "
            f"{DEFAULT_PRIORITY_LEVEL} or below", field="priority",
            expected=[DEFAULT_PRIORITY_LEVEL, tag, None],
            actual=[given.priority_key, given.fairness_key, given.fairness_weight]))


def check_advance(req: AdvanceRequest, opts: StreamOptions, info: ModelInfo | None) -> None:
    """Refuse, typed, a feed the stream cannot take: too many tokens or bytes, a token outside the
    vocabulary."""
    if req.tokens is not None:
        if len(req.tokens) > opts.max_chunk_tokens:
            raise application_error(ChunkTooLarge(f"{len(req.tokens)} tokens exceed the chunk limit "
                                                  f"{opts.max_chunk_tokens}",
                                                  limit=opts.max_chunk_tokens, actual=len(req.tokens)))
        vocab = info.vocab_size if info else None
        bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise application_error(TokenOutOfRange(f"token {bad[0]} is outside [0, {vocab})", value=bad[0]))
    elif req.text is not None and len(req.text.encode("utf-8")) > opts.max_text_bytes:
        raise application_error(ChunkTooLarge(f"text exceeds {opts.max_text_bytes} bytes", limit=opts.max_text_bytes))


def check_prefix(req: OpenStreamRequest | OpenStreamInput, opts: StreamOptions) -> None:
    """Refuse, typed, a prefix the stream cannot open from: more tokens than `max_prefix_tokens`,
    more text than `max_text_bytes`, or one beside a resume (a stream starts from one or the other).
    `StreamClient.open` checks before it starts anything; the stream checks again (a start input
    may come from any client)."""
    if req.prefix is None:
        return
    if req.resume is not None:
        raise application_error(InvalidRequest("a stream opens from a prefix or from a checkpoint, not both",
                                               field="prefix"))
    if isinstance(req.prefix, str):
        if len(req.prefix.encode("utf-8")) > opts.max_text_bytes:
            raise application_error(ChunkTooLarge(f"the prefix's text exceeds {opts.max_text_bytes} bytes",
                                                  limit=opts.max_text_bytes))
    elif len(req.prefix) > opts.max_prefix_tokens:
        raise application_error(ChunkTooLarge(f"the prefix's {len(req.prefix)} tokens exceed max_prefix_tokens "
                                              f"{opts.max_prefix_tokens}", limit=opts.max_prefix_tokens,
                                              actual=len(req.prefix)))


def check_generate(req: GenerateRequest, opts: StreamOptions, position: int | None,
                   info: ModelInfo | None = None) -> None:
    """Refuse, typed, a generate the stream cannot take: too many tokens, nothing to continue from
    (`position` 0; None: not known here), a logit bias outside the vocabulary (`info`'s, when given:
    `check_logit_bias`)."""
    if req.max_tokens > opts.max_generate_tokens:
        raise application_error(ChunkTooLarge(f"max_tokens {req.max_tokens} exceeds {opts.max_generate_tokens}",
                                              limit=opts.max_generate_tokens, actual=req.max_tokens))
    if position == 0:
        raise application_error(EmptyContext("nothing to continue from: feed a prompt before generating"))
    check_logit_bias(req, info)


def check_logit_bias(req: GenerateRequest, info: ModelInfo | None) -> None:
    """Refuse, typed `InvalidRequest` naming `logit_bias`, a bias on a token outside the model's
    vocabulary (the request bounds a token id at 2**31 only; None: the model is not known here,
    and the activity refuses it, the same way, before any work)."""
    vocab = info.vocab_size if info is not None else None
    bad = sorted(t for t in req.logit_bias if vocab is not None and t >= vocab)
    if bad:
        raise application_error(InvalidRequest(
            f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab})",
            field="logit_bias", value=bad[0], limit=vocab))


def generate_request(**fields: Any) -> GenerateRequest:
    """`GenerateRequest(**fields)`, or a typed `InvalidRequest` whose `field` names the first setting
    that does not validate (a top_p of 0, a penalty past 2, a bias past 100), before anything is
    sent: a caller learns which setting it was, as from the stream's own refusals."""
    try:
        return GenerateRequest(**fields)
    except ValidationError as exc:
        raise invalid_request("GenerateRequest", exc) from None


def refused_arguments(model: type, args: tuple[Any, ...]) -> ApplicationError | None:
    """Why `args` are not what a handler takes, typed `InvalidRequest` (None: they are): exactly
    one `model`. A payload that does not validate as `model` is refused by the converter already;
    this catches what it lets through: no argument, JSON null, one too many. (The SDK drops the
    arguments of a handler that takes none.)"""
    if len(args) == 1 and isinstance(args[0], model):
        return None
    got = ", ".join(type(a).__name__ for a in args) or "no argument"
    return application_error(InvalidRequest(f"the request takes one {model.__name__}, not {got}",
                                            expected=model.__name__, actual=got))


def takes(model: type) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """A validator's or a query's arguments, checked before it runs (`refused_arguments`): a
    refused update writes nothing to history, a refused query nothing at all. The signature stays
    the handler's, so the SDK converts the payloads as before."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def checked(self: Any, *args: Any) -> T:
            refused = refused_arguments(model, args)
            if refused is not None:
                raise refused
            return fn(self, *args)
        return checked
    return wrap


def check_sender(req: Any, principal: str, what: str, *, replayable: bool = False) -> str:
    """Who sent `req` to the workflow that owns a stream of `principal`, by the key that sealed it
    (`state_codec.sealer_of`; `req` a `SealedRequest` with a `principal` field): "principal" (the
    principal's history key, which the workflow's id names; on a workflow whose id names no
    principal, the workers' key) or "operator" (the workers' key, on a workflow whose id names a
    principal: the codec server's operator token, say). Refused typed otherwise:
    `UnsealedRequest` (in clear), `SealerMismatch` (another principal's key); and the body's
    `principal` must be `principal` either way (`PrincipalMismatch`). Anyone who reaches the
    Temporal frontend can send a workflow any update, signal or start input: check each before
    acting on it (in an update's validator, nothing of a refused one reaches history).
    `replayable`: a signal's or the start input's check, which a history recorded before requests
    were taken by their sealer replays."""
    tag = stream_tag(workflow.info().workflow_id)
    sealer, mine = sealer_of(req), tag if tag is not None else MASTER
    if replayable:  # a signal or the start input: they replay (an update's validator may not mark history)
        mark_patches()  # a signal may come before the stream is built, in the same first task
        if sealer != mine and not patched(PATCH_SEALED):
            sealer = mine  # replaying a run that took what it was sent by what it said
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
    if req.principal != principal:
        raise application_error(PrincipalMismatch(f"principal {req.principal!r} does not own this stream",
                                                  field="principal", expected=principal, actual=req.principal))
    return who


class ModelStream:
    """One model stream, held by the workflow that owns it (its id is that workflow's id).

    Build it with `open` (a new state, one resumed from a receipt, or what the run before a
    continue-as-new handed over); then `advance`, `generate`, `reset`, `checkpoint`,
    and at the end `dispose`. Calls run one at a time, in the order they were made. A failure is
    raised typed (`ApplicationError`, `type` naming a class of `workflows.catalogue()`), and
    changes nothing of the stream. The workflow's cancellation cancels a chunk that runs; its
    handler then disposes (`dispose` runs to its end in a cancelled workflow).
    """

    def __init__(self, request: OpenStreamRequest, options: StreamOptions, carry: StreamCarry | None = None) -> None:
        """The stream's record, before any activity: opened by `start`, or carried and verified by
        `verify_carry`. (`open` does either.)"""
        mark_patches()
        self.stream_id = request.stream_id
        self.principal = request.principal
        self.opts = options
        self._opening = request
        #: what a carry says is trusted once the workers verified it (`verify_carry`)
        self.verified = carry is None
        self.receipt: Receipt | None = carry.receipt if carry else None
        self.info: ModelInfo | None = carry.info if carry else None
        self.stats = carry.stats if carry else StreamStats(stream_id=request.stream_id, principal=request.principal,
                                                           model_id=request.model_id)
        self.recent = RecentResults(options.recent_results, carry.recent if carry else ())
        self.kept: list[str] = list(carry.kept) if carry else []
        self.pinned: list[str] = list(carry.pinned) if carry else []
        self.worker_queue: str | None = carry.worker_queue if carry else None
        #: the token log: each finished generate's tokens, for readers (`read_tokens`). Tokens of a
        #: generate still running reach readers as its activity's heartbeats, not through here.
        self.log = TokenLog(options.token_log_events, carry.token_base if carry else 0,
                            carry.token_log if carry else ())
        self.cancelled = False  # ending: nothing more is taken, what runs is stopped
        self.moving = False  # continuing as new: nothing more is taken in this run
        self._lock = asyncio.Lock()
        self._running: set[asyncio.Task[Any]] = set()  # callers of the owner's API inside the lock
        self._destroyed = False

    # --- for the owning workflow -----------------------------------------------------------------

    @classmethod
    async def open(cls, principal: str, model_id: str, options: StreamOptions | None = None, *,
                   receipt: Receipt | None = None, input_transform: str | None = None,
                   prefix: str | Sequence[int] | None = None,
                   carried: CarriedStream | None = None) -> ModelStream:
        """The stream of `model_id` for `principal` in this workflow: a new one (`receipt`:
        continuing from that checkpoint, which the workers verify belongs to this model and
        principal; `prefix`: starting at the end of that text or those tokens, from the prefix
        store when it holds them), or, `carried`, the one the run before this one handed over (`carry_over`),
        once the workers verified their seal on it: a carry that is not theirs, for this workflow
        and the run it continues, fails typed `ForgedCarry` before anything of it is used.

        Open it first thing in `run` (the run's first workflow task): that is where the stream's
        code records which of its versions the run takes (`mark_patches`), so that every replay
        finds the record where it asks."""
        check_stream_id()
        options = options or StreamOptions()
        request = OpenStreamRequest(stream_id=workflow.info().workflow_id, principal=principal, model_id=model_id,
                                    input_transform=input_transform, resume=receipt,
                                    prefix=prefix if prefix is None or isinstance(prefix, str) else list(prefix),
                                    max_prefix_tokens=options.max_prefix_tokens)
        stream = cls(request, options, carried.carry if carried else None)
        if patched(PATCH_STREAM_MEMO):  # the CLI's `list` shows the streams agents own by it
            workflow.upsert_memo({STREAM_MEMO: model_id})
        if carried is None:
            await stream.start()
            return stream
        was = carried.carry.stats
        if (was.principal, was.model_id) != (principal, model_id):
            raise application_error(InvalidRequest(
                f"the carried stream is {was.model_id!r} of {was.principal!r}, not {model_id!r} of {principal!r}",
                field="carried", expected=[principal, model_id], actual=[was.principal, was.model_id]))
        await stream.verify_carry(carried.carry, carried.seal)
        return stream

    async def carry_over(self) -> CarriedStream:
        """What `workflow.continue_as_new` passes to the next run, sealed by the workers. The stream
        takes no more chunks in this run (`StreamMoving`)."""
        async with self._lock:
            self.taking()
            self.moving = True
            carry = self.carry()
            return CarriedStream(carry=carry, seal=await self.seal_carry(carry))

    @property
    def position(self) -> int:
        """Tokens in the state since the last reset."""
        return self.receipt.position if self.receipt is not None else 0

    async def advance(self, *, text: str | None = None, tokens: Sequence[int] | None = None,
                      top_k: int = 5) -> AdvanceResult:
        """Feed text (encoded by the stream's input transform) or token ids: the next chunk."""
        async with self._turn():
            req = _request(AdvanceRequest, principal=self.principal, chunk_seq=self._next(),
                           tokens=list(tokens) if tokens is not None else None, text=text, top_k=top_k)
            check_advance(req, self.opts, self.info)
            return await self.run_chunk("advance", req)

    async def generate(self, max_tokens: int, *, temperature: float = 1.0, top_k: int = 0, seed: int | None = None,
                       stop: Sequence[str] = (), stream: bool = False, top_p: float = 1.0, min_p: float = 0.0,
                       frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       repetition_penalty: float = 1.0, logit_bias: Mapping[int, float] | None = None,
                       grammar: Grammar | None = None) -> GenerateResult:
        """Sample up to `max_tokens` (seeded: derived from the stream and the chunk unless given).
        `stream`: the tokens are shown to the workflow's readers as they are sampled (a regular
        activity, which heartbeats them). The other settings are `GenerateRequest`'s (their
        defaults change nothing; `grammar`: docs/lifecycle.md, "Grammars"); one out of its range
        is refused typed `InvalidRequest` naming it, before anything runs."""
        async with self._turn():
            req = generate_request(
                principal=self.principal, chunk_seq=self._next(), max_tokens=max_tokens, temperature=temperature,
                top_k=top_k, seed=seed, stop=list(stop), stream=stream, top_p=top_p, min_p=min_p,
                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                repetition_penalty=repetition_penalty, logit_bias=dict(logit_bias or {}), grammar=grammar)
            check_generate(req, self.opts, self.position, self.info)
            return await self.run_chunk("generate", req)

    async def reset(self, *, revoke: bool = False) -> Receipt:
        """A new epoch at position 0 (`revoke`: every checkpoint of the earlier epochs deleted)."""
        async with self._turn():
            self.taking()
            await self.reset_state(ResetRequest(principal=self.principal, revoke=revoke))
            assert self.receipt is not None
            return self.receipt

    async def checkpoint(self, at_seq: int | None = None) -> Receipt:
        """A portable receipt of the state now (or after chunk `at_seq`, one of the rewind window's),
        kept in the store until the stream is disposed: another stream opens from it (`open(receipt=)`)."""
        async with self._turn():
            self.taking()
            return await self.pin(CheckpointRequest(principal=self.principal, at_seq=at_seq))

    async def dispose(self) -> None:
        """Destroy the stream's state: its blobs deleted, its hot states zeroed. Nothing more is
        taken. Runs to its end in a cancelled workflow; call it from the handler of the
        workflow's cancellation."""
        if self._destroyed:
            return
        self.cancelled = True
        for task in list(self._running):  # a chunk running now ends uncommitted (`StreamCancelled`)
            task.cancel()
        async with self._lock:
            if self._destroyed:
                return
            self.stats = self.stats.model_copy(update={"cancelled": True})
            await self.destroy()
            self._destroyed = True

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """One call of the owner's API: in the order called, and stopped by `dispose`."""
        async with self._lock:
            task = asyncio.current_task()
            if task is not None:
                self._running.add(task)
            try:
                yield
            finally:
                self._running.discard(task)  # type: ignore[arg-type]

    # --- the steps (MambaStreamWorkflow's handlers call these, having admitted a request) --------

    async def start(self) -> None:
        """Open the stream's first state (new, or resumed from the request's receipt)."""
        floor, given = TIMEOUT_FLOORS["task_timeout_s"], workflow.info().task_timeout
        if given is not None and given.total_seconds() < floor:
            raise application_error(InvalidRequest(
                f"the start request's task_timeout (the workflow task timeout) {given.total_seconds():g} s is "
                f"under its floor {floor:g} s",
                field="task_timeout", floor=floor, actual=given.total_seconds()))
        check_prefix(self._opening, self.opts)
        res = await self._call(ACTIVITY_OPEN, self._opening, OpenStreamResult, affine=False)
        self.receipt, self.info = res.receipt, res.info
        self._bind(res.worker_queue)
        self.kept = [res.receipt.state_key]
        self.stats = self.stats.model_copy(update={"position": res.receipt.position,
                                                   "last_backend": res.receipt.backend,
                                                   **_arithmetic(None, res.receipt, self.stats)})

    @property
    def _mine(self) -> str:
        """Who seals this stream's payloads: the tag of the principal its id names (the workers
        encode for the stream under that principal's history key), or the master key's."""
        tag = stream_tag(self.stream_id)
        return tag if tag is not None else MASTER

    @property
    def priority(self) -> Priority:
        """The priority of this stream's activities: its principal's fairness key (`stream_priority`)."""
        return stream_priority(self.stream_id)

    @property
    def open_now(self) -> bool:
        """The stream has a receipt it may trust: opened, or carried over and verified."""
        return self.receipt is not None and self.verified

    @property
    def _epoch(self) -> int:
        return self.receipt.epoch if self.receipt is not None else 0

    async def verify_carry(self, carry: StreamCarry, seal: CarrySeal | None) -> None:
        """The carry is the workers' own, sealed by the run this one continues (`seal_carry`),
        or the run fails `ForgedCarry` before anything of it is used: a client can start a
        workflow with any input, a carry included."""
        await self.quick(ACTIVITY_OPEN_CARRY, CarrySealRequest(
            stream_id=self.stream_id, digest=carry_digest(carry), seal=seal,
            continued_run_id=workflow.info().continued_run_id), CarrySeal)
        self.verified = True

    async def seal_carry(self, carry: StreamCarry) -> CarrySeal | None:
        """The workers' seal on what this run carries to the next (None: replaying a run that
        continued as new before carries were sealed)."""
        if not patched(PATCH_SEALED):
            return None
        return await self.quick(ACTIVITY_SEAL_CARRY, CarrySealRequest(
            stream_id=self.stream_id, digest=carry_digest(carry)), CarrySeal)

    def carry(self) -> StreamCarry:
        """What crosses continue-as-new, bounded by bytes: the newest results in full while they fit
        `carry_bytes`, older ones (up to `recent_results` in all) as digests, answered from the
        store's records, while those fit another `carry_bytes`: at most twice `carry_bytes` of
        results whatever the chunks' sizes."""
        assert self.receipt is not None and self.info is not None
        log, base = self.log.carried(self.opts.carry_bytes // 4)
        return StreamCarry(receipt=self.receipt, info=self.info, stats=self.stats,
                           recent=self.recent.carried(self.opts.carry_bytes), kept=self.kept, pinned=self.pinned,
                           worker_queue=self.worker_queue, token_log=log, token_base=base)

    async def quick(self, name: str, req: Any, result_type: type[T]) -> T:
        """A short activity of the stream's own bookkeeping (a carry sealed or verified, a
        request's signature checked): on this worker when chunks run locally (where the stream's
        workflow is, with no task queue in between), else on the shared queue; its refusal is
        raised typed."""
        timeout = timedelta(seconds=self.opts.local_deadline_s if self.opts.local_chunks
                            else self.opts.activity_timeout_s)
        try:
            if self.opts.local_chunks:
                return await workflow.execute_local_activity(
                    name, req, result_type=result_type, start_to_close_timeout=timeout, retry_policy=_retry(0))
            return await workflow.execute_activity(name, req, result_type=result_type, priority=self.priority,
                                                   start_to_close_timeout=timeout, retry_policy=_retry(0))
        except FailureError as err:
            cause = err.cause if isinstance(err, ActivityError) else err
            raise self._failed(cause) or err from err

    def interrupted(self, what: str) -> ApplicationError:
        """A chunk's activity was cancelled under it: by the stream's cancel, or a forced move."""
        if self.moving and not self.cancelled:
            return application_error(StreamMoving(f"the stream moved to a new run while {what}; send it again"))
        return application_error(StreamCancelled(f"the stream was cancelled while {what}"))

    def taking(self) -> None:
        """The first refusals of a request: a cancelled stream takes nothing more, and one moving
        to a new run refuses without storing (the same request goes to the next run)."""
        if self.cancelled:
            raise application_error(StreamCancelled("the stream is cancelled"))
        if self.moving:
            raise application_error(StreamMoving("the stream is moving to a new run; send it again"))

    def _next(self) -> int:
        """The next chunk's sequence, once the stream takes one."""
        self.taking()
        return self.stats.chunk_seq + 1

    # --- activities, with affinity ---------------------------------------------------------------

    def _bind(self, queue: str | None) -> None:
        if self.opts.affinity and queue:
            self.worker_queue = queue

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
            self.stats = self.stats.model_copy(update={"forged_results": self.stats.forged_results + 1})
            workflow.logger.warning("activity %s completed with a result the workers did not seal (sealer %s): "
                                    "dropped, run again", name, sealer)
        raise application_error(ActivityFailed(f"activity {name} ended {FORGED_RESULTS} times with outcomes the "
                                               f"workers did not seal"))

    async def _attempt(self, name: str, arg: Any, result_type: type[T], *, affine: bool = True) -> T:
        o = self.opts
        common: dict[str, Any] = dict(
            start_to_close_timeout=timedelta(seconds=o.activity_timeout_s),
            heartbeat_timeout=timedelta(seconds=o.heartbeat_timeout_s),
            # taken raw and converted here (`_converted`): a result the SDK failed to convert
            # would fail the workflow task itself, again on every retry
            result_type=RawValue,
        )
        try:
            if affine and o.affinity and self.worker_queue:
                try:
                    return await _converted(result_type, self._mine, workflow.execute_activity(
                        name, arg, task_queue=self.worker_queue, priority=self.priority,
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
                                            name, self.worker_queue, err.cause or err)
                    self.worker_queue = None
                    self.stats = self.stats.model_copy(update={"migrations": self.stats.migrations + 1})
            return await _converted(result_type, self._mine, workflow.execute_activity(
                name, arg, retry_policy=_retry(o.retry_max_attempts), priority=self.priority, **common))
        except ActivityError as err:
            raise self._failed(err.cause) or err from err

    def _final(self, cause: BaseException | None) -> bool:
        """A failure no other path may retry: the chunk's own (non-retryable), or a cancellation by
        the stream's own cancel or a forced move."""
        return (isinstance(cause, ApplicationError) and cause.non_retryable) or \
            ((self.cancelled or self.moving) and isinstance(cause, CancelledError))

    def _failed(self, cause: BaseException | None) -> BaseException | None:
        """An activity's final failure as the caller's, typed by the activity's reason and
        non-retryable; None if `cause` is not final (the chunk may be tried another way)."""
        if (self.cancelled or self.moving) and isinstance(cause, CancelledError):
            return self.interrupted("the activity ran")
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
        o = self.opts
        if local and o.local_chunks and size <= o.local_max_tokens and chunk_seq > self.stats.regular_until:
            timeout = timedelta(seconds=o.local_deadline_s)
            try:
                out = await workflow.execute_local_activity(
                    name, arg, result_type=result_type, schedule_to_close_timeout=timeout,
                    start_to_close_timeout=timeout, retry_policy=RetryPolicy(maximum_attempts=1))
                self.stats = self.stats.model_copy(update={"local_chunks": self.stats.local_chunks + 1})
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
                update: dict[str, Any] = {"local_fallbacks": self.stats.local_fallbacks + 1}
                if isinstance(cause, ApplicationError) and cause.type == LocalTooSlow.reason:
                    workflow.logger.info("local %s declined (%s); taking the regular path", name, cause)
                else:
                    workflow.logger.warning("local %s failed (%s); taking the regular path", name, cause)
                    if isinstance(cause, ActivityTimeout) and patched(PATCH_LOCAL_PAUSE):
                        # the worker is too loaded for local attempts to fit: stop trying for a while
                        # (patched: a history recorded before this rule replays without it)
                        update["regular_until"] = chunk_seq + LOCAL_PAUSE_CHUNKS
                self.stats = self.stats.model_copy(update=update)
        return await self._call(name, arg, result_type)

    # --- chunks and the line of checkpoints --------------------------------------------------------

    async def run_chunk(self, kind: str, req: AdvanceRequest | GenerateRequest) -> Any:
        """Run chunk `req` (the next one: `_recheck`) and commit it to the stream's record; a
        generate's result goes to the token log (a failed one too, so that its readers stop)."""
        self._recheck(req.chunk_seq)
        if isinstance(req, GenerateRequest):
            # an update's validator may not have known the model; nothing has run yet
            try:
                check_logit_bias(req, self.info)
            except ApplicationError as err:
                self._log_failed(kind, req.chunk_seq, err.type or InvalidRequest.reason)
                raise
        uid = _current_update_id()
        if isinstance(req, GenerateRequest):
            activity, result_type = ACTIVITY_GENERATE, GenerateChunkResult
            arg: Any = GenerateChunkRequest(stream_id=self.stream_id, principal=req.principal, receipt=self.receipt,
                                            request=req, drop_keys=self._to_drop(), update_id=uid,
                                            log_offset=self.log.end)
        else:
            activity, result_type = ACTIVITY_ADVANCE, AdvanceChunkResult
            arg = AdvanceChunkRequest(stream_id=self.stream_id, principal=req.principal, receipt=self.receipt,
                                      request=req, max_chunk_tokens=self.opts.max_chunk_tokens,
                                      drop_keys=self._to_drop(), update_id=uid)
        # a streamed generate heartbeats its tokens while it runs: a regular activity (a local one
        # has no heartbeat)
        streamed = isinstance(req, GenerateRequest) and req.stream
        try:
            out = await self._run_chunk(activity, arg, result_type, _size(req), req.chunk_seq, local=not streamed)
        except asyncio.CancelledError:
            err = self.interrupted("the chunk ran")
            self._log_failed(kind, req.chunk_seq, err.type or StreamCancelled.reason)
            raise err from None
        except ApplicationError as err:
            self._log_failed(kind, req.chunk_seq, err.type or ActivityFailed.reason)
            raise
        result = out.result
        if kind == "advance":
            self._move_to(result.receipt, out.worker_queue, tokens=result.n_tokens)
        else:
            self._move_to(result.receipt, out.worker_queue, generated=len(result.tokens))
            self.log.append(TokenEvent(chunk_seq=result.chunk_seq, epoch=result.receipt.epoch, tokens=result.tokens,
                                       text=result.text, done=True, finish_reason=result.finish_reason,
                                       update_id=uid))
        return result

    def _recheck(self, chunk_seq: int) -> None:
        """Admission ran earlier; by the time a chunk runs, an earlier one may have failed, or the
        stream may be cancelled or moving."""
        if self.cancelled or self.moving:
            raise self.interrupted("the chunk waited")
        expected = self.stats.chunk_seq + 1
        if chunk_seq != expected:
            raise application_error(ChunkSequenceMismatch(
                f"chunk_seq {chunk_seq} does not follow the committed {expected - 1}",
                field="chunk_seq", expected=expected, actual=chunk_seq))

    def _log_failed(self, kind: str, chunk_seq: int, reason: str) -> None:
        """A generate that failed: its readers are told, and stop."""
        if kind == "generate":
            self.log.append(TokenEvent(chunk_seq=chunk_seq, epoch=self._epoch, done=True, error=reason,
                                       update_id=_current_update_id()))

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
        stored = 2 * self.opts.checkpoints_kept - 1
        excess = len(self.kept) + 1 - stored
        return [k for k in self.kept[: max(excess, 0)] if k not in self.pinned]

    def _move_to(self, receipt: Receipt, worker_queue: str | None, *, tokens: int = 0, generated: int = 0) -> None:
        """The stream's bookkeeping after a committed chunk: its receipt, its line of kept
        checkpoints, its stats."""
        dropped = set(self._to_drop())  # the activity deleted these after committing
        self.kept = [k for k in self.kept if k not in dropped] + [receipt.state_key]
        before, self.receipt = self.receipt, receipt
        self._bind(worker_queue)
        s = self.stats
        self.stats = s.model_copy(update={
            "position": receipt.position, "chunk_seq": receipt.chunk_seq, "chunks": s.chunks + 1,
            "tokens": s.tokens + tokens, "generated_tokens": s.generated_tokens + generated,
            "last_backend": receipt.backend, **_arithmetic(before, receipt, s)})

    async def recall(self, rec: RecentResult, kind: str) -> Any:
        """A committed chunk's result again: from memory, or (a digest-only entry) from its record."""
        result = getattr(rec, kind)
        if result is None:
            assert rec.state_key is not None
            out = await self._call(ACTIVITY_RECALL, RecallResultRequest(
                stream_id=self.stream_id, principal=self.principal, state_key=rec.state_key, kind=kind),
                RecallResultResult)
            result = getattr(out, kind)
        return result

    async def reset_state(self, req: ResetRequest, *, by_operator: bool = False) -> None:
        """A new epoch at position 0, by `req` (admitted by the caller)."""
        assert self.receipt is not None
        out = await self._call(ACTIVITY_RESET, ResetStreamRequest(
            stream_id=self.stream_id, principal=req.principal, receipt=self.receipt,
            epoch=self.receipt.epoch + 1, request=req), StateResult)
        self.receipt = out.receipt
        self._bind(out.worker_queue)
        if req.revoke:  # the worker deleted every checkpoint of the earlier epochs
            self.kept, self.pinned = [], []
        self.kept.append(out.receipt.state_key)
        self.stats = self.stats.model_copy(update={
            "position": 0, "epoch": out.receipt.epoch, "resets": self.stats.resets + 1,
            "operator_resets": self.stats.operator_resets + int(by_operator),
            "last_backend": out.receipt.backend, **_arithmetic(None, out.receipt, self.stats)})

    def kept_at(self, chunk_seq: int, what: str = "rewind") -> tuple[str, int]:
        """The checkpoint committed at chunk `chunk_seq` (the first of the window's at that chunk:
        the chunk's own, before any reset at it) and its index in the line; refused typed when the
        chunk is not committed (`RewindUnavailable`) or left the window (`RewindPastWindow`)."""
        if chunk_seq > self.stats.chunk_seq:
            raise application_error(RewindUnavailable(f"chunk {chunk_seq} is not committed (the stream is at chunk "
                                                      f"{self.stats.chunk_seq})", chunk_seq=chunk_seq))
        window = self.kept[-self.opts.checkpoints_kept:]
        for key in window:
            parsed = parse_state_key(key)
            if parsed is not None and parsed.chunk_seq == chunk_seq:
                return key, self.kept.index(key)
        raise application_error(RewindPastWindow(
            f"chunk {chunk_seq} is outside the stream's rewind window (its newest {len(window)} checkpoints); "
            f"nothing was {'rewound' if what == 'rewind' else 'handed out'}", chunk_seq=chunk_seq,
            window=len(window)))

    def release(self, state_key: str) -> None:
        """One hold of a handed-out checkpoint taken back (each `checkpoint` call holds it once).
        Held no more, it leaves the store with the next chunk (`_to_drop`), or as the window moves
        on if it is still in it; one no longer in the line (a rewind went back before it) joins the
        line's oldest end, which the next chunk drops."""
        self.pinned.remove(state_key)
        if state_key not in self.pinned and state_key not in self.kept:
            self.kept.insert(0, state_key)

    async def pin(self, req: CheckpointRequest) -> Receipt:
        """The state now (or at chunk `req.at_seq`, one of the rewind window's), verified in the
        store and kept until the stream is disposed."""
        key = None if req.at_seq is None else self.kept_at(req.at_seq, "checkpoint")[0]
        if key == (self.receipt.state_key if self.receipt is not None else None):
            key = None
        out = await self._call(ACTIVITY_CHECKPOINT, CheckpointStreamRequest(
            stream_id=self.stream_id, principal=req.principal, receipt=self.receipt, request=req, state_key=key),
            StateResult)
        self.pinned.append(out.receipt.state_key)  # one hold per call: `release` takes one back
        return out.receipt

    async def rewind_state(self, req: RewindRequest, state_key: str, undone: list[str]) -> Receipt:
        """The stream's state set back to checkpoint `state_key`, the `undone` ones deleted: the
        stream continues from there in its next run (`rewound`)."""
        out = await self._call(ACTIVITY_REWIND, RewindStreamRequest(
            stream_id=self.stream_id, principal=req.principal, receipt=self.receipt, state_key=state_key,
            drop_keys=undone, request=req), StateResult)
        return out.receipt

    def rewound(self, receipt: Receipt, index: int) -> None:
        """The bookkeeping of the line a rewind went back to, for the next run: its receipt, its
        stored checkpoints up to the target, the results of its chunks up to it."""
        self.kept = self.kept[: index + 1]
        self.recent.up_to(receipt.epoch, receipt.chunk_seq)
        self.receipt = receipt
        self.stats = self.stats.model_copy(update={
            "position": receipt.position, "chunk_seq": receipt.chunk_seq, "epoch": receipt.epoch,
            "rewinds": self.stats.rewinds + 1, "last_backend": receipt.backend,
            "arithmetic": receipt.arithmetic.id if receipt.arithmetic else ""})

    async def destroy(self) -> None:
        """The stream's blobs deleted, its hot states zeroed.

        First on the worker that holds the hot states (one attempt: it zeroes them before it
        touches the store), then on any worker until it passes. A dispose has no caller to send it
        again, so nothing the store does may end it: the activity reports every store fault as
        retryable (a read-only or unreachable store, a permission an operator restores), and the
        attempts are not bounded by `retry_max_attempts` (a client's choice for its chunks).
        Waiting costs no history: Temporal retries an activity without new events. Should the
        dispose still fail for good (an unforeseen error, typed `InternalError`), it returns all
        the same, and the orphan sweep deletes what is left."""
        o, req = self.opts, DisposeStreamRequest(stream_id=self.stream_id)
        common: dict[str, Any] = dict(start_to_close_timeout=timedelta(seconds=o.activity_timeout_s),
                                      heartbeat_timeout=timedelta(seconds=o.heartbeat_timeout_s),
                                      result_type=RawValue, priority=self.priority)
        if o.affinity and self.worker_queue:
            try:
                await _converted(DisposeStreamResult, self._mine, workflow.execute_activity(
                    ACTIVITY_DISPOSE, req, task_queue=self.worker_queue,
                    schedule_to_start_timeout=timedelta(seconds=o.schedule_to_start_s),
                    retry_policy=RetryPolicy(maximum_attempts=1), **common))
                return
            except (ActivityError, _Unconverted) as err:
                workflow.logger.warning("dispose on %s failed (%s); any worker disposes",
                                        self.worker_queue, getattr(err, "cause", None) or err)
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
                                      self.stream_id, err.cause or err)
                return
            # an outcome the workers did not seal (the activity completed by its id): run it again
            self.stats = self.stats.model_copy(update={"forged_results": self.stats.forged_results + 1})
        workflow.logger.error("dispose of %s ended %d times with outcomes the workers did not seal; the orphan "
                              "sweep deletes what is left", self.stream_id, FORGED_RESULTS)


class StreamOwner:
    """What every workflow that owns a `ModelStream` as `self.stream` (None until it is open)
    answers, inherited by the workflow class (`MambaStreamWorkflow` is one): the queries of its
    receipt, its stats and its token log, which `StreamClient` (`tokens`, `read_tokens`,
    `receipt`, `stats`) reads as it reads a stream workflow's; and a refusal of requests of no
    known name (an update or query refused typed `UnknownRequest`, nothing in history; a signal,
    which cannot be refused, counted and dropped instead of kept for the run's lifetime)."""

    stream: ModelStream | None

    @workflow.query
    @takes(ReadTokensRequest)
    def read_tokens(self, req: ReadTokensRequest) -> TokenBatch:
        """The log's entries from `from_offset` (of one chunk or update, if named), now."""
        if self.stream is None:
            return TokenBatch(events=[], next_offset=0, closed=False)
        return self.stream.log.read(req, closed=self.stream.cancelled)

    @workflow.query
    def token_offset(self) -> int:
        """Where the token log ends: a reader that starts here gets what comes next."""
        return self.stream.log.end if self.stream is not None else 0

    @workflow.query
    def receipt(self) -> Receipt | None:
        return self.stream.receipt if self.stream is not None else None

    @workflow.query
    def stats(self) -> StreamStats | None:
        if self.stream is None:
            return None
        return self.stream.stats.model_copy(update={"next_seq": self._next_chunk_seq()})

    def _next_chunk_seq(self) -> int:
        """The chunk_seq a chunk sent now takes (an owner that admits chunks in flight says more)."""
        assert self.stream is not None
        return self.stream.stats.chunk_seq + 1

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
        if self.stream is not None:
            s = self.stream.stats
            self.stream.stats = s.model_copy(update={"unknown_signals": s.unknown_signals + 1})
        workflow.logger.warning("signal %r refused: the workflow has no such signal", name)

    @workflow.query(dynamic=True)
    def _unknown_query(self, name: str, args: Sequence[RawValue]) -> None:
        raise _unknown("query", name)


def _unknown(kind: str, name: str) -> ApplicationError:
    return application_error(UnknownRequest(f"the stream has no {kind} {name!r}", kind=kind, name=name))


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
    except Exception as err:  # any refusal to convert: not the workers' result
        raise _Unconverted(getattr(err, "type", None) or type(err).__name__) from err


def _request(model: type[T], **fields: Any) -> T:
    """A request the owning workflow builds, refused typed (`InvalidRequest`) when it does not
    validate: an untyped exception would fail the workflow task, again on every retry."""
    try:
        return model(**fields)
    except ValidationError as exc:
        raise invalid_request(model.__name__, exc) from None


def _arithmetic(before: Receipt | None, receipt: Receipt, stats: StreamStats) -> dict[str, Any]:
    """The stats' arithmetic fields after `receipt` (which continues `before`) is committed."""
    return {"arithmetic": receipt.arithmetic.id if receipt.arithmetic else "",
            "arithmetic_changes": stats.arithmetic_changes + int(arithmetic_moved(before, receipt))}


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
