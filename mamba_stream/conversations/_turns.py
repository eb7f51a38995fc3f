"""Conversations: an agent framework's model calls as turns of a stream, each feeding only what
is new, exactly once.

A turn runs inside the framework's model activity, on a worker, as a client of the streams
(`StreamClient`, through the activity's own Temporal client): a conversation is an ordinary
`MambaStreamWorkflow`, listed, shown in the Temporal UI, sealed and swept like any other.

- Whose: the principal of the agent workflow that scheduled the activity. That workflow is
  started under an id naming the principal's tag and a memo naming the principal, both written
  by the principal's own keyring (`conversation_start`): the memo is read back with who sealed
  it, and a memo the principal's key did not seal, or a name whose tag the id does not show, is
  refused. Nothing in the conversation's text decides it.
- Where: the first turn opens a stream (from the longest stored prefix state of the principal:
  the system part, instructions and tool schemas, `first_turn`) and feeds the rest. A later turn
  opens its previous response's handle (`ResponseHandle`, sealed for the principal) and feeds
  the turn's new messages as the chat template renders them after it (`next_turn`). A handle
  older than the stream's head (an edited history, a retried branch) forks the stream there
  (`StreamClient.fork`), and so does a reply the template renders otherwise than it was sampled
  (at the state before the reply, which the template's rendering then extends).
- Exactly once: the stream ids a turn opens or forks are keyed digests of the activity's
  identity (workflow, run, activity id), and its two chunks name their sequence numbers: a retry
  of the activity, on any worker, finds the stream it opened and the chunks it sent, which the
  stream answers with their first results, and returns the same response.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

from mamba_stream.conversations._handles import ResponseHandle, open_handle, seal_handle
from mamba_stream.conversations._render import (
    ParsedReply,
    chat_messages,
    first_turn,
    next_turn,
    parse_reply,
    reply_end,
    reply_grammar,
)
from mamba_stream.failures import Failure, InvalidRequest, application_error
from mamba_stream.scan import ChatTemplate
from mamba_stream.state_codec import (
    SEALER_KEY,
    ChunkSequenceMismatch,
    PrincipalMismatch,
    SealerMismatch,
    stream_id_head,
    stream_tag,
)
from mamba_stream.workflows import (
    DEFAULT_TASK_QUEUE,
    PRINCIPAL_MEMO,
    AdvanceResult,
    ClientConfig,
    ConflictingChunk,
    GenerateResult,
    StreamClient,
    StreamOptions,
    id_key,
)

__all__ = ["CONVERSATION_CHECKPOINTS", "Conversations", "Turn", "activity_failures"]

log = logging.getLogger(__name__)

#: conversations' streams keep this many chunks to fork from (two a turn): an older handle forks
#: from up to eight turns back
CONVERSATION_CHECKPOINTS = 16


@contextlib.contextmanager
def activity_failures() -> Iterator[None]:
    """Where a turn runs in a framework's model activity: a typed failure of ours leaves as the
    activity's permanent `ApplicationError` (not retried), a stream's refusal as it was typed;
    anything else as it is (retried)."""
    try:
        yield
    except Failure as exc:
        raise application_error(exc) from None
    except WorkflowUpdateFailedError as exc:
        cause = exc.cause
        if isinstance(cause, ApplicationError):
            raise ApplicationError(cause.message, type=cause.type, non_retryable=cause.non_retryable) from None
        raise


@dataclasses.dataclass(frozen=True)
class Turn:
    """A turn's outcome: the reply, its handle (sealed: the framework's response id), the tokens
    the turn fed and sampled, and whether it forked the conversation."""

    response_id: str
    handle: ResponseHandle
    reply: ParsedReply
    call_ids: tuple[str, ...]
    fed_tokens: int
    result: GenerateResult

    @property
    def forked(self) -> bool:
        return self.handle.forked


def _keyed(key: bytes, label: str, n: int = 32) -> str:
    return hmac.new(key, label.encode(), hashlib.sha256).hexdigest()[:n]


def _failed_because(err: BaseException, *reasons: str) -> bool:
    cause = getattr(err, "cause", None)
    return isinstance(cause, ApplicationError) and cause.type in reasons


class Conversations:
    """Turns of conversations on the streams a Temporal client reaches (see the module docstring).

    Args:
        client: a client with the `MambaStreamPlugin` and the workers' keyring (the activity's).
        task_queue: the streams' task queue.
        options: the conversations' streams' options (default: a rewind window of
            `CONVERSATION_CHECKPOINTS`, the rest `StreamOptions`' defaults).
        templates: chat templates by model id; a model not named here takes its directory's
            (`MAMBA_STREAM_MODELS`' `id=/dir` entries) or, for a preset, the plain one.
        models: the models' sources as MAMBA_STREAM_MODELS writes them (default: that variable).
    """

    def __init__(self, client: Client, *, task_queue: str = DEFAULT_TASK_QUEUE, options: StreamOptions | None = None,
                 templates: Mapping[str, ChatTemplate] | None = None, models: str | None = None) -> None:
        self.streams = StreamClient(client, task_queue)
        self.client = client
        self.options = options or StreamOptions(checkpoints_kept=CONVERSATION_CHECKPOINTS)
        self._templates: dict[str, ChatTemplate] = dict(templates or {})
        spec = models if models is not None else ClientConfig().models
        self._sources = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            mid, _, src = item.partition("=")
            self._sources[mid.partition("#")[0].strip()] = src.partition("#")[0].strip()
        self._principals: OrderedDict[tuple[str, str], str] = OrderedDict()

    def template(self, model_id: str) -> ChatTemplate:
        """The model's chat template.

        Raises:
            InvalidRequest: the model is not served here (field "model").
            NoChatTemplate: its directory has none.
        """
        found = self._templates.get(model_id)
        if found is None:
            if model_id not in self._sources:
                raise InvalidRequest(f"model {model_id!r} is not served here; known: {sorted(self._sources)}",
                                     field="model")
            src = self._sources[model_id]
            found = ChatTemplate.from_directory(src) if src and Path(src).is_dir() else ChatTemplate.plain()
            self._templates[model_id] = found
        return found

    async def principal(self, workflow_id: str, run_id: str | None) -> str:
        """The principal of the agent workflow `workflow_id` (see the module docstring).

        Raises:
            PrincipalMismatch: its id names no principal, or not the one its memo names.
            SealerMismatch: its memo names none, or was not sealed by the principal's key.
        """
        cached = self._principals.get((workflow_id, run_id or ""))
        if cached is not None:
            return cached
        tag = stream_tag(workflow_id)
        if tag is None:
            raise PrincipalMismatch(f"agent workflow {workflow_id!r} names no principal: start it with "
                                    f"**conversation_start(client, principal)", field="workflow_id")
        desc = await self.client.get_workflow_handle(workflow_id, run_id=run_id).describe()
        raw = desc.raw_description.workflow_execution_info.memo.fields.get(PRINCIPAL_MEMO)
        if raw is None:
            raise SealerMismatch(f"agent workflow {workflow_id!r} has no {PRINCIPAL_MEMO!r} memo: start it with "
                                 f"**conversation_start(client, principal)", field="memo")
        codec = self.client.data_converter.payload_codec
        decoded = (await codec.decode([raw]))[0] if codec is not None else raw
        sealer = decoded.metadata.get(SEALER_KEY, b"").decode()
        if sealer != tag:
            raise SealerMismatch(f"agent workflow {workflow_id!r}: its principal memo was not sealed by the "
                                 f"principal's key", field="memo", expected=tag, actual=sealer or None)
        try:
            name = json.loads(decoded.data)
        except ValueError:
            name = None
        if not isinstance(name, str) or stream_tag(self.streams.new_id(name)) != tag:
            raise PrincipalMismatch(f"agent workflow {workflow_id!r}: its memo names another principal than its "
                                    f"id", field="memo")
        self._principals[(workflow_id, run_id or "")] = name
        while len(self._principals) > 4096:
            self._principals.popitem(last=False)
        return name

    async def turn(self, *, caller: tuple[str, str, str], model_id: str, system: str | None,
                   tools: Sequence[Mapping[str, Any]] | None, items: str | Sequence[Any],
                   previous: str | None, max_tokens: int, settings: Mapping[str, Any] | None = None,
                   history: Sequence[Mapping[str, Any]] | None = None, call: Sequence[str] | None = None,
                   output: Mapping[str, Any] | None = None,
                   shown: Callable[[str], Awaitable[None]] | None = None) -> Turn:
        """One turn: the new `items` fed after `previous` (a response id; None: a new
        conversation), then a reply sampled (`settings`: `StreamClient.generate`'s; a `stop` there
        adds stop texts to the template's reply end).

        `caller`: the model activity's (workflow id, run id, activity id). `history`: for a
        framework that sends the whole conversation, the chat messages before `items`; the
        handle then keeps the keyed digest of the conversation through the reply (`digest`),
        which the framework's next call is checked against. `call`, `output`: what the reply must
        spell (`reply_grammar`): a call of one of the named tools, or JSON of the schema (or a call
        of any tool, unless `call` is empty); None for both: free text. `shown`: told the reply's
        text as it is sampled (`StreamClient.generate_stream`: the same chunk, shown live); a
        piece shown is never taken back (the exact backends sample once), the reply is the Turn's.

        Raises:
            PrincipalMismatch, SealerMismatch: see `principal`; another principal's handle.
            InvalidRequest: a handle that does not open, or of another model; items the model
                cannot take.
            ChatTemplateError: the template cannot render the turn after the earlier ones.
            WorkflowUpdateFailedError, WorkflowFailureError: the stream refused or failed a chunk
                (typed by reason: `RewindPastWindow` for a handle older than the stream keeps).
        """
        workflow_id, run_id, _ = caller
        principal = await self.principal(workflow_id, run_id)
        tag = stream_tag(workflow_id)
        assert tag is not None  # `principal` refused an id without one
        key = id_key(self.client, workflow_id)
        template = self.template(model_id)
        stop = reply_end(template)
        # held to a grammar only where asked: a free reply's request keeps its ids
        grammar = reply_grammar(tools, stop, call=call, output=output)
        held = {"grammar": grammar} if grammar is not None else {}
        messages = chat_messages(items)
        ident = "|".join(caller)
        if previous is None:
            rendered = first_turn(template, system, tools, messages)
            sid = stream_id_head(tag) + _keyed(key, 'conversation|' + ident)
            await self._open(sid, principal, model_id, rendered.prefix)
            at, text, forked = 0, rendered.text, False
        else:
            h = open_handle(key, tag, previous)
            if h.model_id != model_id:
                raise InvalidRequest(f"previous_response_id is a response of model {h.model_id!r}, not {model_id!r}",
                                     field="model")
            reply = parse_reply(h.reply, stop)
            ids = self.call_ids(key, h)[:len(reply.tool_calls)]
            text, extends = next_turn(template, system, tools, h.reply, reply.message(ids), messages)
            sid, at, forked = h.stream_id, (h.seq if extends else h.fed_seq), not extends
        log.debug("turn %s: feeding %r after chunk %d of %s", ident, text, at, sid)
        advanced, sid, at, moved = await self._feed(sid, principal, at, text, ident, key, tag)
        sampling = dict(settings or {})
        stops = [stop, *sampling.pop("stop", ())]
        if shown is None:
            result = await self.streams.generate(sid, principal, max_tokens, chunk_seq=at + 2, stop=stops,
                                                 **sampling, **held)
        else:
            live = self.streams.generate_stream(sid, principal, max_tokens, chunk_seq=at + 2, stop=stops,
                                                **sampling, **held)
            async for event in live:
                # a restart (an approximate backend's retry sampled others) shows all again: the
                # pieces already shown stay, the Turn's reply is what was committed
                if event.text and not event.restart:
                    await shown(event.text)
            result = live.result
        handle = ResponseHandle(stream_id=sid, model_id=model_id, epoch=result.receipt.epoch, seq=result.chunk_seq,
                                fed_seq=advanced.chunk_seq, reply=result.text or "", forked=forked or moved)
        ids = self.call_ids(key, handle)
        reply = parse_reply(handle.reply, stop)
        if history is not None:
            told = [*history, *messages, reply.message(ids[:len(reply.tool_calls)])]
            handle = handle.model_copy(update={"digest": self.digest(workflow_id, system, told)})
        return Turn(response_id=seal_handle(key, tag, handle), handle=handle, reply=reply,
                    call_ids=ids[:len(reply.tool_calls)], fed_tokens=advanced.n_tokens, result=result)

    def digest(self, workflow_id: str, system: str | None, messages: Sequence[Mapping[str, Any]]) -> str:
        """The keyed digest of a conversation (its system text and chat messages, canonical JSON)
        under the id key of the workflow's principal: equal for the same conversation, and
        telling nothing of it to whoever lacks the key."""
        body = json.dumps([system or "", list(messages)], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return "hmac-sha256:" + hmac.new(id_key(self.client, workflow_id), b"conversation|" + body.encode(),
                                         hashlib.sha256).hexdigest()

    def open(self, workflow_id: str, response_id: str) -> ResponseHandle:
        """The handle a response id seals, for the principal the workflow's id names.

        Raises:
            PrincipalMismatch: another principal's (or the id names none); InvalidRequest: not
                a response id of these workers, or altered.
        """
        tag = stream_tag(workflow_id)
        if tag is None:
            raise PrincipalMismatch(f"agent workflow {workflow_id!r} names no principal", field="workflow_id")
        return open_handle(id_key(self.client, workflow_id), tag, response_id)

    @staticmethod
    def call_ids(key: bytes, handle: ResponseHandle) -> tuple[str, ...]:
        """The reply's tool calls' ids: keyed by its stream and chunk, the same on every retry."""
        return tuple(f"call_{_keyed(key, f'call|{handle.stream_id}|{handle.seq}|{i}', 24)}" for i in range(64))

    async def _open(self, sid: str, principal: str, model_id: str, prefix: str | None,
                    **kw: Any) -> None:
        """Open stream `sid`, or wait for it when an earlier attempt of the turn started it."""
        try:
            await self.streams.open(principal, model_id, options=self.options, prefix=prefix or None,
                                    stream_id=sid, **kw)
        except WorkflowAlreadyStartedError:
            await self.streams.wait_open(sid)

    async def _feed(self, sid: str, principal: str, at: int, text: str, ident: str, key: bytes, tag: str
                    ) -> tuple[AdvanceResult, str, int, bool]:
        """Feed `text` after chunk `at` of stream `sid`: there when that chunk is the stream's head
        (or this turn's own chunk already went there), else in a fork from it. Returns (the
        advance's result, the stream, the chunk fed after, whether it forked)."""
        try:
            return await self.streams.advance(sid, principal, text=text, chunk_seq=at + 1), sid, at, False
        except WorkflowUpdateFailedError as err:
            if not _failed_because(err, ConflictingChunk.reason, ChunkSequenceMismatch.reason):
                raise
        fid = stream_id_head(tag) + _keyed(key, 'fork|' + ident)
        try:
            await self.streams.fork(sid, at, principal=principal, options=self.options, new_stream_id=fid)
        except WorkflowAlreadyStartedError:
            await self.streams.wait_open(fid)
        log.info("conversation %s forked at chunk %d into %s", sid, at, fid)
        return await self.streams.advance(fid, principal, text=text, chunk_seq=1), fid, 0, True
