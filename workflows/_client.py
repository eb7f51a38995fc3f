"""Client helpers: open streams with server-made ids, feed them with idempotent update ids."""

from __future__ import annotations

import asyncio
import hashlib
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyExcludeType
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest, ResetWorkflowExecutionRequest
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from state_codec import Receipt
from workflows._config import DEFAULT_TASK_QUEUE
from workflows._failures import RewindPastWindow, RewindUnavailable
from workflows._models import (
    ACTIVITY_OPEN,
    AdvanceRequest,
    chunk_digest,
    AdvanceResult,
    CheckpointRequest,
    CheckpointResult,
    GenerateRequest,
    GenerateResult,
    OpenStreamInput,
    PollTokensRequest,
    ResetRequest,
    StreamOptions,
    StreamStats,
    TokenBatch,
    TokenEvent,
)
from workflows._stream import MambaStreamWorkflow

if TYPE_CHECKING:
    from state_codec.signing import RequestSigner

__all__ = ["GenerateStream", "StreamClient", "new_stream_id", "transient", "update_id"]

T = TypeVar("T")

#: RPC statuses that say the server or the stream's worker could not answer now, not that the
#: request is wrong: a loaded box times out workflow tasks, and while a stream's workflow task is
#: retried the server refuses its updates with FAILED_PRECONDITION ("Workflow Task in failed state");
#: it does too while no worker has polled the queue lately (all busy, or restarting)
_TRANSIENT = {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.RESOURCE_EXHAUSTED,
              RPCStatusCode.ABORTED, RPCStatusCode.CANCELLED}


def transient(err: BaseException) -> bool:
    """Whether `err` is a client call that may pass if sent again unchanged: an update or query
    RPC that timed out, a server that could not take it now, a stream whose workflow task is being
    retried. A chunk's own failure, or a refusal, is never transient."""
    if isinstance(err, WorkflowUpdateRPCTimeoutOrCancelledError):
        return True
    if isinstance(err, RPCError):
        if err.status in _TRANSIENT:
            return True
        if err.status == RPCStatusCode.FAILED_PRECONDITION and any(
                m in str(err) for m in ("failed state", "no poller seen")):
            return True
        # a query the stream's worker did not answer in time (its task expired in the queue)
        return err.status == RPCStatusCode.NOT_FOUND and "query task not found" in str(err)
    return False


def new_stream_id(tag: str | None = None) -> str:
    """Unguessable, and valid as a store key prefix: `ms.<tag>.<32 hex>`, where the tag names the
    principal whose history key encrypts the stream's payloads without saying who it is
    (`state_codec.keyring`, `state_codec.payload.stream_principal`), or `ms-<32 hex>` (the master
    key's) without one."""
    return f"ms.{tag}.{uuid.uuid4().hex}" if tag else "ms-" + uuid.uuid4().hex


def _principal_tag(client: Client, principal: str) -> str | None:
    """The principal's tag, from the keyring of the client's payload codec (None: no such codec,
    or a principal's keyring opening a stream for someone else)."""
    todo = [client.data_converter.payload_codec]
    while todo:
        codec = todo.pop()
        ring = getattr(codec, "keyring", None)
        if ring is not None and hasattr(ring, "principal_tag"):
            try:
                return ring.principal_tag(principal)
            except Exception:  # noqa: BLE001 - KeyringError: not this keyring's principal
                return None
        todo.extend(getattr(codec, "codecs", ()))
    return None


def update_id(kind: str, request: AdvanceRequest | GenerateRequest, *, epoch: int, attempt: int = 0) -> str:
    """The idempotency key of a chunk: `<kind>-<chunk_seq>-e<epoch>-<digest>[-a<attempt>]`.

    Re-sending the same chunk (same sequence, epoch and content) returns the first result; other
    content under the same sequence is another id, which the stream refuses as `ConflictingChunk`
    instead of answering it with the first writer's result. A signed chunk's id also names its
    signature, so a forged request refused under one id cannot take the id of the real one. The
    epoch (the stream's reset count) and `attempt` let a chunk whose update failed for a reason
    that was not its own (`workflows.NOT_THE_CHUNKS_FAULT`: a store fault, a rewind past the
    window) be sent again once the cause is gone: a failed update id keeps its failure.
    """
    uid = f"{kind}-{request.chunk_seq}-e{epoch}-{chunk_digest(kind, request)[:16]}"
    if request.signature is not None:
        uid += "-s" + hashlib.sha256(request.signature.encode()).hexdigest()[:16]
    return uid + (f"-a{attempt}" if attempt else "")


