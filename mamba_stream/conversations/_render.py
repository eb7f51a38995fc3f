"""A conversation's turns as the text a stream is fed: the model's chat template, rendered once
for the first turn and, for each later one, only after what the stream already holds.

The first turn renders the whole conversation. Its system part (instructions, tool schemas)
comes first: when the template renders it as a prefix of the whole, the stream opens from it
(`StreamClient.open(prefix=...)`), and agents that share instructions and tools share its state
in the workers' prefix store.

A later turn gets only its new messages (the framework holds the earlier ones behind the
previous response's handle). Its text is what the template renders after the earlier turns:
rendered behind a stand-in of them (the same system part, one user message) followed by the
previous reply, it is the text after that reply. A template that renders each message on its
own (ChatML, Granite's, Llama 3's, the presets' plain one) gives the same text behind any
earlier turns; one that renders earlier turns otherwise once later ones follow is refused,
typed (`ChatTemplateError`): its conversations are sent whole (no previous response id).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mamba_stream.failures import InvalidRequest
from mamba_stream.scan import ChatTemplate, ChatTemplateError
from mamba_stream.workflows import Grammar

__all__ = ["ParsedReply", "Rendered", "chat_messages", "first_turn", "next_turn", "parse_reply", "reply_end",
           "reply_grammar", "tool_schema"]

_PROBE = "\x01reply\x01"
_STAND_IN = "\x02"
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def _plain(item: Any) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return dict(item)
    dump = getattr(item, "model_dump", None)
    if dump is not None:
        return dump(exclude_none=True)
    raise InvalidRequest(f"input item of type {type(item).__name__} is not a message", field="input")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        part = _plain(part)
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            out.append(str(part.get("text", "")))
        elif kind == "refusal":
            out.append(str(part.get("refusal", "")))
        else:
            raise InvalidRequest(f"message content of type {kind!r} cannot be fed to a language model stream "
                                 f"(text only)", field="input")
    return "".join(out)


def chat_messages(items: str | Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI Responses input items as chat-template messages: messages by role, a run of
    `function_call` items as the `tool_calls` of the assistant message before them (a new one
    where none is), a `function_call_output` as a `tool` message.

    Raises:
        InvalidRequest: an item this model cannot take (images, files, hosted tools' items),
            field "input".
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for raw in items:
        item = _plain(raw)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"message role {role!r} is not one of user, assistant, system, developer",
                                     field="input")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", ""))}}
            if out and out[-1]["role"] == "assistant":
                # a response's calls belong to its message, text and all: one assistant message, as
                # the reply was sampled and as the turn recorded it (`ParsedReply.message`)
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else _text(output)})
        elif kind == "reasoning":
            continue  # another model's reasoning summary: nothing this model was fed or would be
        else:
            raise InvalidRequest(f"input item of type {kind!r} cannot be fed to a language model stream",
                                 field="input")
    return out


def tool_schema(name: str, description: str | None, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """A function tool as chat templates expect it (OpenAI's `{"type": "function", ...}`)."""
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": dict(parameters)}}


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A turn's text: `prefix` (the system part, for the prefix store; None: none) then `text`."""

    prefix: str | None
    text: str


def _system(system: str | None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}] if system else []


def first_turn(template: ChatTemplate, system: str | None, tools: Sequence[Mapping[str, Any]] | None,
               messages: Sequence[Mapping[str, Any]]) -> Rendered:
    """The whole conversation, to open a stream with and feed: its system part first where the
    template renders that as a prefix of the whole."""
    whole = template.render([*_system(system), *messages], tools=tools or None, add_generation_prompt=True)
    if not system and not tools:
        return Rendered(prefix=None, text=whole)
    head = template.render(_system(system), tools=tools or None, add_generation_prompt=False)
    if head and whole.startswith(head):
        return Rendered(prefix=head, text=whole[len(head):])
    return Rendered(prefix=None, text=whole)


def reply_end(template: ChatTemplate) -> str:
    """Where a reply ends: what the template writes after an assistant message's content, its
    first non-blank line (ChatML's `<|im_end|>`), or the blank itself (the plain template's
    newline). A reply is sampled up to it (a `stop` text), and it is fed with the reply."""
    text = template.render([{"role": "user", "content": _STAND_IN}, {"role": "assistant", "content": _PROBE}],
                           add_generation_prompt=False)
    at = text.rfind(_PROBE)
    if at < 0:
        raise ChatTemplateError("the chat template does not render an assistant message's content as it is",
                                origin=template.origin)
    end = text[at + len(_PROBE):]
    return end.strip().split("\n")[0] if end.strip() else end


