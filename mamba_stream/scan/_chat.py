"""Chat templates: a model directory's Jinja template, rendered as Hugging Face transformers does.

A conversation reaches a stream as text the model's chat template renders, then tokens its input
transform encodes. The template is read where transformers 5 reads it from a local directory:

- `chat_template.jinja` (the default template) and `additional_chat_templates/<name>.jinja`
  (named ones); where any of these files exist they replace what tokenizer_config.json says;
- else tokenizer_config.json's `chat_template`: a string, or a list of `{"name", "template"}`
  (named templates: "tool_use" is chosen when tools are given, "default" otherwise).

It renders in a sandboxed Jinja environment configured as transformers configures its own
(`trim_blocks`, `lstrip_blocks`, loop controls, the `{% generation %}` tag, a `tojson` that does
not escape HTML, `raise_exception`, `strftime_now`, a `namespace` and `dict` that cannot reach
Python's internals) with the variables it passes (`messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer config's special tokens: `bos_token`, `eos_token`, ...),
so that the same files render the same text (tests/scan/test_chat_template.py compares the two).

A stream is fed tokens, never text: `continuation` compares a turn's tokens with those the stream
was already fed. A template that renders each turn after the earlier ones extends them; one that
rewrites earlier turns (keeps only the last system prompt, drops earlier reasoning) makes the
stream fork at the first token that differs (docs/chat-templates.md).

No torch here: rendering is text in, text out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from mamba_stream.failures import InvalidRequest, ScanError

__all__ = [
    "PLAIN_CHAT_TEMPLATE",
    "ChatTemplate",
    "ChatTemplateError",
    "Continuation",
    "NoChatTemplate",
    "TemplateRaised",
    "continuation",
]

log = logging.getLogger(__name__)

#: where a directory's template is read from, in transformers 5's names
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
#: the tokenizer config keys transformers passes to a template as variables (its
#: `SPECIAL_TOKENS_ATTRIBUTES`), besides a dict-valued `extra_special_tokens`' names
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: the names a message's reasoning arrives under; templates read the first, gpt-oss's `thinking`
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

#: The presets' template (their vocabulary is UTF-8 bytes, with no special tokens). Each message
#: is `<|role|>` and a newline, its text, and a newline; an assistant's tool calls follow its text
#: as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, with nothing between them, which is
#: what a model taught this format would generate; tools, when given, come first, one JSON schema
#: a line after `<|tools|>`; the generation prompt is `<|assistant|>` and a newline. Every turn
#: renders after the earlier ones unchanged, so a conversation only ever extends its stream.
PLAIN_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|tools|>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|' + message.role + '|>\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}"
    "{%- elif message.content is defined -%}"
    "{%- for part in message.content -%}"
    "{%- if part is string -%}{{- part -}}{%- elif part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message.tool_calls is defined -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}"
    "{{- '<tool_call>{\"name\": ' + (call.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}"
    "{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


class ChatTemplateError(ScanError, ValueError):
    """A chat template cannot be read or compiled (`origin`: the file, or where it came from), or
    cannot be chosen (named templates without a "default")."""

    def __init__(self, message: str, *, origin: str) -> None:
        super().__init__(message, origin=origin)
        self.origin = origin


class NoChatTemplate(ChatTemplateError):
    """A model directory, or a model, has no chat template; `origin` names the files looked for."""


class TemplateRaised(ChatTemplateError):
    """The template refused the conversation while rendering it: its `raise_exception(message)`
    (a role it does not know, a second system prompt...), or an error in its own code. `message`
    is the template's own words."""

    def __init__(self, message: str, *, origin: str) -> None:
        super().__init__(f"the chat template refused the conversation: {message}", origin=origin)
        self.message = message
        self.extra["message"] = message


# --- the sandboxed environment ---------------------------------------------------------------


