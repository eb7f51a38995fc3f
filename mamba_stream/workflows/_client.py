"""Client helpers: open streams with server-made ids, feed them with idempotent update ids."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, PendingWorkflowTaskState, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    DescribeTaskQueueRequest,
    ResetStickyTaskQueueRequest,
)
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.converter import WorkflowSerializationContext
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from mamba_stream.state_codec import ChunkSequenceMismatch, EpochMismatch, Receipt, stream_id_head, stream_tag
from mamba_stream.workflows._config import DEFAULT_TASK_QUEUE
from mamba_stream.workflows._failures import (
    ConflictingChunk,
    InvalidRequest,
    OpenFailed,
    RewindPastWindow,
    RewindUnavailable,
    StreamMoving,
    StreamOpening,
)
from mamba_stream.workflows._fairness import stream_priority
from mamba_stream.workflows._model_stream import check_prefix, generate_request
from mamba_stream.workflows._models import (
    PRINCIPAL_MEMO,
    READ_EVENTS,
    AdvanceRequest,
    AdvanceResult,
    CancelRequest,
    CheckpointRequest,
    CheckpointResult,
    GenerateRequest,
    GenerateResult,
    Grammar,
    OpenStreamInput,
    ReadTokensRequest,
    ReleaseRequest,
    ReleaseResult,
    ResetRequest,
    RewindRequest,
    StreamOptions,
    StreamStats,
    TokenBatch,
    TokenEvent,
    TokenProgress,
)
from mamba_stream.workflows._reader import GenerateStream, _drop, _Reader
from mamba_stream.workflows._stream import MambaStreamWorkflow
from mamba_stream.workflows.contract import ACTIVITY_GENERATE, ACTIVITY_OPEN, update_id

if TYPE_CHECKING:
    from mamba_stream.state_codec.signing import RequestSigner

__all__ = ["GenerateStream", "StreamClient", "conversation_start", "id_key", "new_stream_id", "transient"]

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
    retried, a query the worker's deadlock detector cut short, a stream moving to a new run
    (`StreamMoving`). A chunk's own failure, or a refusal,
    is never transient."""
    if isinstance(err, WorkflowUpdateRPCTimeoutOrCancelledError):
        return True
    if isinstance(err, WorkflowUpdateFailedError):
        # the stream moved to a new run before its time, with this request in flight or waiting
        # (nothing of it was committed, and the next run takes the same update id), or its new run
        # is still checking what it carried over
        return isinstance(err.cause, ApplicationError) and err.cause.type in (StreamMoving.reason,
                                                                               StreamOpening.reason)
    if isinstance(err, RPCError):
        if err.status in _TRANSIENT:
            return True
        if err.status == RPCStatusCode.FAILED_PRECONDITION and any(
                m in str(err) for m in ("failed state", "no poller seen")):
            return True
        # a query the stream's worker did not answer in time (its task expired in the queue)
        return err.status == RPCStatusCode.NOT_FOUND and "query task not found" in str(err)
    if isinstance(err, WorkflowQueryFailedError):
        # the worker's deadlock detector failed the activation that ran the query: it took over
        # 2 s (TMPRL1101: a long GC pause of a worker holding many streams, a saturated machine).
        # A query only reads: asked again, it is answered. Its own failures stay failures.
        return "_DeadlockError" in str(err) or "TMPRL1101" in str(err)
    return False

log = logging.getLogger(__name__)

#: how long `StreamClient.open` lets a stream wait for a worker to take it, by default: a worker that
#: polls the queue takes a new stream in milliseconds, even a loaded one in a few seconds
OPEN_WORKER_TIMEOUT_S = 10.0
#: `open`'s first look whether a worker took the stream, then twice as long each time up to the max
_TAKEN_POLL_S = 0.25
_TAKEN_POLL_MAX_S = 1.0


def new_stream_id(tag: str | None = None) -> str:
    """Unguessable, and valid as a store key prefix: `ms.<tag>.<32 hex>`, where the tag names the
    principal whose history key encrypts the stream's payloads without saying who it is
    (`state_codec.keyring`, `state_codec.payload.stream_principal`), or `ms-<32 hex>` (the master
    key's) without one."""
    return stream_id_head(tag) + uuid.uuid4().hex if tag else "ms-" + uuid.uuid4().hex