#: JSON held to a schema without free whitespace (a model cannot spend its tokens on blanks), its
#: separators json.dumps' and the templates' `tojson`'s: a call is sampled as the template renders
#: it, so the next turn extends the reply instead of forking before it
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_text(text: str) -> str:
    """`text` as a Lark terminal: a special token (`<|im_end|>`) by its name, which llguidance
    matches as that token; any other text quoted (JSON's escapes are Lark's)."""
    if re.fullmatch(r"<\|[^|\s]+\|>", text):
        return text
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: Mapping[str, Any]) -> str:
    # the keys in the schema's order: a call names its tool before its arguments
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False)


def reply_grammar(tools: Sequence[Mapping[str, Any]] | None, end: str, *, call: Sequence[str] | None = None,
                  output: Mapping[str, Any] | None = None) -> Grammar | None:
    """What a reply must spell (a Lark grammar for `GenerateRequest.grammar`), or None: free text.

    `call`: the names of the tools (of `tools`, `tool_schema`'s) one of which the reply must call:
    a single `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block, the arguments held to
    that tool's parameters. `output`: the JSON schema the reply's text must match (a structured
    output); a tool of `tools` may be called instead, unless `call` is empty. Either way the reply
    ends with the template's `end` (`reply_end`), as a free one stops at it.

    Raises:
        InvalidRequest: field `tool_choice`, a name in `call` that is not a tool of `tools`.
    """
    if call is None and output is None:
        return None
    by_name = {t["function"]["name"]: t["function"] for t in tools or ()}
    names = list(by_name) if call is None else list(call)
    for name in names:
        if name not in by_name:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not one of the agent's tools",
                                 field="tool_choice")
    rules = []
    for i, name in enumerate(names):
        params = dict(by_name[name].get("parameters") or {"type": "object"})
        # the parameters' definitions move to the call's root, where their `#/$defs/...` point
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False, **defs}
        rules.append(f'call{i}: "<tool_call>" {_json_rule(schema)} "</tool_call>"')
    choices = [f"call{i}" for i in range(len(names))]
    if output is not None and call is None:
        rules.append(f"output: {_json_rule(output)}")
        choices.append("output")
    if not choices:
        raise InvalidRequest("tool_choice requires a tool call, and the agent has no tools", field="tool_choice")
    start = f"start: ({' | '.join(choices)})" + (f" {_lark_text(end)}" if end else "")
    return Grammar(kind="lark", source="\n".join([start, *rules]))


@dataclasses.dataclass(frozen=True)
class ParsedReply:
    """A reply split as the frameworks take it: text, and tool calls (name, arguments JSON);
    `body`: the whole reply without its end marker (its text where no tool is to be called)."""

    text: str
    tool_calls: tuple[tuple[str, str], ...]
    body: str

    def message(self, call_ids: Sequence[str]) -> dict[str, Any]:
        """The reply as the assistant message a chat template renders."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                                 for cid, (n, a) in zip(call_ids, self.tool_calls, strict=True)]
        return msg


def parse_reply(reply: str, end: str) -> ParsedReply:
    """The sampled reply without its end marker, its `<tool_call>{"name": ..., "arguments": ...}
    </tool_call>` blocks (the syntax of Granite's, Qwen's, Hermes' and the plain templates) taken
    out as tool calls. A block that is not such JSON stays text."""
    body = reply[:-len(end)] if end and reply.endswith(end) else reply
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    last = 0
    for m in _TOOL_CALL.finditer(body):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        calls.append((obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        kept.append(body[last:m.start()])
        last = m.end()
    kept.append(body[last:])
    return ParsedReply(text="".join(kept) if calls else body, tool_calls=tuple(calls), body=body)


def next_turn(template: ChatTemplate, system: str | None, tools: Sequence[Mapping[str, Any]] | None,
              reply: str, reply_message: Mapping[str, Any], messages: Sequence[Mapping[str, Any]]
              ) -> tuple[str, bool]:
    """A later turn's text, after the previous reply: (text, extends). `extends`: the template
    renders the reply as it was sampled, and `text` follows it; False: it renders it otherwise,
    and `text` (the reply as rendered, then the turn) follows the state before the reply.

    Raises:
        ChatTemplateError: the template renders earlier turns otherwise once later ones follow.
    """
    stand_in = [*_system(system), {"role": "user", "content": _STAND_IN}]
    before = template.render(stand_in, tools=tools or None, add_generation_prompt=True)
    after = template.render([*stand_in, dict(reply_message), *messages], tools=tools or None,
                            add_generation_prompt=True)
    if not after.startswith(before):
        raise ChatTemplateError(
            "the chat template renders earlier turns otherwise once later ones follow: a turn cannot be fed after "
            "the previous one; send the whole conversation (no previous response id)", origin=template.origin)
    tail = after[len(before):]
    # a reply whose tokens did not decode to text (a multi-byte character cut by max_tokens, bytes
    # a byte-level model sampled that are no UTF-8) re-encodes otherwise: its tokens are not the
    # text's, and the turn forks before it, as a stream fed the rendered conversation would hold
    if tail.startswith(reply) and "\ufffd" not in reply:
        return tail[len(reply):], True
    return tail, False