def _raise_exception(message: str) -> None:
    # raised as it is through Jinja (which wraps nothing a global raises), apart from Jinja's own
    # errors so that the template's words reach the caller as written; `render` names the origin
    raise TemplateRaised(str(message), origin="")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML: a prompt is not HTML, and templates are
    # written against transformers' filter, which takes json.dumps' arguments
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing underscore names: a template is untrusted code, and
    `ns.__class__`-style attributes are the way out of a sandbox."""

    # no named `self`: Jinja's own signature trick, so that `namespace(self=...)` still works
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself (its attributes
    lead out of the sandbox)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it
    (for training masks); rendering is its body. Without the tag such templates do not compile."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


@cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # built once: rendering a compiled template is thread-safe, and compiling is the cost
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


# --- what a template is given ----------------------------------------------------------------


def _plain(value: Any, where: str) -> Any:
    """`value` as JSON-like data (dicts, lists, tuples, str, int, float, bool, None): what the
    sandbox lets a template see. Subclasses (enums) become their base type, dataclasses and
    pydantic models their fields; anything else is refused, not rendered as a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):  # an IntEnum (bool, final, is caught above)
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name), where) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models: the frameworks' messages
        return _plain(value.model_dump(), where)
    raise InvalidRequest(f"{where}: a {type(value).__name__} cannot be given to a chat template "
                         "(JSON values, mappings, sequences, dataclasses and pydantic models only)")


def _messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The conversation as transformers hands it to a template: plain dicts, without the keys
    whose value is None (APIs send `content=None` beside tool calls, and templates render a
    missing key well and a None badly), reasoning under each of its names."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequest(f"messages must be a sequence of messages, got {type(messages).__name__}")
    if not messages:
        raise InvalidRequest("an empty conversation has no rendering: give at least one message")
    out = []
    for i, message in enumerate(messages):
        plain = _plain(message, f"messages[{i}]")
        if not isinstance(plain, dict):
            raise InvalidRequest(f"messages[{i}] is a {type(message).__name__}, not a message (a mapping)")
        plain = {k: v for k, v in plain.items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _tools(tools: Sequence[Any] | None) -> list[Any] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequest(f"tools must be a sequence of JSON schemas, got {type(tools).__name__}")
    out = [_plain(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    for i, tool in enumerate(out):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{i}] is not a JSON schema (a mapping)")
    return out


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"{path} cannot be read as JSON: {exc}", origin=str(path)) from exc
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path} is not a JSON object", origin=str(path))
    return data