def _keyring(client: Client) -> Any:
    """The keyring of the client's payload codec (`state_codec.keyring.Keyring`), or None."""
    todo = [client.data_converter.payload_codec]
    while todo:
        codec = todo.pop()
        ring = getattr(codec, "keyring", None)
        if ring is not None and hasattr(ring, "principal_tag"):
            return ring
        todo.extend(getattr(codec, "codecs", ()))
    return None


def _principal_tag(client: Client, principal: str) -> str | None:
    """The principal's tag, from the keyring of the client's payload codec (None: no such codec,
    or a principal's keyring opening a stream for someone else)."""
    ring = _keyring(client)
    if ring is None:
        return None
    try:
        return ring.principal_tag(principal)
    except Exception:  # noqa: BLE001 - KeyringError: not this keyring's principal
        return None


def id_key(client: Client, stream_id: str) -> bytes:
    """The key of a stream's update ids (`Keyring.id_key`), from the client's keyring. Raises
    LookupError when it holds none for the stream (no keyring, another principal's stream)."""
    ring = _keyring(client)
    if ring is None:
        raise LookupError("the client has no keyring (a payload codec of MambaStreamPlugin): it cannot name "
                          "a stream's updates, nor seal them")
    try:
        return ring.id_key(stream_tag(stream_id))
    except Exception as exc:  # UnknownKeyId: another principal's stream
        raise LookupError(f"this client's keyring holds no key for stream {stream_id}: {exc}") from exc


