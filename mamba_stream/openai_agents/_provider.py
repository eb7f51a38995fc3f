"""MambaModelProvider: the OpenAI Agents SDK's model provider for the worker's streams.

    OpenAIAgentsPlugin(model_provider=MambaModelProvider(),
                       model_params=ModelActivityParameters(start_to_close_timeout=timedelta(minutes=5)))

in a worker that also has `MambaStreamPlugin`. An agent names a model by its id (a preset,
or an `id=/dir` entry of MAMBA_STREAM_MODELS); each of its model calls is a turn of a
conversation stream (`mamba_stream.conversations`): the response id is a sealed handle to the
stream's state after the turn, and with `previous_response_id` (`Runner.run(...,
previous_response_id=...)` or `auto_previous_response_id=True`) a call feeds only its new items.
The agent workflow is started with `**conversation_start(client, principal)`.

Settings are mapped onto `generate` (docs/agents.md); one this model cannot honour is refused,
typed `InvalidRequest` naming it, before anything moves: never ignored.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

from agents import Handoff, Model, ModelProvider, ModelResponse, ModelSettings, ModelTracing, Tool, Usage
from agents.agent_output import AgentOutputSchemaBase
from agents.items import TResponseInputItem, TResponseStreamEvent
from agents.tool import FunctionTool
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
)
from temporalio import activity

from mamba_stream.conversations import Conversations, Turn, activity_failures, reply_end, tool_schema
from mamba_stream.failures import InvalidRequest, application_error
from mamba_stream.workflows import DEFAULT_TASK_QUEUE, StreamOptions

__all__ = ["DEFAULT_MAX_TOKENS", "MambaAgentModel", "MambaModelProvider"]

#: a reply's length when the agent's settings give no max_tokens
DEFAULT_MAX_TOKENS = 256
#: `ModelSettings.extra_args` this model takes: generate's settings the SDK has no field for
EXTRA_ARGS = ("seed", "top_k", "min_p", "repetition_penalty", "logit_bias")
#: settings that change what a model computes, which a stream cannot honour (None: unset)
_REFUSED = ("reasoning", "verbosity", "top_logprobs", "truncation", "prompt_cache_retention", "context_management",
            "response_include", "extra_query", "extra_body", "extra_headers", "prompt_cache_options")


def _settings(ms: ModelSettings, default_max: int) -> tuple[int, dict[str, Any], bool, list[str] | None]:
    """(max_tokens, generate's settings, whether tool calls are parsed, the tools one of which
    the reply must call: None where it may answer freely, [] for any) from the agent's settings.

    Raises:
        InvalidRequest: a setting this model cannot honour (its name in `field`).
    """
    for name in _REFUSED:
        if getattr(ms, name, None) is not None:
            raise InvalidRequest(f"model setting {name!r} cannot be honoured by a Mamba stream", field=name)
    if ms.parallel_tool_calls is False:
        raise InvalidRequest("parallel_tool_calls=False cannot be honoured yet (a reply may hold several calls)",
                             field="parallel_tool_calls")
    choice = ms.tool_choice
    must: list[str] | None = None
    if choice == "required":
        must = []  # any of the agent's tools: the caller has their names
    elif isinstance(choice, str) and choice not in ("auto", "none"):
        must = [choice]
    elif choice is not None and not isinstance(choice, str):
        name = getattr(choice, "name", None)
        if not isinstance(name, str):
            raise InvalidRequest(f"tool_choice {choice!r} names no function tool", field="tool_choice")
        must = [name]
    out: dict[str, Any] = {}
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        value = getattr(ms, name)
        if value is not None:
            out[name] = value
    for name, value in (ms.extra_args or {}).items():
        if name not in EXTRA_ARGS:
            raise InvalidRequest(f"extra_args {name!r} is not a setting of this model (it takes "
                                 f"{', '.join(EXTRA_ARGS)})", field="extra_args")
        out[name] = {int(k): float(v) for k, v in value.items()} if name == "logit_bias" else value
    max_tokens = ms.max_tokens if ms.max_tokens is not None else default_max
    return max_tokens, out, choice != "none", must


def _tools(tools: list[Tool], handoffs: list[Handoff]) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        if not isinstance(tool, FunctionTool):
            raise InvalidRequest(f"tool {getattr(tool, 'name', type(tool).__name__)!r} is a hosted tool: a Mamba "
                                 f"stream calls function tools only", field="tools")
        out.append(tool_schema(tool.name, tool.description, tool.params_json_schema))
    out.extend(tool_schema(h.tool_name, h.tool_description, h.input_json_schema) for h in handoffs)
    return out


def _message_id(caller: tuple[str, str, str]) -> str:
    """The reply message's item id: a digest of the model activity's identity, known before the
    turn runs (a streamed reply's first event names it) and the same on every retry."""
    return "msg_" + hashlib.sha256("|".join(caller).encode()).hexdigest()[:24]


def _output(turn: Turn, calls: bool, message_id: str) -> list[Any]:
    items: list[Any] = []
    calls = calls and bool(turn.reply.tool_calls)
    if _text(turn, calls) or not calls:
        items.append(ResponseOutputMessage(
            id=message_id, role="assistant", status="completed", type="message",
            content=[ResponseOutputText(text=_text(turn, calls), annotations=[], type="output_text")]))
    if calls:
        for cid, (name, args) in zip(turn.call_ids, turn.reply.tool_calls, strict=True):
            items.append(ResponseFunctionToolCall(arguments=args, call_id=cid, name=name, type="function_call",
                                                  id=f"fc_{cid[5:]}", status="completed"))
    return items


def _text(turn: Turn, calls: bool) -> str:
    """The reply message's text: without its tool calls where they are taken as calls."""
    return turn.reply.text if calls and turn.reply.tool_calls else turn.reply.body


class _Shown:
    """A reply's text as it is sampled, less what may yet turn out not to be text: from the
    first `<tool_call>` on (a call is shown as its item, when the turn ends), and any tail that
    could begin a call or the reply's end marker (held until the next piece says)."""

    CALL = "<tool_call>"

    def __init__(self, end: str) -> None:
        self.raw, self.sent, self.markers, self.cut = "", 0, tuple(m for m in (self.CALL, end) if m), False

    def feed(self, piece: str) -> str:
        """The text that may be shown now."""
        self.raw += piece
        if self.cut:
            return ""
        stops = [at for at in (self.raw.find(m, self.sent) for m in self.markers) if at >= 0]
        if stops:
            self.cut, upto = True, min(stops)
        else:
            hold = max((k for m in self.markers for k in range(1, len(m)) if self.raw.endswith(m[:k])), default=0)
            upto = len(self.raw) - hold
        out, self.sent = self.raw[self.sent:upto], max(self.sent, upto)
        return out

    @property
    def shown(self) -> str:
        return self.raw[:self.sent]


def _caller() -> tuple[str, str, str]:
    try:
        info = activity.info()
    except RuntimeError:
        raise InvalidRequest("a Mamba model runs inside the OpenAI Agents plugin's model activity") from None
    if info.is_local:
        raise InvalidRequest("a Mamba model needs a regular model activity (ModelActivityParameters("
                             "use_local_activity=False)): a local activity has no client", field="use_local_activity")
    return info.workflow_id or "", info.workflow_run_id or "", info.activity_id


class MambaAgentModel(Model):
    """One model of the worker's, as the OpenAI Agents SDK calls it (see the module docstring)."""

    def __init__(self, provider: MambaModelProvider, model_id: str) -> None:
        self.provider, self.model_id = provider, model_id

    async def _turn(self, system_instructions: str | None, input: str | list[TResponseInputItem],
                    model_settings: ModelSettings, tools: list[Tool], output_schema: AgentOutputSchemaBase | None,
                    handoffs: list[Handoff], previous_response_id: str | None, conversation_id: str | None,
                    prompt: Any, caller: tuple[str, str, str],
                    shown: Callable[[str], Awaitable[None]] | None = None) -> tuple[Turn, bool]:
        with activity_failures():
            output = None
            if output_schema is not None and not output_schema.is_plain_text():
                output = output_schema.json_schema()  # the reply's text held to it (or a tool called)
            if conversation_id is not None:
                raise InvalidRequest("conversation_id names an OpenAI-stored conversation: use previous_response_id "
                                     "(or auto_previous_response_id=True) with a Mamba model", field="conversation_id")
            if prompt is not None:
                raise InvalidRequest("a stored prompt is OpenAI's: give the agent its instructions", field="prompt")
            max_tokens, settings, calls, must = _settings(model_settings, self.provider.max_tokens)
            schemas = _tools(tools, handoffs)
            if must == []:  # "required": any of the agent's tools
                must = [t["function"]["name"] for t in schemas]
            if not calls and output is not None:
                must = []  # tool_choice "none": the structured output alone
            turn = await self.provider.conversations().turn(
                caller=caller, model_id=self.model_id, system=system_instructions,
                tools=schemas, items=input, previous=previous_response_id,
                max_tokens=max_tokens, settings=settings, call=must, output=output, shown=shown)
            return turn, calls

    async def get_response(self, system_instructions: str | None, input: str | list[TResponseInputItem],
                           model_settings: ModelSettings, tools: list[Tool],
                           output_schema: AgentOutputSchemaBase | None, handoffs: list[Handoff],
                           tracing: ModelTracing, *, previous_response_id: str | None,
                           conversation_id: str | None, prompt: Any) -> ModelResponse:
        with activity_failures():
            caller = _caller()
        turn, calls = await self._turn(system_instructions, input, model_settings, tools, output_schema, handoffs,
                                       previous_response_id, conversation_id, prompt, caller)
        n_out = len(turn.result.tokens)
        return ModelResponse(output=_output(turn, calls, _message_id(caller)), response_id=turn.response_id,
                             usage=Usage(requests=1, input_tokens=turn.fed_tokens, output_tokens=n_out,
                                         total_tokens=turn.fed_tokens + n_out))

    async def stream_response(self, system_instructions: str | None, input: str | list[TResponseInputItem],
                              model_settings: ModelSettings, tools: list[Tool],
                              output_schema: AgentOutputSchemaBase | None, handoffs: list[Handoff],
                              tracing: ModelTracing, *, previous_response_id: str | None,
                              conversation_id: str | None, prompt: Any) -> AsyncIterator[TResponseStreamEvent]:
        """The turn's events as it runs (the plugin publishes them to its streaming topic):
        created; the reply message added and its text deltas as the tokens are sampled (text
        only: a tool call is shown as its item when the turn ends); each output item done (the
        calls added and done); completed, with the response `get_response` returns."""
        with activity_failures():
            caller = _caller()
        message_id = _message_id(caller)
        pieces: asyncio.Queue[str | None] = asyncio.Queue()

        async def shown(text: str) -> None:
            pieces.put_nowait(text)

        with activity_failures():
            end = reply_end(self.provider.conversations().template(self.model_id))
        task = asyncio.create_task(self._turn(system_instructions, input, model_settings, tools, output_schema,
                                              handoffs, previous_response_id, conversation_id, prompt, caller,
                                              shown))
        task.add_done_callback(lambda _: pieces.put_nowait(None))
        base = dict(created_at=time.time(), model=self.model_id, object="response", tool_choice="auto", tools=[],
                    parallel_tool_calls=True)
        seq = 0

        def number() -> int:
            nonlocal seq
            seq += 1
            return seq

        def message(text: str, status: Literal["in_progress", "completed"]) -> ResponseOutputMessage:
            return ResponseOutputMessage(id=message_id, role="assistant", status=status, type="message",
                                         content=[ResponseOutputText(text=text, annotations=[], type="output_text")])

        def delta(text: str) -> ResponseTextDeltaEvent:
            return ResponseTextDeltaEvent(content_index=0, delta=text, item_id=message_id, logprobs=[],
                                          output_index=0, sequence_number=number(), type="response.output_text.delta")

        try:
            # until the turn's handle exists, the response is named by its message
            yield ResponseCreatedEvent(response=Response(id=f"resp_{message_id[4:]}", output=[], **base),
                                       sequence_number=0, type="response.created")
            live, started = _Shown(end), False
            while (piece := await pieces.get()) is not None:
                text = live.feed(piece)
                if text:
                    if not started:
                        started = True
                        yield ResponseOutputItemAddedEvent(item=message("", "in_progress"), output_index=0,
                                                           sequence_number=number(),
                                                           type="response.output_item.added")
                    yield delta(text)
            turn, calls = await task
        finally:
            if not task.done():
                task.cancel()
        output = _output(turn, calls, message_id)
        n_out = len(turn.result.tokens)
        for i, item in enumerate(output):
            if isinstance(item, ResponseOutputMessage):
                final = item.content[0].text
                if not started:
                    yield ResponseOutputItemAddedEvent(item=message("", "in_progress"), output_index=i,
                                                       sequence_number=number(), type="response.output_item.added")
                # what was not shown yet (a tail held back, text after a call); a shown piece is
                # never taken back: the exact backends sample once
                rest = final[len(live.shown):] if final.startswith(live.shown) else ""
                if rest:
                    yield delta(rest)
            else:
                yield ResponseOutputItemAddedEvent(item=item, output_index=i, sequence_number=number(),
                                                   type="response.output_item.added")
            yield ResponseOutputItemDoneEvent(item=item, output_index=i, sequence_number=number(),
                                              type="response.output_item.done")
        base["id"] = turn.response_id
        usage = {"input_tokens": turn.fed_tokens, "output_tokens": n_out, "total_tokens": turn.fed_tokens + n_out,
                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": 0}}
        yield ResponseCompletedEvent(response=Response(output=output, usage=usage, **base),
                                     sequence_number=number(), type="response.completed")


class MambaModelProvider(ModelProvider):
    """The worker's models for the OpenAI Agents SDK, by id (`get_model(name)`).

    Args:
        task_queue: the streams' task queue (the workers' MAMBA_STREAM_TASK_QUEUE).
        options: the conversations' streams' options (`Conversations`).
        templates: chat templates by model id, where a model's own is not the one to use.
        models: the models' sources, as MAMBA_STREAM_MODELS writes them (default: that variable).
        max_tokens: a reply's length where the agent's settings give none.
        default_model: the model of an agent that names none.
    """

    def __init__(self, *, task_queue: str = DEFAULT_TASK_QUEUE, options: StreamOptions | None = None,
                 templates: Mapping[str, Any] | None = None, models: str | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, default_model: str | None = None) -> None:
        self.task_queue, self.options, self.templates, self.models = task_queue, options, templates, models
        self.max_tokens, self.default_model = max_tokens, default_model
        self._conversations: dict[int, Conversations] = {}

    def conversations(self) -> Conversations:
        """The turns' driver over the running activity's Temporal client (one per client)."""
        client = activity.client()
        found = self._conversations.get(id(client))
        if found is None or found.client is not client:
            found = self._conversations[id(client)] = Conversations(
                client, task_queue=self.task_queue, options=self.options, templates=self.templates,
                models=self.models)
        return found

    def get_model(self, model_name: str | None) -> Model:
        name = model_name or self.default_model
        if not name:
            raise application_error(InvalidRequest("the agent names no model and the provider has no default_model",
                                                   field="model"))
        return MambaAgentModel(self, name)