class StreamClient:
    """Operations on streams through a Temporal client carrying the MambaStreamPlugin.

    Args:
        signer: signs every request for its principal (`state_codec.signing.RequestSigner`);
            needed when the workers verify signatures.
        retry_s: how long a call is sent again while it fails for a transient reason (`transient`:
            a loaded server or worker); every call is idempotent (an update under its id, a reset
            under the epoch it begins), so sending it again never applies it twice.
    """

    def __init__(self, client: Client, task_queue: str = DEFAULT_TASK_QUEUE, *,
                 signer: RequestSigner | None = None, retry_s: float = 120.0) -> None:
        self.client = client
        self.task_queue = task_queue
        self.signer = signer
        self.retry_s = retry_s
        self._epochs: dict[str, int] = {}  # stream -> the epoch this client last saw it in

    async def _retrying(self, call: Callable[[], Awaitable[T]], stream_id: str | None = None) -> T:
        """`call()`, sent again with backoff while it fails transiently, for up to `retry_s`."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.retry_s, 0.05
        while True:
            try:
                return await call()
            except (RPCError, WorkflowUpdateRPCTimeoutOrCancelledError) as err:
                if not transient(err) or loop.time() + delay > deadline:
                    raise
                if stream_id is not None and "no poller seen" in str(err):
                    await self._unstick(stream_id)
            await asyncio.sleep(delay * (0.5 + random.random()))  # jitter: many clients back off apart
            delay = min(delay * 2, 2.0)

    async def _unstick(self, stream_id: str) -> None:
        """Send the stream's next tasks to its task queue instead of the worker that last ran it.
        A query goes to that worker's own (sticky) queue while the stream sits idle; when that
        worker died, nothing polls it and every query fails "no poller seen" until the stream's
        next workflow task, which an idle stream may never have."""
        try:
            await self.client.workflow_service.reset_sticky_task_queue(ResetStickyTaskQueueRequest(
                namespace=self.client.namespace, execution=WorkflowExecution(workflow_id=stream_id)))
        except RPCError:
            pass  # the next attempt says what is wrong, if anything still is

    async def _update(self, handle: WorkflowHandle, update: Any, *args: Any, id: str) -> Any:
        return await self._retrying(lambda: handle.execute_update(update, *args, id=id), handle.id)

    async def _query(self, stream_id: str, query: Any, *args: Any) -> Any:
        return await self._retrying(lambda: self.handle(stream_id).query(query, *args), stream_id)

    def sign(self, kind: str, stream_id: str, request):  # noqa: ANN001, ANN201 - any signed request model
        """`request` with its signature, when this client signs (unchanged otherwise)."""
        if self.signer is None:
            return request
        return request.model_copy(update={"signature": self.signer.sign(kind, stream_id, request.claims())})

    def handle(self, stream_id: str) -> WorkflowHandle:
        return self.client.get_workflow_handle_for(MambaStreamWorkflow.run, stream_id)

    async def open(self, principal: str, model_id: str, *, options: StreamOptions | None = None,
                   input_transform: str | None = None, resume: Receipt | None = None,
                   stream_id: str | None = None, wait: bool = True) -> str:
        """Start a stream; returns its id (server-made unless given) once it is open.

        Raises:
            WorkflowFailureError: opening failed; its cause is typed by reason (a resume from an
                incompatible checkpoint: PrincipalMismatch, SchemaMismatch, ...).
        """
        sid = stream_id or new_stream_id(_principal_tag(self.client, principal))
        inp = self.sign("open", sid, OpenStreamInput(principal=principal, model_id=model_id,
                                                     input_transform=input_transform, resume=resume,
                                                     options=options or StreamOptions()))
        sent = False

        async def start() -> WorkflowHandle:
            nonlocal sent
            try:
                return await self.client.start_workflow(
                    MambaStreamWorkflow.run, inp,
                    id=sid, task_queue=self.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                    task_timeout=timedelta(seconds=inp.options.task_timeout_s),
                )
            except WorkflowAlreadyStartedError:
                if not sent:
                    raise
                return self.handle(sid)  # our own earlier start went through; its answer was lost
            finally:
                sent = True

        handle = await self._retrying(start)
        if wait:
            try:
                await self._update(handle, MambaStreamWorkflow.ready, id="ready")
            except WorkflowUpdateFailedError:
                await handle.result()  # raises the typed reason the stream failed to open with
                raise
            except RPCError:
                # The stream closed before it took the update (it could not read its input: another
                # keyring): its failure is the reason. Still running: the RPC error is.
                if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                    await handle.result()
                raise
        return sid

    async def next_seq(self, stream_id: str) -> int:
        return (await self._position(stream_id))[0] + 1

    async def _position(self, stream_id: str) -> tuple[int, int]:
        """(committed chunk_seq, epoch), from the stream."""
        st = await self.stats(stream_id)
        self._epochs[stream_id] = st.epoch
        return st.chunk_seq, st.epoch

    async def _chunk(self, kind: str, stream_id: str, make: Callable[[int], Any], update: Any,
                     chunk_seq: int | None, attempt: int) -> Any:
        """Send a chunk under its update id; once more with a fresh epoch if the stream was reset
        since this client last saw it (the stream refuses a stale epoch, nothing is stored)."""
        if chunk_seq is None:
            seq, epoch = await self._position(stream_id)
            seq += 1
        else:
            seq = chunk_seq
            epoch = self._epochs.get(stream_id)
            if epoch is None:
                epoch = (await self._position(stream_id))[1]
        req = self.sign(kind, stream_id, make(seq))
        handle = self.handle(stream_id)
        try:
            out = await self._update(handle, update, req, id=update_id(kind, req, epoch=epoch, attempt=attempt))
        except WorkflowUpdateFailedError as err:
            if not (isinstance(err.cause, ApplicationError) and err.cause.type == "EpochMismatch"):
                raise
            epoch = (await self._position(stream_id))[1]  # reset since we last looked: once more
            out = await self._update(handle, update, req, id=update_id(kind, req, epoch=epoch, attempt=attempt))
        self._epochs[stream_id] = out.receipt.epoch
        return out

    async def advance(self, stream_id: str, principal: str, *, tokens: Sequence[int] | None = None,
                      text: str | None = None, chunk_seq: int | None = None, top_k: int = 5,
                      attempt: int = 0) -> AdvanceResult:
        """Feed a chunk. `attempt`: send a chunk again whose update failed for a reason that was
        not its own (`NOT_THE_CHUNKS_FAULT`); the same attempt returns the same outcome."""
        return await self._chunk("advance", stream_id, lambda seq: AdvanceRequest(
            principal=principal, chunk_seq=seq, tokens=list(tokens) if tokens is not None else None, text=text,
            top_k=top_k), MambaStreamWorkflow.advance, chunk_seq, attempt)

    async def generate(self, stream_id: str, principal: str, max_tokens: int, *, temperature: float = 1.0,
                       top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                       chunk_seq: int | None = None, attempt: int = 0) -> GenerateResult:
        return await self._chunk("generate", stream_id, lambda seq: GenerateRequest(
            principal=principal, chunk_seq=seq, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
            seed=seed, stop=list(stop)), MambaStreamWorkflow.generate, chunk_seq, attempt)

    def generate_stream(self, stream_id: str, principal: str, max_tokens: int, *, temperature: float = 1.0,
                        top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                        chunk_seq: int | None = None, attempt: int = 0) -> GenerateStream:
        """`generate`, its tokens read as they are sampled: `async for event in ...` yields the
        chunk's `TokenEvent`s in order (the last one `done`); then `.result` is its GenerateResult.
        The same chunk as `generate` with the same arguments: streaming decides how it is shown,
        never what is committed."""
        return GenerateStream(self, stream_id, principal, dict(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed, stop=list(stop)),
            chunk_seq, attempt)

    async def tokens(self, stream_id: str, *, from_offset: int = 0, chunk_seq: int | None = None,
                     update_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """The stream's token log from `from_offset` (of one chunk, if named), as it grows: each
        entry once, in order, across continue-as-new; ends when the stream is cancelled or closed.
        A reader that reconnects passes the last entry's offset + 1. Entries older than the log's
        window (`StreamOptions.token_log_events`) are gone: reading starts at the oldest kept."""
        offset, failures = from_offset, 0
        handle = self.handle(stream_id)
        while True:
            try:
                batch: TokenBatch = await handle.execute_update(
                    MambaStreamWorkflow.poll_tokens,
                    PollTokensRequest(from_offset=offset, chunk_seq=chunk_seq, update_id=update_id),
                    id=f"tokens-poll-{uuid.uuid4().hex}")
            except WorkflowUpdateFailedError as err:
                if isinstance(err.cause, ApplicationError) and err.cause.type == "StreamMoving":
                    await asyncio.sleep(0.02)  # continuing as new: the next run has the log
                    continue
                raise
            except RPCError:
                if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                    return  # closed: nothing more will come
                failures += 1
                if failures > 3:
                    raise
                # running: the poll met the end of a run that continued as new; the next run has the log
                await asyncio.sleep(0.02 * failures)
                continue
            failures = 0
            for ev in batch.events:
                yield ev
            if batch.closed:
                return
            offset = batch.next_offset

    async def read_tokens(self, stream_id: str, *, from_offset: int = 0, chunk_seq: int | None = None,
                          update_id: str | None = None) -> TokenBatch:
        """What the token log holds from `from_offset` now, without waiting (a query: no history)."""
        return await self.handle(stream_id).query(MambaStreamWorkflow.read_tokens, PollTokensRequest(
            from_offset=from_offset, chunk_seq=chunk_seq, update_id=update_id))

    async def token_offset(self, stream_id: str) -> int:
        """Where the stream's token log ends now."""
        return await self.handle(stream_id).query(MambaStreamWorkflow.token_offset)

    async def reset(self, stream_id: str, principal: str, *, epoch: int | None = None, revoke: bool = False) -> None:
        """Signal a reset. A signing client names the epoch it begins (the current one + 1 unless
        given), so the signed signal cannot be replayed to reset the stream again. `revoke`: also
        delete every checkpoint of the earlier epochs, pinned ones included (default: they survive,
        and receipts handed out before the reset still resume them)."""
        if epoch is None and self.signer is not None:
            epoch = (await self.stats(stream_id)).epoch + 1
        req = self.sign("reset", stream_id, ResetRequest(principal=principal, epoch=epoch, revoke=revoke))
        send = lambda: self.handle(stream_id).signal(MambaStreamWorkflow.reset, req)  # noqa: E731
        # A reset that names its epoch is refused when it arrives twice, so it may be sent again;
        # one that does not could reset twice.
        await (self._retrying(send) if epoch is not None else send())
        self._epochs.pop(stream_id, None)  # the next chunk asks the stream for its epoch

    async def rewind(self, stream_id: str, to_seq: int, *, reason: str = "") -> str:
        """Rewind the stream to just after chunk `to_seq` (0: just after it opened): a Temporal
        reset of its current run to the first workflow task after that chunk committed, with the
        later chunks and signals not reapplied. The next chunk continues from chunk `to_seq`'s
        checkpoint, with the same outputs and checksum as a fresh stream fed the same tokens.
        Returns the new run's id.

        A rewind reaches any chunk of the stream's window (its newest `checkpoints_kept`
        checkpoints), and a rewind after a rewind any chunk of the new window: the chunks a rewind
        undoes do not count against it (`StreamOptions.checkpoints_kept` says what that costs).

        Raises:
            RewindPastWindow: chunk `to_seq` is outside the window; nothing was reset. (A chain of
                three or more rewinds back may still reach a chunk whose checkpoint an undone
                line deleted: its next chunk fails `RewindPastWindow`; send a reset.)
            RewindUnavailable: chunk `to_seq` is not in the current run (never committed, or
                before a continue-as-new), or no clean point follows it.
        """
        run_id, point, key = await self._locate(stream_id, to_seq)
        window = await self.client.get_workflow_handle_for(
            MambaStreamWorkflow.run, stream_id, run_id=run_id).query(MambaStreamWorkflow.rewind_window)
        if key not in window:
            raise RewindPastWindow(f"chunk {to_seq} is outside the stream's rewind window (its newest {len(window)} "
                                   f"checkpoints); nothing was reset", chunk_seq=to_seq, window=len(window))
        if point is None:
            return run_id  # chunk `to_seq` is the last thing that happened: already there
        resp = await self.client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
            namespace=self.client.namespace, workflow_execution=WorkflowExecution(workflow_id=stream_id, run_id=run_id),
            reason=reason or f"mamba-stream rewind to chunk {to_seq}", workflow_task_finish_event_id=point,
            request_id=uuid.uuid4().hex,
            reset_reapply_exclude_types=[ResetReapplyExcludeType.RESET_REAPPLY_EXCLUDE_TYPE_SIGNAL,
                                         ResetReapplyExcludeType.RESET_REAPPLY_EXCLUDE_TYPE_UPDATE]))
        self._epochs.pop(stream_id, None)
        return resp.run_id

    async def rewind_point(self, stream_id: str, to_seq: int) -> tuple[str, int | None]:
        """(current run id, the id of the first WorkflowTaskCompleted event after chunk `to_seq`
        committed; None when nothing followed it): where `rewind` resets to, for an operator who
        runs `temporal workflow reset --event-id` by hand (no window check: a raw reset past the
        window leaves a run whose next chunk fails `RewindPastWindow`)."""
        run_id, point, _ = await self._locate(stream_id, to_seq)
        return run_id, point

    async def _locate(self, stream_id: str, to_seq: int) -> tuple[str, int | None, str]:
        """`rewind_point`, and the state key chunk `to_seq` committed."""
        desc = await self.handle(stream_id).describe()
        run_id = desc.run_id
        events = [e async for e in self.client.get_workflow_handle(stream_id, run_id=run_id).fetch_history_events()]
        decode = self.client.data_converter.decode
        committed: int | None = None  # the event after which chunk `to_seq` is committed
        key = ""  # the state key it committed
        open_scheduled: set[int] = set()
        point: int | None = None
        for e in events:
            if committed is None:
                if to_seq == 0:
                    if e.HasField("activity_task_scheduled_event_attributes") and \
                            e.activity_task_scheduled_event_attributes.activity_type.name == ACTIVITY_OPEN:
                        open_scheduled.add(e.event_id)
                    elif e.HasField("activity_task_completed_event_attributes") and \
                            e.activity_task_completed_event_attributes.scheduled_event_id in open_scheduled:
                        committed = e.event_id
                        [value] = await decode(e.activity_task_completed_event_attributes.result.payloads)
                        key = _state_key(value)
                elif e.HasField("workflow_execution_update_completed_event_attributes"):
                    outcome = e.workflow_execution_update_completed_event_attributes.outcome
                    if outcome.HasField("success") and outcome.success.payloads:
                        [value] = await decode(outcome.success.payloads)
                        if isinstance(value, dict) and value.get("chunk_seq") == to_seq and "backend" in value \
                                and not value.get("duplicate"):
                            committed = e.event_id
                            key = _state_key(value)
                continue
            if e.HasField("workflow_execution_update_accepted_event_attributes"):
                accepted = e.workflow_execution_update_accepted_event_attributes.accepted_request.input
                args = accepted.args
                if accepted.name in ("advance", "generate") and args.payloads:
                    [value] = await decode(args.payloads)
                    if isinstance(value, dict) and isinstance(value.get("chunk_seq"), int) and value["chunk_seq"] > to_seq:
                        raise RewindUnavailable(f"chunk {value['chunk_seq']} was admitted before chunk {to_seq} "
                                                f"had a workflow task of its own", chunk_seq=to_seq)
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                point = e.event_id
                break
        if committed is None:
            raise RewindUnavailable(f"chunk {to_seq} is not committed in the stream's current run {run_id} (never "
                                    f"committed, or before a continue-as-new)", chunk_seq=to_seq)
        return run_id, point, key

    async def checkpoint(self, stream_id: str, principal: str) -> CheckpointResult:
        req = self.sign("checkpoint", stream_id, CheckpointRequest(principal=principal))
        return await self._update(self.handle(stream_id), MambaStreamWorkflow.checkpoint, req,
                                  id=f"checkpoint-{uuid.uuid4().hex}")

    async def receipt(self, stream_id: str) -> Receipt | None:
        return await self._query(stream_id, MambaStreamWorkflow.receipt)

    async def stats(self, stream_id: str) -> StreamStats:
        return await self._query(stream_id, MambaStreamWorkflow.stats)

    async def cancel(self, stream_id: str, *, wait: bool = True) -> None:
        """Cancel the stream; with `wait`, return once it has disposed of its state and ended."""
        h = self.handle(stream_id)
        await h.cancel()
        if wait:
            try:
                await h.result()
            except Exception:  # noqa: BLE001 - a cancelled run ends in WorkflowFailureError
                pass