def _special_tokens(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """The special tokens a template sees, as transformers 5 gathers them for a local directory:
    tokenizer_config.json's; special_tokens_map.json's over them where the config is of the older
    kind (no `added_tokens_decoder`); a dict-valued `extra_special_tokens` adds its names."""
    merged = dict(config)
    legacy = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        merged.update(_read_json(legacy))
    out = {}
    extra = merged.get("extra_special_tokens")
    for name in (*SPECIAL_TOKENS, *(extra if isinstance(extra, dict) else {})):
        text = _token_text(merged.get(name) if name in SPECIAL_TOKENS else extra[name])
        if text is not None:
            out[name] = text
    return out


def _compile(source: str, origin: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{origin}: line {exc.lineno}: {exc.message}", origin=origin) from exc


class ChatTemplate:
    """A chat template: Jinja source (one template, or several by name) and the special tokens it
    is rendered with.

    Build one with `ChatTemplate.from_directory(path)` (a model directory, read as transformers
    reads it), `ChatTemplate.plain()` (the presets'), or from source. A loaded model carries its
    own: `Model.chat_template`.

    Args:
        source: the template, or {name: template} (transformers' named templates).
        special_tokens: the variables `bos_token`, `eos_token`, ... the template sees.
        origin: where it came from (a file), for errors and logs.

    Raises:
        ChatTemplateError: a template does not compile (its line and Jinja's message).
    """

    def __init__(self, source: str | Mapping[str, str], *, special_tokens: Mapping[str, str] | None = None,
                 origin: str = "<string>") -> None:
        self.origin = origin
        sources = {"default": source} if isinstance(source, str) else \
            dict(source) if isinstance(source, Mapping) else {}
        if not sources or not all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
            raise ChatTemplateError(f"{origin}: a chat template is a string, or a non-empty mapping of names to "
                                    "strings", origin=origin)
        #: True where the templates are named (the "default" one chosen unless named, "tool_use" for tools)
        self.named = not isinstance(source, str)
        self.sources: dict[str, str] = sources
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        # compiled now: a template that cannot compile is refused where it is read, not at a turn
        self._compiled = {name: _compile(text, origin if not self.named else f"{origin} [{name}]")
                          for name, text in sources.items()}
        digest = json.dumps({"templates": sources, "special_tokens": self.special_tokens}, sort_keys=True)
        #: "sha256:<hex>" over the templates and special tokens: what decides the text of a rendering
        self.revision = "sha256:" + hashlib.sha256(digest.encode("utf-8")).hexdigest()

    # a template never changes once built: a copy is itself (a model is deep-copied in places, and
    # compiled Jinja templates neither copy nor pickle); pickled, it is built again from its source
    def __copy__(self) -> ChatTemplate:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ChatTemplate:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        source = self.sources if self.named else self.sources["default"]
        return (_rebuild, (source, self.special_tokens, self.origin))

    @classmethod
    def from_directory(cls, directory: str | Path) -> ChatTemplate:
        """The template of a model directory: chat_template.jinja and additional_chat_templates/
        where they exist, else tokenizer_config.json's `chat_template` (see the module).

        Raises:
            NoChatTemplate: none of them holds a template (the message names the files).
            ChatTemplateError: a file cannot be read, or a template does not compile.
        """
        directory = Path(directory)
        config_path = directory / TOKENIZER_CONFIG
        config = _read_json(config_path) if config_path.is_file() else {}
        files = {}
        if (directory / TEMPLATE_FILE).is_file():
            files["default"] = directory / TEMPLATE_FILE
        if (directory / TEMPLATE_DIR).is_dir():
            files |= {f.name.removesuffix(".jinja"): f for f in sorted((directory / TEMPLATE_DIR).glob("*.jinja"))}
        source: str | dict[str, str]
        if files:
            # transformers: files take priority over the config's entry, which they replace whole
            try:
                texts = {name: f.read_text(encoding="utf-8") for name, f in files.items()}
            except (OSError, UnicodeDecodeError) as exc:
                raise ChatTemplateError(f"{directory}: a template file cannot be read: {exc}",
                                        origin=str(directory)) from exc
            source = texts["default"] if list(texts) == ["default"] else texts
            origin = str(files["default"] if list(files) == ["default"] else directory / TEMPLATE_DIR)
        else:
            entry = config.get("chat_template")
            if entry is None:
                raise NoChatTemplate(f"{directory} has no chat template: neither {TEMPLATE_FILE} nor a "
                                     f"`chat_template` in {TOKENIZER_CONFIG}", origin=str(config_path))
            if isinstance(entry, list):  # [{"name": ..., "template": ...}]: the named form
                try:
                    source = {item["name"]: item["template"] for item in entry}
                except (TypeError, KeyError) as exc:
                    raise ChatTemplateError(f"{config_path}: a named chat template needs \"name\" and \"template\"",
                                            origin=str(config_path)) from exc
            else:
                source = entry
            origin = str(config_path)
        template = cls(source, special_tokens=_special_tokens(directory, config), origin=origin)
        log.debug("chat template of %s read from %s (%s)", directory, origin, template.revision[:19])
        return template

    @classmethod
    def plain(cls) -> ChatTemplate:
        """The presets' template (`PLAIN_CHAT_TEMPLATE`, docs/chat-templates.md)."""
        return cls(PLAIN_CHAT_TEMPLATE, origin="PLAIN_CHAT_TEMPLATE")

    def source(self, *, tools: Sequence[Any] | None = None, name: str | None = None) -> str:
        """The template's text `render` uses: the one given; of named templates, `name`, else
        "tool_use" where tools are given (even none: transformers tests `tools is not None`),
        else "default".

        Raises:
            ChatTemplateError: `name` is not one of them, or none applies.
        """
        return self.sources[self._choose(tools, name)]

    def _choose(self, tools: Sequence[Any] | None, name: str | None) -> str:
        if name is not None:
            if name not in self.sources:
                raise ChatTemplateError(f"no chat template named {name!r}; {self.origin} has "
                                        f"{sorted(self.sources)}", origin=self.origin)
            return name
        if tools is not None and "tool_use" in self.sources:
            return "tool_use"
        if "default" in self.sources:
            return "default"
        raise ChatTemplateError(f"{self.origin} has chat templates {sorted(self.sources)} and no \"default\": "
                                "name the one to use", origin=self.origin)

    def render(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        name: str | None = None,
        now: datetime | None = None,
        **extra: Any,
    ) -> str:
        """The conversation as text, as `transformers`' `apply_chat_template(messages, tools=tools,
        add_generation_prompt=..., tokenize=False, **extra)` renders it from the same files.

        Args:
            messages: dicts (or dataclasses, pydantic models) with `role` and `content`, and what
                the template reads besides (`tool_calls`, `reasoning_content`, `name`...).
            tools: JSON schemas of the tools, as the template expects them (most: OpenAI's
                `{"type": "function", "function": {...}}`); None: no tools.
            documents: retrieval documents, for the templates that read them.
            add_generation_prompt: end with the assistant's header, for the model to answer.
                True by default (transformers: False): a stream renders a turn to generate.
            name: which of named templates to use (see `source`).
            now: the time `strftime_now` reads (templates that print today's date): pin it for
                a conversation, or a turn rendered on another day rewrites the earlier ones.
            **extra: further variables (`enable_thinking`, `date_string`...); they override the
                special tokens of the same name, as in transformers.

        Raises:
            TemplateRaised: the template refused the conversation (its message).
            InvalidRequest: the messages, tools or extra variables are not JSON-like data
                (`strftime_now` included: pin the clock with `now`).
            ChatTemplateError: no template applies (named templates).
        """
        if "strftime_now" in extra:  # a function from the caller would run inside the sandbox's template
            raise InvalidRequest("strftime_now is the template's clock: pass now= to pin it")
        template = self._compiled[self._choose(tools, name)]
        variables = {
            **self.special_tokens,
            **_plain(extra, "extra"),
            "messages": _messages(messages),
            "tools": _tools(tools),
            "documents": None if documents is None else _plain(documents, "documents"),
            "add_generation_prompt": bool(add_generation_prompt),
        }
        if now is not None:
            variables["strftime_now"] = now.strftime
        try:
            return template.render(**variables)
        except TemplateRaised as exc:  # its raise_exception: its message, with where it came from
            raise TemplateRaised(exc.message, origin=self.origin) from None
        except Exception as exc:
            # an error in the template's own code on this conversation (an undefined attribute,
            # str + None, the sandbox refusing an access): the conversation is refused, typed
            raise TemplateRaised(f"{type(exc).__name__}: {exc}", origin=self.origin) from exc

    def __repr__(self) -> str:
        names = f", names={sorted(self.sources)}" if self.named else ""
        return f"ChatTemplate(origin={self.origin!r}{names}, revision={self.revision[:19]}...)"


# --- a turn against what the stream was fed --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Continuation:
    """How a turn's tokens (the whole conversation rendered and encoded) continue the tokens a
    stream was already fed.

    Attributes:
        fed: how many tokens the stream had been fed.
        common: the length of the longest common prefix of the two: the stream's state after
            `common` tokens is the one to continue from.
        tokens: what to feed after those `common` tokens.
    """

    fed: int
    common: int
    tokens: tuple[int, ...]

    @property
    def extends(self) -> bool:
        """The turn extends what was fed (feed `tokens` to the stream as it is); False: the
        rendering rewrote an earlier turn, and the stream forks at position `common`."""
        return self.common == self.fed


def continuation(fed: Sequence[int], rendered: Sequence[int]) -> Continuation:
    """Compare the tokens a stream was fed with a turn's tokens (the whole conversation rendered
    by its template and encoded by its transform).

    Token ids are compared, not text: the same text can encode otherwise once more text follows
    it, and what decides a state is its tokens. A sampled reply that its text re-encodes
    otherwise forks there too, exactly, at the cost of the tokens after it.
    """
    fed, rendered = list(fed), list(rendered)
    n = min(len(fed), len(rendered))
    # the usual turn extends: one comparison in C; a fork is looked for token by token
    common = n if fed[:n] == rendered[:n] else next(i for i in range(n) if fed[i] != rendered[i])
    return Continuation(fed=len(fed), common=common, tokens=tuple(rendered[common:]))


def _rebuild(source: str | Mapping[str, str], special_tokens: Mapping[str, str], origin: str) -> ChatTemplate:
    """A pickled `ChatTemplate` built again (its compiled templates are not pickled)."""
    return ChatTemplate(source, special_tokens=special_tokens, origin=origin)
