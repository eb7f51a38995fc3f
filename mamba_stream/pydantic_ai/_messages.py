"""Pydantic AI's messages as a conversation stream takes them (`mamba_stream.conversations`).

Pydantic AI sends a model the whole conversation on every request. A stream holds what it was
fed, so a request is split where the conversation's latest response of this model is: the
messages up to it are what the stream already holds (checked by their keyed digest), the ones
after it are fed. Two forms of the messages serve that:

- input items (`message_items`), the OpenAI Responses shape `Conversations.turn` takes and
  renders with the model's chat template: a user or system message, an assistant message, a
  `function_call` per tool call, a `function_call_output` per tool return or tool retry;
- chat messages (`chat_form`), what a turn's digest is taken over: the items as
  `chat_messages` reads them, except each response of this model, which is the one assistant
  message its turn recorded (`ParsedReply.message`: its text and tool calls together).

The system part of a conversation is its instructions and the system prompts its first request
opens with, in that request's order (system prompts, then instructions, as Pydantic AI's chat
adapters place them): conversations that share them share the stream's prefix state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic_ai.messages import (
    CachePoint,
    CompactionPart,
    FilePart,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    NativeToolCallPart,
    NativeToolReturnPart,
    RetryFeedbackPart,
    RetryPromptPart,
    SystemPromptPart,
    TextContent,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from mamba_stream.failures import InvalidRequest

__all__ = ["PROVIDER_NAME", "call_arguments", "chat_form", "message_items", "response_message", "system_part"]

log = logging.getLogger(__name__)

#: the `provider_name` (and `Model.system`) of this package's responses: a response with it is one
#: whose `provider_response_id` is a sealed handle of a conversation stream
PROVIDER_NAME = "mamba-stream"


def _refused(what: str) -> InvalidRequest:
    return InvalidRequest(f"{what} cannot be fed to a language model stream (text and tool calls only)",
                          field="messages")


def _user_content(part: UserPromptPart) -> str | list[dict[str, str]]:
    if isinstance(part.content, str):
        return part.content
    out = []
    for item in part.content:
        if isinstance(item, str):
            out.append({"type": "input_text", "text": item})
        elif isinstance(item, TextContent):
            out.append({"type": "input_text", "text": item.content})
        elif isinstance(item, CachePoint):
            continue  # a provider's cache boundary: a stream caches all it was fed
        else:
            raise _refused(f"user content of kind {getattr(item, 'kind', type(item).__name__)!r}")
    return out


def call_arguments(part: ToolCallPart) -> str:
    """A tool call's arguments as the model wrote them: the text it sampled, kept as is (Pydantic
    AI's `args_as_json_str` compacts it, and the stream holds the text it sampled), or the JSON of
    arguments another model gave as a mapping."""
    return part.args if isinstance(part.args, str) else part.args_as_json_str()


def system_part(messages: Sequence[ModelMessage], instructions: Iterable[str]) -> tuple[str | None, int]:
    """(the conversation's system text, how many parts of its first request it takes): the system
    prompts the first request opens with, then the instructions, a blank line between; None when
    there are neither."""
    lead: list[str] = []
    if messages and isinstance(messages[0], ModelRequest):
        for part in messages[0].parts:
            if not isinstance(part, SystemPromptPart):
                break
            lead.append(part.content)
    texts = [t for t in (*lead, *instructions) if t]
    return ("\n\n".join(texts) or None), len(lead)


def message_items(message: ModelMessage, *, skip: int = 0) -> list[dict[str, Any]]:
    """One message as input items (the module docstring), its first `skip` parts left out (the
    system prompts taken into the system part).

    Raises:
        InvalidRequest: a part this model cannot take (images, files, audio; parts Pydantic AI
            should have prepared away), field "messages".
    """
    out: list[dict[str, Any]] = []
    if isinstance(message, ModelRequest):
        for part in message.parts[skip:]:
            if isinstance(part, SystemPromptPart):
                out.append({"type": "message", "role": "system", "content": part.content})
            elif isinstance(part, UserPromptPart):
                out.append({"type": "message", "role": "user", "content": _user_content(part)})
            elif isinstance(part, ToolReturnPart):
                out.append({"type": "function_call_output", "call_id": part.tool_call_id,
                            "output": part.model_response_str()})
            elif isinstance(part, RetryPromptPart):  # deprecated, still in older histories
                if part.tool_name is None:  # output validation failed: told as the user would
                    out.append({"type": "message", "role": "user", "content": part.model_response()})
                else:  # a tool call that did not validate: its answer is the error
                    out.append({"type": "function_call_output", "call_id": part.tool_call_id,
                                "output": part.model_response()})
            elif isinstance(part, RetryFeedbackPart):  # where `prepare_messages` did not translate it
                out.append({"type": "message", "role": "user", "content": part.model_response()})
            else:
                raise _refused(f"a request part of kind {getattr(part, 'part_kind', type(part).__name__)!r}")
        return out
    if not isinstance(message, ModelResponse):
        raise _refused(f"a message of type {type(message).__name__}")
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for part in message.parts:
        if isinstance(part, TextPart):
            text.append(part.content)
        elif isinstance(part, ToolCallPart):
            calls.append({"type": "function_call", "call_id": part.tool_call_id, "name": part.tool_name,
                          "arguments": call_arguments(part)})
        elif isinstance(part, ThinkingPart | NativeToolCallPart | NativeToolReturnPart | FilePart | CompactionPart):
            # another model's reasoning, server-side tools, files or compaction: nothing this model
            # was fed or would be (as Pydantic AI's chat adapters leave them out)
            continue
        else:
            raise _refused(f"a response part of kind {getattr(part, 'part_kind', type(part).__name__)!r}")
    if text:
        out.append({"type": "message", "role": "assistant", "content": "".join(text)})
    return out + calls


def response_message(response: ModelResponse) -> tuple[str, tuple[tuple[str, str], ...], tuple[str, ...]]:
    """A response of this model as its turn recorded it: (text, tool calls as (name, arguments),
    call ids)."""
    text = "".join(p.content for p in response.parts if isinstance(p, TextPart))
    calls = [p for p in response.parts if isinstance(p, ToolCallPart)]
    return text, tuple((c.tool_name, call_arguments(c)) for c in calls), tuple(c.tool_call_id for c in calls)


def chat_form(items: Sequence[Sequence[Mapping[str, Any]]], replies: Mapping[int, Mapping[str, Any]],
              upto: int) -> list[dict[str, Any]]:
    """The chat messages of messages `0..upto` (inclusive), from their input items (`items`, one
    list a message): each message in `replies` (by index) is its recorded assistant message; the
    runs of items between them are read as `chat_messages` reads a turn's items."""
    from mamba_stream.conversations import chat_messages  # worker side (the chat templates' engine)

    out: list[dict[str, Any]] = []
    run: list[Mapping[str, Any]] = []
    for i in range(upto + 1):
        if i in replies:
            out += chat_messages(run)
            run = []
            out.append(dict(replies[i]))
        else:
            run.extend(items[i])
    return out + chat_messages(run)
