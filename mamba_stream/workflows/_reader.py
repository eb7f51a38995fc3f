"""How a client reads a stream's tokens: `GenerateStream` (a generate's tokens as they are sampled,
then its result) and the token log's reader behind `StreamClient.tokens`, both following the
stream's history and its activity's heartbeats (from `_client`, where `StreamClient` asks for them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import (
    GetWorkflowExecutionHistoryRequest,
)
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from mamba_stream.state_codec import ChunkSequenceMismatch, EpochMismatch
from mamba_stream.workflows._failures import (
    ConflictingChunk,
)
from mamba_stream.workflows._models import (
    PROGRESS_INTERVAL_S,
    READ_EVENTS,
    STREAM_WORKFLOW_TYPE,
    GenerateRequest,
    GenerateResult,
    TokenEvent,
    TokenProgress,
)
from mamba_stream.workflows._stream import MambaStreamWorkflow
from mamba_stream.workflows.contract import ACTIVITY_GENERATE

if TYPE_CHECKING:
    from mamba_stream.workflows._client import StreamClient

__all__ = ["FIRST_POLL_S", "POLL_MAX_S", "POLL_MIN_S", "GenerateStream"]


class GenerateStream:
    """A generate chunk's tokens as they are sampled (`StreamClient.generate_stream`).

    Iterating starts the chunk and yields its `TokenEvent`s: the tokens in order, each once, the
    last one `done` (a `restart` one replaces what came before it). While the chunk runs, its
    tokens come from its activity's heartbeats (`StreamClient.progress`); the last event comes
    from the update's result, the committed chunk. Afterwards `result` is the chunk's
    GenerateResult; a failed chunk raises as `generate` would.
    """

    def __init__(self, client: StreamClient, stream_id: str, principal: str, args: dict[str, Any],
                 chunk_seq: int | None, attempt: int) -> None:
        self._client, self.stream_id, self.principal = client, stream_id, principal
        self._args, self.chunk_seq, self._attempt = args, chunk_seq, attempt
        self.result: GenerateResult | None = None

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        if self.chunk_seq is not None:
            async for ev in self._events():
                yield ev
            return
        async with self._client._seq_lock(self.stream_id):  # as `StreamClient._chunk`: one at a time
            async for ev in self._events():
                yield ev

    async def _events(self) -> AsyncIterator[TokenEvent]:
        c, sid = self._client, self.stream_id
        named = self.chunk_seq is not None
        if named:
            guessed, epoch = False, c._epochs.get(sid)
        else:
            self.chunk_seq, epoch, guessed = await c._take_seq(sid)
        handle = c.handle(sid)
        ok = False
        try:
            for resend in (False, True):
                if epoch is None:
                    epoch = (await c._position(sid))[1]
                seq = self.chunk_seq
                req = c.sign("generate", sid, GenerateRequest(principal=self.principal, chunk_seq=seq, stream=True,
                                                              **self._args))
                uid = c.update_id("generate", sid, req, epoch, self._attempt)
                work = asyncio.ensure_future(c._update(handle, MambaStreamWorkflow.generate, req, id=uid))
                shown: _Shown | None = None
                pause, t0 = FIRST_POLL_S, asyncio.get_running_loop().time()
                try:
                    while True:
                        await asyncio.wait({work}, timeout=pause)
                        if work.done():
                            break
                        try:
                            got = await c.progress(sid)
                        except RPCError:
                            got = None  # between runs (continue-as-new): the update's answer decides
                        ev = None
                        if got is not None and got.update_id == uid:
                            if shown is None or shown.key != _key(got):
                                shown = _Shown(got)
                            ev = shown.live(got)
                        if ev is not None:
                            yield ev
                        if ev is not None:
                            pause = POLL_MIN_S
                        elif shown is not None or asyncio.get_running_loop().time() - t0 > _FIRST_WAIT_S:
                            pause = min(pause * _POLL_BACKOFF, POLL_MAX_S)
                    try:
                        self.result = work.result()  # a refused or failed chunk raises here
                    except WorkflowUpdateFailedError as err:
                        cause = err.cause.type if isinstance(err.cause, ApplicationError) else None
                        if resend or shown is not None:
                            raise
                        if cause == EpochMismatch.reason:  # reset since this client last looked: once more
                            if named:
                                epoch = None
                            else:
                                self.chunk_seq, epoch, _ = await c._take_seq(sid, ask=True)
                            continue
                        if guessed and cause in (ChunkSequenceMismatch.reason, ConflictingChunk.reason):
                            self.chunk_seq, epoch, _ = await c._take_seq(sid, ask=True)  # another's came between
                            continue
                        raise
                    r = self.result
                    last = TokenEvent(offset=shown.offset if shown is not None else -1, chunk_seq=seq,
                                      epoch=r.receipt.epoch, tokens=r.tokens, text=r.text, done=True,
                                      finish_reason=r.finish_reason, update_id=uid)
                    ok = True
                    c._epochs[sid] = r.receipt.epoch
                    if r.chunk_seq > c._last_seq.get(sid, 0):
                        c._last_seq[sid] = r.chunk_seq
                    yield shown.settle(last) if shown is not None else last
                    return
                finally:
                    if not work.done():
                        await _drop(work)
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the chunk may be in flight still: the next takes the sequence after it
        except BaseException:
            if not named and not ok and self.chunk_seq is not None:
                c._seq_failed(sid, self.chunk_seq)
            raise


#: a token reader's poll interval while tokens flow: the heartbeats' own pace (a shorter one finds
#: nothing new every other time, and each poll is a `describe`); it grows by _POLL_BACKOFF per
#: empty poll up to POLL_MAX_S. A reader shows tokens about 0.1-0.2 s after they are sampled.
POLL_MIN_S = PROGRESS_INTERVAL_S
POLL_MAX_S = 0.25
_POLL_BACKOFF = 1.5
#: a generate_stream's polls before its first token, for its first second: the first heartbeat
#: goes at once, and the caller waits for it (then they back off like the others)
FIRST_POLL_S = 0.05
_FIRST_WAIT_S = 1.0
#: failed calls in a row a reader of a running stream rides out (a continue-as-new: the next run
#: answers queries once its first workflow task is done)
_RPC_FAILURES = 10


def _key(p: TokenProgress | TokenEvent) -> tuple[int, int, str | None]:
    return p.epoch, p.chunk_seq, p.update_id


class _Shown:
    """What a reader has shown of one streamed generate from its progress: to go on from there,
    and to check the committed tokens against."""

    def __init__(self, p: TokenProgress) -> None:
        self.key = _key(p)
        self.offset = p.offset if p.offset is not None else -1
        self.tokens: list[int] = []
        self.text = ""
        # the progress left what was shown (the reader fell behind its window, or a retry sampled
        # other tokens): the rest comes with the committed entry
        self.behind = False

    def live(self, p: TokenProgress) -> TokenEvent | None:
        """The tokens of `p` not shown yet, as an event (None: nothing new)."""
        if self.behind or _key(p) != self.key:
            return None
        n, chars = len(self.tokens), len(self.text)
        end, text_end = p.start + len(p.tokens), p.text_start + len(p.text or "")
        if p.start > n or p.text_start > chars:
            self.behind = True  # what came in between is no longer in the progress
            return None
        k, tk = min(n, end), min(chars, text_end)
        if self.tokens[p.start:k] != p.tokens[: k - p.start] \
                or self.text[p.text_start:tk] != (p.text or "")[: tk - p.text_start]:
            self.behind = True
            return None
        new = p.tokens[n - p.start:]
        text = None if p.text is None else p.text[chars - p.text_start:]
        if not new and not text:
            return None
        self.tokens += new
        self.text += text or ""
        return TokenEvent(offset=self.offset, chunk_seq=p.chunk_seq, epoch=p.epoch, index=n, tokens=new, text=text,
                          update_id=p.update_id)

    def settle(self, ev: TokenEvent) -> TokenEvent:
        """The chunk's committed entry `ev`, less what was shown; all of it again (`restart`) if
        what was shown is not what was committed."""
        n = len(self.tokens)
        if n == 0 and not self.text:
            return ev
        if ev.error is not None and _key(ev) == self.key:
            return ev.model_copy(update={"index": n})  # failed: its readers are told, and stop
        if _key(ev) == self.key and ev.tokens[:n] == self.tokens and (ev.text or "").startswith(self.text):
            return ev.model_copy(update={"index": n, "tokens": ev.tokens[n:],
                                         "text": None if ev.text is None else ev.text[len(self.text):]})
        return ev.model_copy(update={"restart": True})


#: a reader's history long-poll: the server answers when the stream's history grows, or with
#: nothing after its own long-poll interval (20 s by default)
_LONG_POLL = timedelta(seconds=70)
#: the least time between two history reads of one reader that found events: a busy stream's
#: events are read in batches, at most 1 / _HISTORY_GAP_S reads a second per reader, however many
#: events a second the stream makes (each read wakes on the server and reads its store)
_HISTORY_GAP_S = 0.5
#: the update whose completion adds an entry to the token log
_GENERATE = "generate"
_CLOSING = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCELED, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
}
_ACTIVITY_ENDS = ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
                  "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes")


class _Reader:
    """`StreamClient.tokens`: follows the stream's history without writing to it (a long-poll of
    `GetWorkflowExecutionHistory`: an idle reader costs one request held by the server), reads the
    token log (the `read_tokens` query, answered by a worker) only when a generate has finished,
    and polls `describe` for a streamed generate's progress while one runs."""

    def __init__(self, client: StreamClient, stream_id: str, from_offset: int, chunk_seq: int | None,
                 update_id: str | None, max_events: int = READ_EVENTS) -> None:
        self.c, self.sid, self.offset = client, stream_id, from_offset
        self.chunk_seq, self.update_id, self.max_events = chunk_seq, update_id, max_events
        self.handle = client.handle(stream_id)
        self.run_id: str | None = None
        self.token = b""  # where this reader's history of the run ends (the server's page token)
        self.names: dict[str, str] = {}  # update id -> update name, accepted in this run
        self.live: int | None = None  # the scheduled event of a generate activity running now
        #: a workflow of another type than MambaStreamWorkflow, owning a `ModelStream`: it may generate in
        #: any update of its own or outside one, so the log is read after each of its workflow tasks
        #: (the log changes only in one)
        self.owner = False
        self.next_read = 0.0  # (event loop time) no history read before this
        self.shown: _Shown | None = None
        self._closed = False  # the last read said the stream is cancelled
        self.failures = 0

    async def events(self) -> AsyncIterator[TokenEvent]:
        # history first, then the log: a generate that finishes in between is in the history
        # that comes next, and read then
        running = await self._follow()
        for ev in await self._read(closing=not running):
            yield ev
        if not running or self._closed:
            return
        poll: asyncio.Future | None = None
        pause = POLL_MIN_S
        try:
            while True:
                if poll is None:
                    poll = asyncio.ensure_future(self._history())
                if self.live is not None:
                    await asyncio.wait({poll}, timeout=pause)
                    if not poll.done():
                        ev = await self._progress()
                        if ev is not None:
                            yield ev
                        pause = POLL_MIN_S if ev is not None else min(pause * _POLL_BACKOFF, POLL_MAX_S)
                        continue
                else:
                    await asyncio.wait({poll})
                try:
                    page = poll.result()
                except RPCError as err:
                    self._failed(err)
                    poll = None
                    await asyncio.sleep(0.05 * self.failures)
                    continue
                poll = None
                self.failures = 0
                read, over = self._take(page.history.events)
                self.token = page.next_page_token
                if over:
                    running, read = await self._follow(), True
                if read:
                    for ev in await self._read(closing=not running):
                        yield ev
                if not running or self._closed:
                    return
                pause = POLL_MIN_S
        finally:
            if poll is not None:
                await _drop(poll)

    async def _follow(self) -> bool:
        """Start on the stream's latest run: its history up to now; False if the stream is closed."""
        desc = await self._call(self.handle.describe)
        if desc.status != WorkflowExecutionStatus.RUNNING:
            return False
        self.run_id, self.token, self.names, self.live = desc.run_id, b"", {}, None
        self.owner = desc.workflow_type != STREAM_WORKFLOW_TYPE
        seen = 0
        while seen < desc.history_length:
            page = await self._call(lambda: self._page(False))
            self._take(page.history.events)
            self.token = page.next_page_token
            if not page.history.events or not self.token:
                break
            seen = page.history.events[-1].event_id
        return True

    async def _history(self) -> Any:
        """The run's next events, once there are some (or none, after the server's long-poll), no
        sooner than `_HISTORY_GAP_S` after the last read that found some."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, self.next_read - loop.time()))
        page = await self._page(True)
        if page.history.events:
            self.next_read = loop.time() + _HISTORY_GAP_S
        return page

    async def _page(self, wait: bool) -> Any:
        return await self.c.client.workflow_service.get_workflow_execution_history(
            GetWorkflowExecutionHistoryRequest(
                namespace=self.c.client.namespace,
                execution=WorkflowExecution(workflow_id=self.sid, run_id=self.run_id),
                next_page_token=self.token, wait_new_event=True, skip_archival=True),
            retry=not wait, timeout=_LONG_POLL if wait else None)

    def _take(self, events: Sequence[Any]) -> tuple[bool, bool]:
        """Track the run's updates and generate activities; (a generate finished, the run ended)."""
        read = over = False
        for e in events:
            if e.HasField("workflow_execution_update_accepted_event_attributes"):
                req = e.workflow_execution_update_accepted_event_attributes.accepted_request
                self.names[req.meta.update_id] = req.input.name
            elif e.HasField("workflow_execution_update_completed_event_attributes"):
                uid = e.workflow_execution_update_completed_event_attributes.meta.update_id
                read = read or self.names.get(uid) == _GENERATE
            elif e.HasField("activity_task_scheduled_event_attributes"):
                if e.activity_task_scheduled_event_attributes.activity_type.name == ACTIVITY_GENERATE:
                    self.live = e.event_id
            elif any(e.HasField(f) and getattr(e, f).scheduled_event_id == self.live for f in _ACTIVITY_ENDS):
                self.live = None
            elif e.HasField("workflow_task_completed_event_attributes"):
                read = read or self.owner
            elif e.event_type in _CLOSING:
                over = True
        return read, over

    async def _progress(self) -> TokenEvent | None:
        """The running generate's tokens this reader has not shown yet, if its entry is the next one
        it reads (else it is committed already, or before from_offset)."""
        try:
            got = await self.c.progress(self.sid)
        except RPCError:
            return None  # the history long-poll says what became of the stream
        if got is None or got.offset != self.offset or not self._wanted(got):
            return None
        if self.shown is None or self.shown.key != _key(got):
            self.shown = _Shown(got)
        return self.shown.live(got)

    async def _read(self, *, closing: bool = False) -> list[TokenEvent]:
        """The log's new entries (the query). `closing`: the stream is closed; a read no worker
        answers ends the reader with what it has."""
        out: list[TokenEvent] = []
        self._closed = closing
        while True:
            try:
                batch = await self._call(lambda: self.c.read_tokens(
                    self.sid, from_offset=self.offset, chunk_seq=self.chunk_seq, update_id=self.update_id,
                    max_events=self.max_events), give_up=closing)
            except (RPCError, WorkflowQueryFailedError):
                return out  # closed, and no worker answers for it: nothing more will come
            for ev in batch.events:
                if self.shown is not None and ev.offset >= self.shown.offset:
                    if ev.offset == self.shown.offset:
                        ev = self.shown.settle(ev)
                    self.shown = None
                out.append(ev)
            self.offset = batch.next_offset
            self._closed = closing or batch.closed
            if batch.closed or not batch.more:
                return out

    async def _call(self, fn: Callable[[], Any], *, give_up: bool = False) -> Any:
        """`fn()`, again after a failure while the stream exists (a continue-as-new in between: the
        next run answers queries once its first workflow task is done)."""
        while True:
            try:
                out = await fn()
                self.failures = 0
                return out
            except (RPCError, WorkflowQueryFailedError) as err:
                if give_up:
                    raise
                self._failed(err)
                await asyncio.sleep(0.05 * self.failures)

    def _wanted(self, p: TokenProgress) -> bool:
        return (self.chunk_seq is None or p.chunk_seq == self.chunk_seq) and \
            (self.update_id is None or p.update_id == self.update_id)

    def _failed(self, err: Exception) -> None:
        """Count a failed call; raise `err` after too many in a row, or when the stream does not exist."""
        self.failures += 1
        if self.failures > _RPC_FAILURES or (isinstance(err, RPCError) and err.status == RPCStatusCode.NOT_FOUND):
            raise err


async def _drop(task: asyncio.Future) -> None:
    """Cancel a task whose outcome no one reads any more, and let it finish (a poll cut short ends
    in an RPC error, not a cancellation)."""
    if not task.done():
        task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()