def conversation_start(client: Client, principal: str) -> dict[str, Any]:
    """The keyword arguments that start an agent workflow whose model is a stream, for
    `principal`: `client.execute_workflow(Agent.run, arg, task_queue=..., **conversation_start(
    client, "alice"))`. Its id names the principal's tag (its payloads are sealed under the
    principal's history key) and its memo (`PRINCIPAL_MEMO`) the principal, sealed by this
    client's keyring: the workers take the conversation's principal from there, never from its
    text (`mamba_stream.conversations`).

    Raises:
        InvalidRequest: the client has no keyring (a `MambaStreamPlugin`) for `principal`.
    """
    tag = _principal_tag(client, principal)
    if tag is None:
        raise InvalidRequest(f"this client holds no keyring for principal {principal!r} (connect it with "
                             f"MambaStreamPlugin and the principal's or the workers' keyring)", field="principal")
    sid = new_stream_id(tag)
    return {"id": sid, "memo": {PRINCIPAL_MEMO: principal}, "priority": stream_priority(sid)}


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
        self._last_seq: dict[str, int] = {}  # stream -> the last chunk_seq this client sent or saw committed
        self._seq_locks: dict[str, asyncio.Lock] = {}  # stream -> held while a chunk naming no sequence is sent
        self._id_keys: dict[str, bytes] = {}  # stream -> the key of its update ids

    async def _retrying(self, call: Callable[[], Awaitable[T]], stream_id: str | None = None) -> T:
        """`call()`, sent again with backoff while it fails transiently, for up to `retry_s`."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.retry_s, 0.05
        while True:
            try:
                return await call()
            except (RPCError, WorkflowUpdateRPCTimeoutOrCancelledError, WorkflowUpdateFailedError,
                    WorkflowQueryFailedError) as err:
                # the SDK turns a cancelled update call into WorkflowUpdateRPCTimeoutOrCancelledError,
                # which is transient: sent again, the caller's cancellation (a Ctrl-C, a wait_for
                # that expired) would be lost and the call would go on forever
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError() from err
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
        with contextlib.suppress(RPCError):  # the next attempt says what is wrong, if anything still is
            await self.client.workflow_service.reset_sticky_task_queue(ResetStickyTaskQueueRequest(
                namespace=self.client.namespace, execution=WorkflowExecution(workflow_id=stream_id)))

    async def _update(self, handle: WorkflowHandle, update: Any, *args: Any, id: str) -> Any:
        return await self._retrying(lambda: handle.execute_update(update, *args, id=id), handle.id)

    async def _query(self, stream_id: str, query: Any, *args: Any) -> Any:
        return await self._retrying(lambda: self.handle(stream_id).query(query, *args), stream_id)

    def sign(self, kind: str, stream_id: str, request):  # any signed request model
        """`request` with its signature, when this client signs (unchanged otherwise)."""
        if self.signer is None:
            return request
        return request.model_copy(update={"signature": self.signer.sign(kind, stream_id, request.claims())})

    def update_id(self, kind: str, stream_id: str, request: AdvanceRequest | GenerateRequest, epoch: int,
                  attempt: int = 0) -> str:
        """`update_id` of a chunk of `stream_id`, keyed by this client's key for it (`id_key`)."""
        key = self._id_keys.get(stream_id)
        if key is None:
            key = self._id_keys[stream_id] = id_key(self.client, stream_id)
        return update_id(kind, request, epoch=epoch, key=key, attempt=attempt)

    def handle(self, stream_id: str) -> WorkflowHandle:
        return self.client.get_workflow_handle_for(MambaStreamWorkflow.run, stream_id)

    def new_id(self, principal: str) -> str:
        """A new stream id for `principal` (`new_stream_id`, tagged from this client's keyring):
        the id to start a workflow that owns a `ModelStream` under, so that its payloads are
        sealed under the principal's history key and this client's readers open them."""
        return new_stream_id(_principal_tag(self.client, principal))

    async def open(self, principal: str, model_id: str, *, options: StreamOptions | None = None,
                   input_transform: str | None = None, resume: Receipt | None = None,
                   prefix: str | Sequence[int] | None = None,
                   stream_id: str | None = None, wait: bool = True,
                   worker_timeout_s: float | None = OPEN_WORKER_TIMEOUT_S) -> str:
        """Start a stream; returns its id (server-made unless given) once it is open.

        `prefix`: text (encoded by the model's input transform) or token ids the stream starts
        after: its first state is the prefix's, from the workers' prefix store when it holds the
        prefix or a shorter one of it (the stream's principal's own entries, or a shared prefix
        the operator declared), the rest computed once and stored for the next stream. The
        receipt's `origin` says how much came from the store; its checksum is that of a stream fed
        the prefix from position 0. Empty: an ordinary open.

        `worker_timeout_s`: with `wait`, how long the stream may wait for a worker to take it
        (to start its first workflow task) while no worker polls the task queue; None waits as
        long as a worker takes to come. Once a worker has it, or one polls the queue (a busy
        worker takes a new stream late), its opening is waited for however long it takes.

        Raises:
            ApplicationError: typed `ChunkTooLarge` (a prefix over `max_prefix_tokens` or
                `max_text_bytes`) or `InvalidRequest` (a prefix beside a resume), before anything starts.
            WorkflowFailureError: opening failed; its cause is typed by reason (a resume from an
                incompatible checkpoint: PrincipalMismatch, SchemaMismatch, ...; a prefix token
                outside the vocabulary: TokenOutOfRange).
            OpenFailed: no worker took the stream within `worker_timeout_s` and none polls the task
                queue; the stream was terminated, before any of it ran, so it leaves nothing
                behind. Its details name the `stream_id`, the `task_queue` and the `waited_s`.
        """
        sid = stream_id or self.new_id(principal)
        inp = self.sign("open", sid, OpenStreamInput(
            principal=principal, model_id=model_id, input_transform=input_transform, resume=resume,
            prefix=prefix if prefix is None or isinstance(prefix, str) else [int(t) for t in prefix],
            options=options or StreamOptions()))
        check_prefix(inp, inp.options)  # typed, before anything starts (the prefix would reach history)
        sent = False

        async def start() -> WorkflowHandle:
            nonlocal sent
            try:
                return await self.client.start_workflow(
                    MambaStreamWorkflow.run, inp,
                    id=sid, task_queue=self.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                    task_timeout=timedelta(seconds=inp.options.task_timeout_s), priority=stream_priority(sid),
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
                await self._ready(handle, worker_timeout_s)
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

    async def wait_open(self, stream_id: str, *, worker_timeout_s: float | None = OPEN_WORKER_TIMEOUT_S) -> None:
        """Wait until a stream started earlier (perhaps by another process, or by an earlier
        attempt of this one whose answer was lost) is open, as `open(wait=True)` does.

        Raises:
            WorkflowFailureError: the stream failed to open; its cause is typed by reason.
            OpenFailed: no worker took it within `worker_timeout_s` (it was terminated).
        """
        handle = self.handle(stream_id)
        try:
            await self._ready(handle, worker_timeout_s)
        except WorkflowUpdateFailedError:
            await handle.result()
            raise

    async def _ready(self, handle: WorkflowHandle, worker_timeout_s: float | None) -> None:
        """The `ready` update, while watching that a worker takes the stream: with none polling
        its task queue, the update would wait (and the SDK poll for it) forever. A stream no worker
        took is terminated when the wait ends unanswered, by the bound or by the caller's
        cancellation (a Ctrl-C): else it would wait Running, its id known to no one."""
        ready = asyncio.ensure_future(self._update(handle, MambaStreamWorkflow.ready, id="ready"))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        pause, taken = _TAKEN_POLL_S, False
        try:
            while True:
                # an open that a worker takes answers in tens of milliseconds: most opens never describe
                await asyncio.wait({ready}, timeout=pause)
                if ready.done():
                    ready.result()
                    return
                taken = await self._taken(handle)
                if taken:
                    await ready  # a worker has it: its open takes as long as it takes
                    return
                if worker_timeout_s is not None and loop.time() - t0 >= worker_timeout_s:
                    if not await self._polled():
                        break
                    # a worker polls the queue, busy: a loaded machine takes a new stream late, not never
                    worker_timeout_s = None
                pause = min(pause * 2, _TAKEN_POLL_MAX_S) if worker_timeout_s is None else \
                    min(pause * 2, _TAKEN_POLL_MAX_S, max(0.01, t0 + worker_timeout_s - loop.time()))
        except asyncio.CancelledError:
            if not taken:
                try:
                    if not await self._taken(handle):
                        await self._abandon(handle, "the open was cancelled before any worker took the stream")
                except RPCError as err:  # the caller's cancellation is what it raises, not this
                    log.warning("stream %s: its open was cancelled, and it could not be terminated: %s",
                                handle.id, err)
            raise
        finally:
            if not ready.done():
                await _drop(ready)
        waited = loop.time() - t0
        await self._abandon(handle, f"no worker took the stream within {worker_timeout_s:g} s (task queue "
                                    f"{self.task_queue!r})")
        raise OpenFailed(f"no worker took stream {handle.id} within {worker_timeout_s:g} s: none polls task queue "
                         f"{self.task_queue!r} (start one: `python worker.py`, with the same "
                         f"MAMBA_STREAM_TASK_QUEUE); the stream was terminated",
                         stream_id=handle.id, task_queue=self.task_queue, waited_s=round(waited, 3))

    async def _abandon(self, handle: WorkflowHandle, why: str) -> None:
        """Terminate a stream no worker has taken. Terminated, not cancelled: a cancel needs a
        worker to carry it out, and would leave the stream Running until one comes. No worker ran
        a task of it, so no state of it exists to dispose of (were one to take it in the instant
        between the check and the terminate, what it stored is an orphan `sweep_orphans` deletes)."""
        try:
            await handle.terminate(reason=why)
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:  # NOT_FOUND: it closed on its own meanwhile
                raise
        log.info("stream %s terminated: %s", handle.id, why)

    async def _polled(self) -> bool:
        """Whether a worker polled the stream's task queue for workflow tasks lately (the server
        lists the pollers it saw in the last minutes): with one there, a stream not taken yet waits
        its turn. (A worker that died in those minutes still counts: the open then waits as before.)"""
        try:
            # the legacy mode: it lists the pollers seen lately, also a busy worker's that stopped
            # polling while its task slots are full (the enhanced mode lists only polls in flight)
            desc = await self.client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace=self.client.namespace, task_queue=TaskQueue(name=self.task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW))
        except RPCError as err:  # no answer: do not guess that nobody polls
            log.warning("task queue %s could not be described: %s", self.task_queue, err)
            return True
        return len(desc.pollers) > 0

    async def _taken(self, handle: WorkflowHandle) -> bool:
        """Whether a worker has started a workflow task of the stream (or it closed: the `ready`
        update's answer says how), from `describe`."""
        desc = await handle.describe()
        if desc.status != WorkflowExecutionStatus.RUNNING:
            return True
        pending = desc.raw_description.pending_workflow_task
        # started, scheduled and nothing else yet: two events; a started or completed task adds more
        return desc.history_length > 2 or \
            pending.state == PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_STARTED

    async def next_seq(self, stream_id: str) -> int:
        """The chunk_seq a chunk sent now would take, from the stream (after its chunks in flight)."""
        return (await self._position(stream_id))[0]

    async def _position(self, stream_id: str) -> tuple[int, int]:
        """(the next chunk_seq, epoch), from the stream's stats."""
        st = await self.stats(stream_id)
        self._epochs[stream_id] = st.epoch
        return (st.next_seq if st.next_seq is not None else st.chunk_seq + 1), st.epoch

    async def _take_seq(self, stream_id: str, *, ask: bool = False) -> tuple[int, int, bool]:
        """(chunk_seq, epoch, guessed) for a chunk that names none: the one after the last this
        client sent or saw committed (no request: `guessed`), else (or `ask`) after the stream's
        own next, asked. Taken at once, so that this client's chunks sent together take
        consecutive sequences and the later ones wait in the stream behind the earlier."""
        last, epoch = self._last_seq.get(stream_id), self._epochs.get(stream_id)
        guessed = not ask and last is not None and epoch is not None
        if not guessed:
            nxt, epoch = await self._position(stream_id)
            last = nxt - 1 if ask else max(nxt - 1, self._last_seq.get(stream_id, 0))
        assert last is not None and epoch is not None
        self._last_seq[stream_id] = last + 1
        return last + 1, epoch, guessed

    def _seq_failed(self, stream_id: str, seq: int) -> None:
        """A chunk that names no sequence failed: the next one asks the stream where it is."""
        if self._last_seq.get(stream_id) == seq:
            del self._last_seq[stream_id]

    async def _chunk(self, kind: str, stream_id: str, make: Callable[[int], Any], update: Any,
                     chunk_seq: int | None, attempt: int) -> Any:
        """Send a chunk under its update id: one request when this client knows where the stream is.
        Once more, asking the stream, when the guess of a chunk that named no sequence was wrong
        (another client's chunks came between: `ChunkSequenceMismatch`, `ConflictingChunk`) or the
        stream was reset since this client last saw it (`EpochMismatch`); the stream refuses
        either, and nothing is stored. This client's chunks that name no sequence go to a stream
        one after another."""
        if chunk_seq is None:
            # one at a time per stream: the stream takes a chunk only as the next after those it
            # holds, and concurrent updates may reach it in any order
            async with self._seq_lock(stream_id):
                return await self._send_chunk(kind, stream_id, make, update, None, attempt)
        return await self._send_chunk(kind, stream_id, make, update, chunk_seq, attempt)

    def _seq_lock(self, stream_id: str) -> asyncio.Lock:
        lock = self._seq_locks.get(stream_id)
        if lock is None:
            lock = self._seq_locks[stream_id] = asyncio.Lock()
        return lock

    async def _send_chunk(self, kind: str, stream_id: str, make: Callable[[int], Any], update: Any,
                          chunk_seq: int | None, attempt: int) -> Any:
        handle = self.handle(stream_id)
        if chunk_seq is None:
            seq, epoch, guessed = await self._take_seq(stream_id)
        else:
            seq, guessed = chunk_seq, False
            epoch = self._epochs.get(stream_id)
            if epoch is None:
                epoch = (await self._position(stream_id))[1]
        try:
            req = self.sign(kind, stream_id, make(seq))
            try:
                out = await self._update(handle, update, req, id=self.update_id(kind, stream_id, req, epoch, attempt))
            except WorkflowUpdateFailedError as err:
                cause = err.cause.type if isinstance(err.cause, ApplicationError) else None
                if cause == EpochMismatch.reason:
                    if chunk_seq is None:
                        seq, epoch, _ = await self._take_seq(stream_id, ask=True)
                    else:
                        epoch = (await self._position(stream_id))[1]  # reset since we last looked: once more
                elif guessed and cause in (ChunkSequenceMismatch.reason, ConflictingChunk.reason):
                    seq, epoch, _ = await self._take_seq(stream_id, ask=True)
                else:
                    raise
                req = self.sign(kind, stream_id, make(seq))
                out = await self._update(handle, update, req, id=self.update_id(kind, stream_id, req, epoch, attempt))
        except asyncio.CancelledError:
            raise  # the chunk may be in flight still: the next takes the sequence after it
        except BaseException:
            if chunk_seq is None:
                self._seq_failed(stream_id, seq)
            raise
        self._epochs[stream_id] = out.receipt.epoch
        if out.chunk_seq > self._last_seq.get(stream_id, 0):
            self._last_seq[stream_id] = out.chunk_seq
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
                       chunk_seq: int | None = None, attempt: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                       frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       repetition_penalty: float = 1.0, logit_bias: Mapping[int, float] | None = None,
                       grammar: Grammar | None = None) -> GenerateResult:
        """Sample up to `max_tokens` tokens that advance the stream (seeded: derived from the
        stream and the chunk unless given), ending early at a `stop` text or the model's
        end-of-sequence token.

        temperature (0: greedy), top_k, top_p, min_p, frequency_penalty, presence_penalty,
        repetition_penalty, logit_bias (token id -> bias) and grammar (what the tokens must spell)
        are `GenerateRequest`'s fields: their defaults change nothing, and how each acts is in
        docs/lifecycle.md ("Sampling").

        Raises:
            ApplicationError: typed `InvalidRequest` whose `field` names a setting out of its
                range, before anything is sent.
            WorkflowUpdateFailedError: the stream refused or failed the chunk, typed by reason (a
                logit bias on a token outside the model's vocabulary: `InvalidRequest`, field
                `logit_bias`; a grammar that does not compile, field `grammar`); the stream has not
                moved.
        """
        settings = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed, stop=list(stop),
                        **_shaping(top_p, min_p, frequency_penalty, presence_penalty, repetition_penalty,
                                   logit_bias, grammar))
        generate_request(principal=principal, chunk_seq=chunk_seq or 1, **settings)  # typed, before anything
        return await self._chunk("generate", stream_id, lambda seq: generate_request(
            principal=principal, chunk_seq=seq, **settings), MambaStreamWorkflow.generate, chunk_seq, attempt)

    def generate_stream(self, stream_id: str, principal: str, max_tokens: int, *, temperature: float = 1.0,
                        top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                        chunk_seq: int | None = None, attempt: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                        frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                        repetition_penalty: float = 1.0, logit_bias: Mapping[int, float] | None = None,
                        grammar: Grammar | None = None) -> GenerateStream:
        """`generate`, its tokens read as they are sampled: `async for event in ...` yields the
        chunk's `TokenEvent`s in order (the last one `done`); then `.result` is its GenerateResult.
        The same chunk as `generate` with the same arguments: streaming decides how it is shown,
        never what is committed. A setting out of its range is refused here, typed (`generate`)."""
        settings = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed, stop=list(stop),
                        **_shaping(top_p, min_p, frequency_penalty, presence_penalty, repetition_penalty,
                                   logit_bias, grammar))
        generate_request(principal=principal, chunk_seq=chunk_seq or 1, stream=True, **settings)
        return GenerateStream(self, stream_id, principal, settings, chunk_seq, attempt)

    async def tokens(self, stream_id: str, *, from_offset: int = 0, chunk_seq: int | None = None,
                     update_id: str | None = None, max_events: int = READ_EVENTS) -> AsyncIterator[TokenEvent]:
        """The stream's generated tokens from log offset `from_offset` (of one chunk or update, if
        named), as they come: each token once, in order, across continue-as-new; ends when the
        stream is cancelled or closed.

        Committed generates come from the token log (the `read_tokens` query), one entry each; a
        streamed generate still running shows its tokens as its activity heartbeats them (read
        with `describe`), with the offset its entry will take, and its committed entry then
        brings the rest (or, `restart`, all of them again if they differ from those shown). A
        reader writes no history and holds no update: it follows the stream's history with a
        long-poll (an idle reader costs one request held by the server), queries the log when a
        generate has finished, and polls `describe` while a generate runs (every `POLL_MIN_S`
        while tokens flow, backing off to `POLL_MAX_S`). A reader that reconnects passes the
        offset of the last `done` event + 1 (or of an unfinished chunk's events, to see that
        chunk from its start). Entries older than the log's window
        (`StreamOptions.token_log_events`) are gone: reading starts at the oldest kept.
        `max_events`: the most entries one query returns (a read also stops at 512 KiB).
        """
        async for ev in _Reader(self, stream_id, from_offset, chunk_seq, update_id, max_events).events():
            yield ev

    async def read_tokens(self, stream_id: str, *, from_offset: int = 0, chunk_seq: int | None = None,
                          update_id: str | None = None, max_events: int = READ_EVENTS) -> TokenBatch:
        """What the token log holds from `from_offset` now (a query: no history), at most
        `max_events` entries; `more` says some were held back: read again from `next_offset`."""
        return await self._query(stream_id, MambaStreamWorkflow.read_tokens, ReadTokensRequest(
            from_offset=from_offset, chunk_seq=chunk_seq, update_id=update_id, max_events=max_events))

    async def token_offset(self, stream_id: str) -> int:
        """Where the stream's token log ends now."""
        return await self._query(stream_id, MambaStreamWorkflow.token_offset)

    async def progress(self, stream_id: str, desc: WorkflowExecutionDescription | None = None
                       ) -> TokenProgress | None:
        """The newest tokens of the stream's streamed generate running now (its activity's last
        heartbeat, from `describe`, or from `desc` when given), or None.

        Raises:
            ApplicationError: typed `UnknownKeyId` for a client without the stream's principal's
                key (the details are encrypted under it, as every payload of the stream).
        """
        # the client's codec: not in the workflow sandbox
        from mamba_stream.state_codec.payload import sealed_for_stream

        desc = desc or await self.handle(stream_id).describe()
        conv = None
        for pa in desc.raw_description.pending_activities:
            payloads = pa.heartbeat_details.payloads
            if pa.activity_type.name != ACTIVITY_GENERATE or len(payloads) != 1:
                continue
            if not sealed_for_stream(payloads[0], stream_id):
                # not from the workers: details anyone may write by the activity's id, in clear or
                # under another principal's key (`RecordActivityTaskHeartbeatById`)
                log.debug("stream %s: ignoring heartbeat details the workers did not write", stream_id)
                continue
            conv = conv or self.client.data_converter.with_context(
                WorkflowSerializationContext(namespace=self.client.namespace, workflow_id=stream_id))
            try:
                [got] = await conv.decode(payloads, [TokenProgress])
            except ApplicationError as err:
                if err.type == InvalidRequest.reason:
                    continue  # not a progress: a heartbeat of another shape
                raise
            return got
        return None

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
        self._epochs.pop(stream_id, None)  # the next chunk asks the stream for its epoch and sequence
        self._last_seq.pop(stream_id, None)

    async def rewind(self, stream_id: str, to_seq: int, *, principal: str | None = None,
                     timeout_s: float = 60.0) -> str:
        """Rewind the stream to just after chunk `to_seq` (0: just after it opened), as its
        principal (default: the stream's own, from its stats; sealed under this client's key, so
        only a client holding that principal's keys, or the operator, can). The stream moves to a
        new run that continues from chunk `to_seq`'s checkpoint, with the same outputs and
        checksum as a fresh stream fed the same tokens; returns the new run's id.

        A rewind reaches any chunk of the stream's window (its newest `checkpoints_kept`
        checkpoints), and a rewind after a rewind any chunk of the new window: the undone chunks'
        checkpoints are deleted and do not count against it.

        Raises:
            RewindPastWindow: chunk `to_seq` is outside the window; nothing was rewound.
            RewindUnavailable: chunk `to_seq` was never committed, or its checkpoint has no
                recorded receipt (written before rewinds recorded one).
        """
        if principal is None:
            principal = (await self.stats(stream_id)).principal
        before = (await self.handle(stream_id).describe()).run_id
        req = self.sign("rewind", stream_id, RewindRequest(principal=principal, to_seq=to_seq))
        try:
            await self._update(self.handle(stream_id), MambaStreamWorkflow.rewind, req,
                               id=f"rewind-{to_seq}-{uuid.uuid4().hex}")
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type in (RewindPastWindow.reason,
                                                                      RewindUnavailable.reason):
                cls = RewindPastWindow if cause.type == RewindPastWindow.reason else RewindUnavailable
                details = cause.details[0] if cause.details and isinstance(cause.details[0], dict) else {}
                raise cls(cause.message, **details) from err
            raise
        self._epochs.pop(stream_id, None)
        self._last_seq.pop(stream_id, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:  # the stream continues as new once the rewind's update is done
            run = (await self.handle(stream_id).describe()).run_id
            if run != before or loop.time() > deadline:
                return run
            await asyncio.sleep(0.05)

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
                    if isinstance(value, dict) and isinstance(value.get("chunk_seq"), int) \
                            and value["chunk_seq"] > to_seq:
                        raise RewindUnavailable(f"chunk {value['chunk_seq']} was admitted before chunk {to_seq} "
                                                f"had a workflow task of its own", chunk_seq=to_seq)
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                point = e.event_id
                break
        if committed is None:
            raise RewindUnavailable(f"chunk {to_seq} is not committed in the stream's current run {run_id} (never "
                                    f"committed, or before a continue-as-new)", chunk_seq=to_seq)
        return run_id, point, key

    async def checkpoint(self, stream_id: str, principal: str, *, at_seq: int | None = None) -> CheckpointResult:
        """A portable receipt of the stream's state now (or after chunk `at_seq`, one of its rewind
        window's; 0: the opened state), verified in the store and kept there until the stream is
        cancelled: `open(resume=)` continues from it in a new stream."""
        req = self.sign("checkpoint", stream_id, CheckpointRequest(principal=principal, at_seq=at_seq))
        return await self._update(self.handle(stream_id), MambaStreamWorkflow.checkpoint, req,
                                  id=f"checkpoint-{uuid.uuid4().hex}")

    async def fork(self, stream_id: str, at_seq: int | None = None, *, principal: str | None = None,
                   options: StreamOptions | None = None, new_stream_id: str | None = None) -> str:
        """A new stream of the same principal and model, from the stream's state after chunk
        `at_seq` (one of its rewind window's; None: its state now): for agents that branch (a tree
        search, a retry with another plan). The parent goes on unchanged: it keeps the checkpoint
        while the new stream opens from it, then releases it (`release`), so a thousand forks of one
        parent leave no thousand checkpoints behind. The new stream's receipt names its origin
        (`Receipt.origin`: the parent's stream id, chunk and checksum), and fed the same
        continuation it gives the parent's outputs and checksum. Returns the new stream's id.

        Raises:
            WorkflowUpdateFailedError: typed `RewindPastWindow` (the chunk left the parent's window),
                `RewindUnavailable` (not committed yet); nothing is opened.
        """
        if principal is None:
            principal = (await self.stats(stream_id)).principal
        point = await self.checkpoint(stream_id, principal, at_seq=at_seq)
        try:
            return await self.open(principal, point.receipt.model_id, resume=point.receipt, options=options,
                                   stream_id=new_stream_id)
        finally:  # opened or not, the parent need not keep it for this fork (each `checkpoint` call
            # holds it once; another caller's hold stays)
            await self.release(stream_id, point.receipt, principal=principal)

    async def release(self, stream_id: str, receipt: Receipt, *, principal: str | None = None) -> ReleaseResult:
        """The stream stops keeping a checkpoint it handed out (`checkpoint`): it leaves the store
        with the stream's next chunk, or as the rewind window moves on if it is still in it.

        Raises:
            WorkflowUpdateFailedError: typed `InvalidRequest` when the stream does not keep it.
        """
        if principal is None:
            principal = (await self.stats(stream_id)).principal
        req = self.sign("release", stream_id, ReleaseRequest(principal=principal, state_key=receipt.state_key))
        return await self._update(self.handle(stream_id), MambaStreamWorkflow.release, req,
                                  id=f"release-{uuid.uuid4().hex}")

    async def receipt(self, stream_id: str) -> Receipt | None:
        return await self._query(stream_id, MambaStreamWorkflow.receipt)

    async def stats(self, stream_id: str) -> StreamStats:
        return await self._query(stream_id, MambaStreamWorkflow.stats)

    async def cancel(self, stream_id: str, principal: str | None = None, *, wait: bool = True) -> None:
        """Cancel the stream as its principal (default: the stream's own, from its stats): the
        `cancel` signal, sealed under this client's key (a Temporal cancel request alone carries
        no key, and the stream refuses it), then the Temporal cancel request that ends its run as
        cancelled. With `wait`, return once it has disposed of its state and ended."""
        if principal is None:
            principal = (await self.stats(stream_id)).principal
        h = self.handle(stream_id)
        req = self.sign("cancel", stream_id, CancelRequest(principal=principal))
        await self._retrying(lambda: h.signal(MambaStreamWorkflow.cancel, req), stream_id)
        await self._retrying(h.cancel, stream_id)
        if wait:
            with contextlib.suppress(Exception):  # a cancelled run ends in WorkflowFailureError
                await h.result()


def _state_key(value: Any) -> str:
    """The state key of a decoded result that carries a receipt (a chunk's, the open's)."""
    receipt = value.get("receipt") if isinstance(value, dict) else None
    return str(receipt.get("state_key", "")) if isinstance(receipt, dict) else ""


def _shaping(top_p: float, min_p: float, frequency_penalty: float, presence_penalty: float,
             repetition_penalty: float, logit_bias: Mapping[int, float] | None,
             grammar: Grammar | None = None) -> dict[str, Any]:
    """generate's later settings as `GenerateRequest` fields (a bias mapping copied: the request is
    built again for a resend, from what the caller gave at the call; a grammar is frozen)."""
    return dict(top_p=top_p, min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                repetition_penalty=repetition_penalty, logit_bias=dict(logit_bias or {}), grammar=grammar)