class GenerateStream:
    """A generate chunk's tokens as they are sampled (`StreamClient.generate_stream`).

    Iterating starts the chunk and yields its `TokenEvent`s: the tokens in order, each once, the
    last one `done` (a `restart` one replaces what came before it). Afterwards `result` is the
    chunk's GenerateResult; a failed chunk raises as `generate` would.
    """

    def __init__(self, client: StreamClient, stream_id: str, principal: str, args: dict[str, Any],
                 chunk_seq: int | None, attempt: int) -> None:
        self._client, self.stream_id, self.principal = client, stream_id, principal
        self._args, self.chunk_seq, self._attempt = args, chunk_seq, attempt
        self.result: GenerateResult | None = None

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        c, sid = self._client, self.stream_id
        if self.chunk_seq is None:
            self.chunk_seq = await c.next_seq(sid)
        seq, handle = self.chunk_seq, c.handle(sid)
        req = c.sign("generate", sid, GenerateRequest(principal=self.principal, chunk_seq=seq, stream=True,
                                                      **self._args))
        epoch = c._epochs.get(sid)
        for resend in (False, True):
            if epoch is None or resend:
                epoch = (await c._position(sid))[1]
            # the update's own entries: found by its id, from wherever the log starts (no offset to ask for)
            uid = update_id("generate", req, epoch=epoch, attempt=self._attempt)
            work = asyncio.ensure_future(handle.execute_update(MambaStreamWorkflow.generate, req, id=uid))
            reader = c.tokens(sid, update_id=uid).__aiter__()
            seen, nxt, offset, again = 0, None, 0, False
            try:
                while True:
                    nxt = asyncio.ensure_future(reader.__anext__())
                    await asyncio.wait({nxt, work}, return_when=asyncio.FIRST_COMPLETED)
                    if nxt.done():
                        try:
                            ev = nxt.result()
                        except StopAsyncIteration:
                            break
                        offset, seen = ev.offset + 1, seen + len(ev.tokens)
                        yield ev
                        if ev.done:
                            break
                        continue
                    await _drop(nxt)
                    try:
                        self.result = work.result()  # a refused or failed chunk raises here
                    except WorkflowUpdateFailedError as err:
                        if not resend and seen == 0 and isinstance(err.cause, ApplicationError) and \
                                err.cause.type == "EpochMismatch":
                            again = True  # reset since this client last looked: once more, under the new epoch
                            break
                        raise
                    # its last entry was logged in the workflow task that answered it
                    rest = await c.read_tokens(sid, from_offset=offset, update_id=uid)
                    done = False
                    for ev in rest.events:
                        yield ev
                        done = done or ev.done
                    if not done:  # an answer older than the log's window
                        r = self.result
                        yield TokenEvent(offset=-1, chunk_seq=seq, epoch=r.receipt.epoch, tokens=r.tokens,
                                         text=r.text, done=True, finish_reason=r.finish_reason, restart=seen > 0,
                                         update_id=uid)
                    break
                if again:
                    continue
                if self.result is None:  # the chunk's last entry came before its answer
                    self.result = await work
                c._epochs[sid] = self.result.receipt.epoch
                return
            finally:
                if nxt is not None:
                    await _drop(nxt)
                if not work.done():
                    await _drop(work)
                await reader.aclose()


def _state_key(value: Any) -> str:
    """The state key of a decoded result that carries a receipt (a chunk's, the open's)."""
    receipt = value.get("receipt") if isinstance(value, dict) else None
    return str(receipt.get("state_key", "")) if isinstance(receipt, dict) else ""


async def _drop(task: asyncio.Future) -> None:
    """Cancel a task whose outcome no one reads any more, and let it finish (a poll cut short ends
    in an RPC error, not a cancellation)."""
    if not task.done():
        task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()
