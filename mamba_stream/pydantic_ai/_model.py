"""MambaModel: a Pydantic AI model whose requests are turns of a conversation stream.

    agent = Agent(MambaModel("tiny-mamba2"), name="assistant", tools=[...],
                  capabilities=[TemporalDurability(model_activity_config={...})])

in a workflow that lists the agent in `__pydantic_ai_agents__`, run by a worker whose client has
`PydanticAIPlugin()` then `MambaStreamPlugin(...)`, the workflow started with
`**conversation_start(client, principal)`. Each model request runs in Pydantic AI's model
activity as a turn of `mamba_stream.conversations`, exactly once per activity (a retried
activity answers the same response and feeds nothing twice).

Pydantic AI sends the whole conversation every request; the stream feeds only what it does not
hold yet. The latest response of this model in `messages` names the stream's state after it
(`provider_response_id`: a handle sealed for the conversation's principal), and its handle keeps
the keyed digest of the conversation up to it: when the messages up to it digest the same, only
the messages after it are fed. When they do not (an edited history), the latest earlier response
of this model whose digest does match is continued from instead (a fork: its stream goes on
unchanged), else a new conversation starts from the longest stored prefix state of the principal
(its system part). The principal is the agent workflow's (`Conversations.principal`), never the
messages': another principal's response in the history is refused, typed `PrincipalMismatch`,
before anything moves.

Settings map onto `StreamClient.generate` (`sampling`); one this model cannot honour is refused,
typed `InvalidRequest` naming it, never ignored. A reply that must call a tool (`tool_choice`
'required' or named tools; Pydantic AI's default 'tool' output mode, where text is not an
output) is held by a grammar to a call of one of them, its arguments to the tool's parameters;
the 'native' and 'prompted' output modes hold its text to the output's JSON schema (`_reply`).

This module is light (Pydantic AI and the workflow package): the agent, model included, is built
in the workflow's own module, which the workflow sandbox imports. The conversations' layer, which
loads the engine's chat templates, is imported where a request runs: in the activity.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import ModelMessage, ModelResponse, ModelResponsePart, TextPart, ToolCallPart
from pydantic_ai.models import CompletedStreamedResponse, Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.profiles import ModelProfile, ModelProfileSpec
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import RequestUsage
from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from mamba_stream.failures import InvalidRequest
from mamba_stream.pydantic_ai._messages import (
    PROVIDER_NAME,
    chat_form,
    message_items,
    response_message,
    system_part,
)
from mamba_stream.workflows import ClientConfig, StreamOptions

if TYPE_CHECKING:
    from pydantic_ai.tools import RunContext

    from mamba_stream.conversations import Conversations, ResponseHandle, Turn

__all__ = ["DEFAULT_MAX_TOKENS", "EXTRA_BODY", "MambaModel", "sampling"]

log = logging.getLogger(__name__)

#: a reply's length when the settings give no max_tokens (the OpenAI Agents provider's default)
DEFAULT_MAX_TOKENS = 256
#: `ModelSettings.extra_body` keys this model takes: generate's settings Pydantic AI has no field
#: for (where OpenAI-compatible servers such as vLLM take them too)
EXTRA_BODY = ("min_p", "repetition_penalty")
#: settings generate takes under the same name
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")
#: settings that change nothing a stream computes: Pydantic AI's own (timeouts, retries, framing,
#: tool choice, handled with the tools) and a provider's prompt cache (a stream is one)
_NEUTRAL = ("timeout", "request_timeout", "first_event_timeout", "framing_announcement", "max_retries", "cache",
            "tool_choice")
#: settings a stream cannot honour when set to anything but their off value
_REFUSED = ("thinking", "thinking_summary", "citations", "service_tier", "extra_headers")


def sampling(model_settings: Mapping[str, Any] | None, default_max: int) -> tuple[int, dict[str, Any]]:
    """(max_tokens, `StreamClient.generate`'s settings) from Pydantic AI's `ModelSettings`.

    `stop_sequences` become stop texts besides the template's reply end (a reply that meets one
    ends there, the stop text in its text: the stream holds it); `logit_bias` is by token id.

    Raises:
        InvalidRequest: a setting this model cannot honour, or one it does not know (its name in
            `field`).
    """
    ms = dict(model_settings or {})
    out: dict[str, Any] = {}
    for name, value in ms.items():
        if name in _SAMPLING:
            if value is not None:
                out[name] = value
        elif name == "logit_bias":
            try:
                out["logit_bias"] = {int(k): float(v) for k, v in (value or {}).items()}
            except (TypeError, ValueError):
                raise InvalidRequest("logit_bias maps token ids (integers) to biases", field="logit_bias") from None
        elif name == "stop_sequences":
            if value:
                out["stop"] = [str(s) for s in value]
        elif name == "extra_body":
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise InvalidRequest("extra_body must be a mapping of generate's settings", field="extra_body")
            for key, v in value.items():
                if key not in EXTRA_BODY:
                    raise InvalidRequest(f"extra_body {key!r} is not a setting of this model (it takes "
                                         f"{', '.join(EXTRA_BODY)})", field="extra_body")
                out[key] = v
        elif name in _REFUSED:
            if value not in (None, False, {}, ()):
                raise InvalidRequest(f"model setting {name!r} cannot be honoured by a Mamba stream", field=name)
        elif name == "parallel_tool_calls":
            if value is False:
                raise InvalidRequest("parallel_tool_calls=False cannot be honoured yet (a reply may hold several "
                                     "calls)", field="parallel_tool_calls")
        elif name not in (*_NEUTRAL, "max_tokens"):
            raise InvalidRequest(f"model setting {name!r} is not one this model knows", field=name)
    max_tokens = ms.get("max_tokens")
    return (int(max_tokens) if max_tokens is not None else default_max), out


def _reply(params: ModelRequestParameters, model_settings: Mapping[str, Any] | None
           ) -> tuple[list[dict[str, Any]], list[str] | None, dict[str, Any] | None]:
    """What the reply may and must be, as `Conversations.turn` takes it: (the tools' schemas it may
    call, as chat templates take them: the function tools the tool choice leaves, then the output
    tools; the tools one of which it must call, or None; the JSON schema its text must match, or
    None). A call is forced by `tool_choice` 'required' or a list of names, and where text output
    is not allowed (Pydantic AI's tool output); the 'native' and 'prompted' output modes hold the
    text to the output's schema (a tool may be called instead, unless `tool_choice` is 'none').

    Raises:
        InvalidRequest: image output, native (server-side) tools, a 'required' tool choice with no
            function tools.
    """
    from mamba_stream.conversations import tool_schema

    if params.output_mode == "image" or params.allow_image_output:
        raise InvalidRequest("a Mamba stream writes text: it cannot output images", field="output_mode")
    if params.native_tools:
        raise InvalidRequest("native (provider-side) tools cannot run on a Mamba stream: give the agent function "
                             "tools", field="native_tools")
    output = None
    if params.output_mode in ("native", "prompted"):
        obj = params.output_object
        output = dict(obj.json_schema) if obj is not None else {"type": "object"}
    choice = (model_settings or {}).get("tool_choice")
    functions = list(params.declared_function_tools)
    must: list[str] | None = None
    if choice in ("none", []):
        functions = []
        if output is not None:
            must = []  # the structured output alone
    elif choice == "required":
        must = [t.name for t in functions]
        if not must:
            raise InvalidRequest("tool_choice 'required' and the agent has no function tools", field="tool_choice")
    elif isinstance(choice, list | tuple):
        must = [str(name) for name in choice]
    elif choice not in (None, "auto"):  # ToolOrOutput: these function tools, and the output tools
        names = choice.get("function_tools") if isinstance(choice, Mapping) else getattr(choice, "function_tools", None)
        if names is None:
            raise InvalidRequest(f"tool_choice {choice!r} is not one this model knows", field="tool_choice")
        functions = [t for t in functions if t.name in set(names)]
    offered = [*functions, *params.output_tools]
    if must is None and not params.allow_text_output:  # tool output: the reply is a call
        must = [t.name for t in offered]
    return [tool_schema(t.name, t.description, t.parameters_json_schema) for t in offered], must, output


def _caller() -> tuple[str, str, str]:
    try:
        info = activity.info()
    except RuntimeError:
        raise InvalidRequest("a MambaModel runs inside Pydantic AI's Temporal model activity (an agent with "
                             "TemporalDurability, in a workflow)") from None
    if info.is_local:
        raise InvalidRequest("a MambaModel needs a regular model activity: a local activity has no client",
                             field="use_local_activity")
    return info.workflow_id or "", info.workflow_run_id or "", info.activity_id


class MambaModel(Model):
    """One model of the workers', as Pydantic AI calls it (see the module docstring).

    Args:
        model_id: the model's id on the workers (a preset such as "tiny-mamba2", or an `id=/dir`
            entry of MAMBA_STREAM_MODELS).
        task_queue: the streams' task queue (default: MAMBA_STREAM_TASK_QUEUE where the request
            runs, as the workers set it: the model is built in workflow code, which reads no
            environment, and runs on the workers).
        options: the conversations' streams' options (`Conversations`).
        templates: chat templates by model id, where a model's own is not the one to use.
        models: the models' sources, as MAMBA_STREAM_MODELS writes them (default: that variable).
        max_tokens: a reply's length where the settings give none.
        settings: default model settings (Pydantic AI's, merged under the agent's and the run's).
        profile: the model profile (default: Pydantic AI's, native output supported).
    """

    def __init__(self, model_id: str, *, task_queue: str | None = None, options: StreamOptions | None = None,
                 templates: Mapping[str, Any] | None = None, models: str | None = None,
                 max_tokens: int = DEFAULT_MAX_TOKENS, settings: ModelSettings | None = None,
                 profile: ModelProfileSpec | None = None) -> None:
        # a native output's schema holds the reply's text (a grammar), as a tool's holds a call
        super().__init__(settings=settings, profile=profile or ModelProfile(supports_json_schema_output=True))
        self._name, self.task_queue, self.options = model_id, task_queue, options
        self.templates, self.models, self.max_tokens = templates, models, max_tokens
        self._conversations: dict[int, Conversations] = {}

    @property
    def model_name(self) -> str:
        """The model's id on the workers (Pydantic AI's `model_id` is 'mamba-stream:<it>')."""
        return self._name

    @property
    def system(self) -> str:
        """The provider's name: the `provider_name` of this model's responses."""
        return PROVIDER_NAME

    @property
    def provider(self) -> None:
        """None: the model is reached through Temporal, by the activity's client."""
        return None

    def conversations(self) -> Conversations:
        """The turns' driver over the running activity's Temporal client (one per client)."""
        from mamba_stream.conversations import Conversations

        client = activity.client()
        found = self._conversations.get(id(client))
        if found is None or found.client is not client:
            found = self._conversations[id(client)] = Conversations(
                client, task_queue=self.task_queue or ClientConfig().task_queue, options=self.options,
                templates=self.templates, models=self.models)
        return found

    def generate_settings(self, messages: Sequence[ModelMessage], model_settings: ModelSettings | None,
                          params: ModelRequestParameters) -> tuple[int, dict[str, Any]]:
        """(max_tokens, `StreamClient.generate`'s settings) for one request (`sampling`). A
        subclass may add to them from the request: a `grammar` the reply must spell, say, where
        neither the tool choice nor the output mode holds it to one (`_reply`; else refused)."""
        return sampling(model_settings, self.max_tokens)

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        """See base class: one turn of the conversation's stream (the module docstring)."""
        response, _ = await self._respond(messages, model_settings, model_request_parameters)
        return response

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: RunContext[Any] | None = None) -> AsyncGenerator[StreamedResponse]:
        """See base class. The turn runs whole, then its parts are streamed as events (one start
        event a part): the response is the one `request` returns."""
        response, params = await self._respond(messages, model_settings, model_request_parameters)
        yield CompletedStreamedResponse(response, model_request_parameters=params, replay_events=True)

    async def _respond(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                       params: ModelRequestParameters) -> tuple[ModelResponse, ModelRequestParameters]:
        model_settings, params = self.prepare_request(model_settings, params)
        from mamba_stream.conversations import activity_failures  # the engine's side: where a request runs

        with activity_failures():
            turn = await self._turn(messages, model_settings, params)
        parts: list[ModelResponsePart] = []
        if turn.reply.text or not turn.reply.tool_calls:
            parts.append(TextPart(content=turn.reply.text))
        parts += [ToolCallPart(tool_name=name, args=args, tool_call_id=cid)
                  for cid, (name, args) in zip(turn.call_ids, turn.reply.tool_calls, strict=True)]
        n_out = len(turn.result.tokens)
        # the model's end-of-sequence token ends a reply as a stop text does
        finish = "tool_call" if turn.reply.tool_calls else "length" if turn.result.finish_reason == "length" else "stop"
        return ModelResponse(parts=parts, usage=RequestUsage(input_tokens=turn.fed_tokens, output_tokens=n_out),
                             model_name=self.model_name, provider_name=PROVIDER_NAME,
                             provider_response_id=turn.response_id, provider_details={"forked": turn.forked},
                             finish_reason=finish), params

    async def _turn(self, messages: Sequence[ModelMessage], model_settings: ModelSettings | None,
                    params: ModelRequestParameters) -> Turn:
        """The turn (see the module docstring for which messages it feeds)."""
        from mamba_stream.conversations import ParsedReply
        from mamba_stream.scan import ChatTemplateError
        from mamba_stream.workflows import RewindPastWindow, RewindUnavailable

        caller = _caller()
        tools, call, output = _reply(params, model_settings)
        max_tokens, settings = self.generate_settings(messages, model_settings, params)
        if "grammar" in settings and (call is not None or output is not None):
            raise InvalidRequest("the reply is held to a tool call or an output schema already: a grammar of the "
                                 "model's own cannot hold it too", field="grammar")
        conv = self.conversations()
        wid = caller[0]
        system, lead = system_part(messages, [p.content for p in self._get_instruction_parts(messages, params) or []])
        items = [message_items(m, skip=lead if i == 0 else 0) for i, m in enumerate(messages)]
        # this model's responses: their handles (opened for the workflow's principal: another
        # principal's is refused here, before anything moves) and the messages their turns recorded
        handles: dict[int, tuple[str, ResponseHandle]] = {}
        replies: dict[int, dict[str, Any]] = {}
        for i, m in enumerate(messages):
            if isinstance(m, ModelResponse) and m.provider_name == PROVIDER_NAME and m.provider_response_id:
                h = conv.open(wid, m.provider_response_id)
                if h.model_id == self.model_name:  # another model's responses are its text, fed as such
                    handles[i] = (m.provider_response_id, h)
                    text, calls, ids = response_message(m)
                    replies[i] = ParsedReply(text=text, tool_calls=calls, body=text).message(ids)
        previous, split = None, 0
        for i in sorted(handles, reverse=True):
            rid, h = handles[i]
            if h.digest and hmac.compare_digest(h.digest, conv.digest(wid, system, chat_form(items, replies, i))):
                previous, split = rid, i + 1
                break
            log.info("%s: the messages up to response %d are not what its stream was fed: not continued there",
                     caller, i)

        async def run(previous: str | None, split: int) -> Turn:
            return await conv.turn(caller=caller, model_id=self.model_name, system=system, tools=tools,
                                   items=[it for its in items[split:] for it in its], previous=previous,
                                   max_tokens=max_tokens, settings=settings, call=call, output=output,
                                   history=chat_form(items, replies, split - 1) if split else [])
        try:
            turn = await run(previous, split)
        except (WorkflowUpdateFailedError, ChatTemplateError) as exc:
            cause = getattr(exc, "cause", None)
            past = isinstance(cause, ApplicationError) and cause.type in (RewindPastWindow.reason,
                                                                           RewindUnavailable.reason)
            if previous is None or not (past or isinstance(exc, ChatTemplateError)):
                raise
            # the response's state has left its stream's window, or the template cannot render a
            # turn after an earlier one: the whole conversation, in a new stream
            log.info("%s: response %d cannot be continued (%s): a new conversation", caller, split - 1,
                     getattr(cause, "type", None) or type(exc).__name__)
            turn = await run(None, 0)
        return turn
