"""Chat templates (issue 48, item 4): a model directory's template renders as transformers'
`apply_chat_template` renders it, exactly; a turn's tokens extend what was fed, or fork where a
template rewrites an earlier turn; the presets have a plain template; refusals are typed."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from mamba_stream.failures import Failure, InvalidRequest, application_error
from mamba_stream.scan import (
    PLAIN_CHAT_TEMPLATE,
    ByteTransform,
    ChatTemplate,
    ChatTemplateError,
    Continuation,
    NoChatTemplate,
    TemplateRaised,
    continuation,
    init_model,
    load_model,
    save_checkpoint,
)

# --- representative templates, written for these tests in the styles of real ones -------------

#: ChatML with tools in the system prompt and tool responses grouped in a user turn (Qwen-2.5 style)
CHATML = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nReturn each call as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n"
        ~ "</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
           or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

#: Granite-4.0 style: a namespace building the system prompt, tools as <tool_call>, a default
#: system prompt, raise_exception on a role it does not know
GRANITE = r"""
{%- set tools_prefix = 'You are a helpful assistant with access to the following tools. '
    ~ 'You may call one or more tools to assist with the user query.\n\n'
    ~ 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' %}
{%- set tools_suffix = '\n</tools>\n\nFor each tool call, return a json object with function name and arguments '
    ~ 'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    ~ '"arguments": <args-json-object>}\n</tool_call>.' %}
{%- set default_system = 'You are a helpful assistant. Please ensure responses are professional, accurate, and safe.' %}
{%- set ns = namespace(tools_message='', system_message='') %}
{%- if tools %}
    {%- set ns.tools_message = tools_prefix %}
    {%- for tool in tools %}
        {%- set ns.tools_message = ns.tools_message + '\n' + (tool | tojson) %}
    {%- endfor %}
    {%- set ns.tools_message = ns.tools_message + tools_suffix %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set ns.system_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if ns.system_message and ns.tools_message %}
    {%- set ns.system_message = ns.system_message + '\n\n' + ns.tools_message %}
{%- elif ns.tools_message %}
    {%- set ns.system_message = ns.tools_message %}
{%- elif not ns.system_message %}
    {%- set ns.system_message = default_system %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + ns.system_message + '<|end_of_text|>\n' }}
{%- for message in loop_messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or message.role == 'system' %}
        {{- '<|start_of_role|>' + message.role + '<|end_of_role|>' + content + '<|end_of_text|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|start_of_role|>assistant<|end_of_role|>' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|end_of_text|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|start_of_role|>user<|end_of_role|>' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|end_of_text|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_of_role|>assistant<|end_of_role|>' }}
{%- endif %}
"""

#: Llama-3.1 style: bos_token, today's date from strftime_now, tools in the first user message,
#: one tool call at a time (raise_exception otherwise), the tool's turn as ipython
LLAMA3 = r"""
{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- "Given the following functions, please respond with a JSON for a function call.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable and message.content is not string %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

#: Qwen-3 style: earlier turns' reasoning dropped (only the turns after the last user message keep
#: theirs), `{% generation %}` around the assistant's text, `{% break %}`, an `enable_thinking` switch
REASONING = r"""
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = (messages | length - 1) - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query and message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content | trim + '\n</think>\n\n' }}
        {%- endif %}
        {{- content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

#: renders the last system prompt first, whatever turn it came in: a new one rewrites the start
LAST_SYSTEM = r"""
{%- set ns = namespace(system='') %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- set ns.system = message.content %}
    {%- endif %}
{%- endfor %}
{%- if ns.system %}
    {{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages if message.role != 'system' %}
    {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


#: Zephyr style, without whitespace control: what it renders hangs on trim_blocks (the newline
#: after a block tag) and lstrip_blocks (the indentation before one), as transformers sets them
ZEPHYR = r"""
{% for message in messages %}
    {% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
    {% else %}
{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') + eos_token }}
    {% endif %}
    {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
    {% endif %}
{% endfor %}
"""


def _added(content: str, *, typed: bool = True) -> dict[str, Any]:
    """A special token as transformers writes an AddedToken: `typed` in tokenizer_config.json's
    special tokens (transformers 5 refuses them untyped there), untyped in added_tokens_decoder
    and special_tokens_map.json."""
    fields = {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
              "special": True}
    return {"__type": "AddedToken", **fields} if typed else fields


#: name -> tokenizer_config.json entries besides the template (special tokens in both forms)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "chatml": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}),
    "granite": (GRANITE, {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>",
                          "unk_token": "<|unk|>"}),
    "llama3": (LLAMA3, {"bos_token": _added("<|begin_of_text|>"), "eos_token": _added("<|eot_id|>"),
                        "added_tokens_decoder": {"1": _added("<|begin_of_text|>", typed=False),
                                                 "2": _added("<|eot_id|>", typed=False)}}),
    "reasoning": (REASONING, {"eos_token": "<|im_end|>"}),
    "last_system": (LAST_SYSTEM, {"eos_token": "<|im_end|>"}),
    "plain": (PLAIN_CHAT_TEMPLATE, {}),
    "zephyr": (ZEPHYR, {"eos_token": "</s>"}),
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city; answers in °C <b>not</b> °F & rounds.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                       "required": ["city"]},
    },
}]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "chat": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? Answer in <b>bold</b> & ünïcode "},
    ],
    "no_system": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ],
    "tool_turn": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 °C, sunny"},
        # reasoning under an older name: transformers aliases it to reasoning_content
        {"role": "assistant", "content": "It is 18 °C and sunny.", "reasoning": "The tool said so."},
        {"role": "user", "content": "Thanks!"},
    ],
    # the turn in progress: reasoning after the last user message, under gpt-oss's name
    "thinking_tail": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "thinking": "Better check.", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 °C, sunny"},
    ],
}

FIXED_NOW = datetime(2026, 3, 7, 12, 0, 0)


def _write_dir(path: Path, config: dict[str, Any], files: dict[str, str] | None = None) -> Path:
    """A tokenizer directory transformers loads offline: a tiny WordLevel tokenizer.json (the
    rendering never looks at it) and tokenizer_config.json, plus any template files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    entries = {k: v for k, v in config.items() if v is not None}
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            **entries}))
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def _hf(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ChatTemplate, Any]]:
    """name -> (ours, transformers' tokenizer), from the same directory."""
    out = {}
    for name, (template, config) in CONFIGS.items():
        d = _write_dir(tmp_path_factory.mktemp("tok") / name, {**config, "chat_template": template})
        out[name] = (ChatTemplate.from_directory(d), _hf(d))
    return out


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> datetime:
    """transformers' strftime_now reads FIXED_NOW (ours is given it): no midnight between them."""
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")

    class _Frozen(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:
            return FIXED_NOW

    monkeypatch.setattr(ctu, "datetime", _Frozen)
    return FIXED_NOW


@pytest.mark.crosscheck
@pytest.mark.parametrize("generation", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("with_tools", [False, True], ids=["notools", "tools"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", sorted(CONFIGS))
def test_renders_as_transformers_does(pairs, frozen_clock, template, conversation, with_tools, generation):
    ours, theirs = pairs[template]
    messages, tools = CONVERSATIONS[conversation], TOOLS if with_tools else None
    expected = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=False)
    got = ours.render(messages, tools=tools, add_generation_prompt=generation, now=frozen_clock)
    assert got == expected
    assert len(got) > 20


@pytest.mark.crosscheck
def test_special_tokens_and_extra_variables_reach_the_template_as_in_transformers(pairs, frozen_clock):
    ours, theirs = pairs["llama3"]
    messages = CONVERSATIONS["chat"]
    got = ours.render(messages, now=frozen_clock)
    assert got.startswith("<|begin_of_text|><|start_header_id|>system") and "Today Date: 07 Mar 2026" in got
    assert ours.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    # an extra variable wins over the template's own default, and over a special token of its name
    for extra in ({"date_string": "01 Jan 2030"}, {"bos_token": "<BOS>"}):
        assert ours.render(messages, now=frozen_clock, **extra) == theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra)
    reasoning, theirs_r = pairs["reasoning"]
    off = reasoning.render(messages, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off == theirs_r.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               enable_thinking=False)


def test_strftime_now_reads_the_clock_unless_now_is_pinned():
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}")
    before = datetime.now().strftime("%Y-%m-%d")
    live = template.render([{"role": "user", "content": "x"}])
    assert live in (before, datetime.now().strftime("%Y-%m-%d"))
    assert template.render([{"role": "user", "content": "x"}], now=datetime(2031, 12, 30)) == "2031-12-30"


@pytest.mark.crosscheck
def test_pydantic_and_dataclass_messages_render_as_their_fields(pairs):
    class Message(BaseModel):
        role: str
        content: str | None = None
        tool_calls: list[dict[str, Any]] | None = None

    ours, theirs = pairs["granite"]
    dicts = CONVERSATIONS["tool_turn"][:4]
    models = [Message(**{k: v for k, v in m.items() if k in Message.model_fields}) for m in dicts]
    got = ours.render(models, tools=TOOLS)
    assert got == ours.render(dicts, tools=TOOLS)
    assert got == theirs.apply_chat_template(models, tools=TOOLS, add_generation_prompt=True, tokenize=False)


# --- where the template is read from -----------------------------------------------------------


@pytest.mark.crosscheck
def test_named_templates_choose_tool_use_when_tools_are_given(tmp_path):
    named = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": GRANITE}]
    d = _write_dir(tmp_path / "named", {"chat_template": named, "eos_token": "<|im_end|>"})
    ours, theirs = ChatTemplate.from_directory(d), _hf(d)
    messages = CONVERSATIONS["chat"]
    assert ours.named and sorted(ours.sources) == ["default", "tool_use"]
    for tools in (None, TOOLS, []):  # an empty list is "tools given", as in transformers
        assert ours.render(messages, tools=tools) == theirs.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours.render(messages, tools=[]).startswith("<|start_of_role|>system")
    assert ours.render(messages, name="tool_use") == ChatTemplate(GRANITE).render(messages)
    with pytest.raises(ChatTemplateError, match="no chat template named 'nope'"):
        ours.render(messages, name="nope")


def test_named_templates_without_a_default_must_be_named(tmp_path):
    d = _write_dir(tmp_path / "nodefault", {"chat_template": [{"name": "rag", "template": CHATML}]})
    ours = ChatTemplate.from_directory(d)
    with pytest.raises(ChatTemplateError, match="no \"default\""):
        ours.render(CONVERSATIONS["chat"])
    assert ours.render(CONVERSATIONS["chat"], name="rag").startswith("<|im_start|>system")


@pytest.mark.crosscheck
def test_template_files_take_priority_over_the_config_entry(tmp_path):
    # chat_template.jinja alone: the default; with additional_chat_templates/: named templates,
    # replacing the config's entry whole, as transformers 5 reads a local directory
    one = _write_dir(tmp_path / "one", {"chat_template": GRANITE, "eos_token": "<|im_end|>"},
                     files={"chat_template.jinja": CHATML})
    many = _write_dir(tmp_path / "many", {"chat_template": GRANITE, "eos_token": "<|im_end|>"},
                      files={"chat_template.jinja": CHATML, "additional_chat_templates/tool_use.jinja": LLAMA3})
    messages = CONVERSATIONS["chat"]
    for d in (one, many):
        ours, theirs = ChatTemplate.from_directory(d), _hf(d)
        for tools in (None, TOOLS):
            assert ours.render(messages, tools=tools, date_string="1 Jan") == theirs.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, date_string="1 Jan")
    assert not ChatTemplate.from_directory(one).named and ChatTemplate.from_directory(one).origin.endswith(
        "chat_template.jinja")
    assert sorted(ChatTemplate.from_directory(many).sources) == ["default", "tool_use"]


@pytest.mark.crosscheck
def test_an_older_config_takes_its_special_tokens_from_special_tokens_map(tmp_path):
    d = _write_dir(tmp_path / "legacy", {"chat_template": LLAMA3, "bos_token": "<s>"},
                   files={"special_tokens_map.json": json.dumps({"bos_token": _added("<|begin_of_text|>",
                                                                                     typed=False)})})
    ours, theirs = ChatTemplate.from_directory(d), _hf(d)
    assert ours.special_tokens["bos_token"] == "<|begin_of_text|>"
    messages = CONVERSATIONS["no_system"]
    assert ours.render(messages, date_string="x") == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, date_string="x")


def test_the_revision_follows_what_decides_the_text():
    a = ChatTemplate(CHATML, special_tokens={"eos_token": "<|im_end|>"})
    assert a.revision == ChatTemplate(CHATML, special_tokens={"eos_token": "<|im_end|>"}).revision
    assert a.revision != ChatTemplate(CHATML, special_tokens={"eos_token": "</s>"}).revision
    assert a.revision != ChatTemplate(CHATML + " ").revision
    assert a.revision.startswith("sha256:") and len(a.revision) == 71


# --- refusals ---------------------------------------------------------------------------------


def test_a_directory_without_a_template_is_refused_naming_the_file(tmp_path):
    d = _write_dir(tmp_path / "none", {"eos_token": "</s>"})
    with pytest.raises(NoChatTemplate) as caught:
        ChatTemplate.from_directory(d)
    assert str(d / "tokenizer_config.json") == caught.value.origin
    assert "tokenizer_config.json" in str(caught.value) and "chat_template.jinja" in str(caught.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoChatTemplate, match=r"tokenizer_config\.json"):
        ChatTemplate.from_directory(empty)


def test_unreadable_and_uncompilable_templates_are_refused_where_they_are_read(tmp_path):
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="cannot be read as JSON") as caught:
        ChatTemplate.from_directory(bad_json)
    assert not isinstance(caught.value, NoChatTemplate)
    bad_syntax = _write_dir(tmp_path / "bad_syntax", {"chat_template": "{% for m in messages %}{{ m.role }}"})
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json: line 1: .*endfor"):
        ChatTemplate.from_directory(bad_syntax)
    with pytest.raises(ChatTemplateError, match="a chat template is a string"):
        ChatTemplate.from_directory(_write_dir(tmp_path / "bad_type", {"chat_template": 7}))
    with pytest.raises(ChatTemplateError, match="needs \"name\" and \"template\""):
        ChatTemplate.from_directory(_write_dir(tmp_path / "bad_named", {"chat_template": [{"template": "x"}]}))


@pytest.mark.crosscheck
def test_raise_exception_is_refused_typed_with_the_templates_message(pairs):
    ours, theirs = pairs["granite"]
    messages = [{"role": "developer", "content": "x"}, *CONVERSATIONS["chat"]]
    jinja2 = pytest.importorskip("jinja2")
    with pytest.raises(jinja2.TemplateError) as hf:
        theirs.apply_chat_template(messages, tokenize=False)
    with pytest.raises(TemplateRaised) as caught:
        ours.render(messages)
    assert caught.value.message == str(hf.value) == "Unexpected role: developer"
    assert caught.value.origin == ours.origin and "Unexpected role: developer" in str(caught.value)
    err = application_error(caught.value)
    assert err.type == "TemplateRaised" and err.non_retryable
    assert err.details[0] == {"origin": ours.origin, "message": "Unexpected role: developer"}
    two_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "a", "arguments": {}}}] * 2}]
    with pytest.raises(TemplateRaised, match="only supports single tool-calls"):
        pairs["llama3"][0].render(two_calls)


def test_errors_in_a_templates_own_code_and_the_sandbox_are_refused_typed():
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(TemplateRaised, match="UndefinedError") as caught:
        ChatTemplate("{{ messages[0].nope.deeper }}").render(user)
    assert isinstance(caught.value, Failure)
    with pytest.raises(TemplateRaised, match="SecurityError"):
        ChatTemplate("{% set ns = namespace(_sneaky=1) %}").render(user)
    with pytest.raises(TemplateRaised, match="SecurityError"):
        ChatTemplate("{{ messages.append(1) }}").render(user)  # the sandbox is immutable
    # dict() as transformers gives it: the function, without the type's attributes
    assert ChatTemplate("{{ dict(b=1, a=2) | tojson }} {{ dict.fromkeys(['x'], 0) | tojson }}").render(user) == \
        '{"b": 1, "a": 2} {"x": 0}'
    assert ChatTemplate("{{ dict.__class__ }}").render(user) == ""
    # what the sandbox hides renders as nothing, as it does in transformers
    assert ChatTemplate("{{ messages.__class__ }}").render(user) == ""


def test_tojson_writes_prompts_not_html():
    out = ChatTemplate("{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}").render(
        [{"role": "user", "content": "<b>Zürich</b> & 'x'"}])
    assert out.split("|")[0] == '{"role": "user", "content": "<b>Zürich</b> & \'x\'"}'
    assert out.split("|")[1] == json.dumps({"content": "<b>Zürich</b> & 'x'", "role": "user"}, indent=2,
                                           ensure_ascii=False)


@pytest.mark.parametrize("messages, match", [
    ([], "empty conversation"),
    ("hello", "sequence of messages"),
    (["hello"], r"messages\[0\] is a str"),
    ([{"role": "user", "content": object()}], r"messages\[0\]: a object cannot be given"),
])
def test_messages_that_are_not_conversations_are_invalid_requests(messages, match):
    with pytest.raises(InvalidRequest, match=match):
        ChatTemplate.plain().render(messages)


def test_render_refuses_extra_variables_it_sets_itself():
    with pytest.raises(InvalidRequest, match="pass now="):
        ChatTemplate.plain().render([{"role": "user", "content": "x"}], strftime_now=lambda fmt: "")
    with pytest.raises(InvalidRequest, match="tools"):
        ChatTemplate.plain().render([{"role": "user", "content": "x"}], tools={"name": "f"})


# --- a turn against what was fed ----------------------------------------------------------------


def test_continuation_of_token_lists():
    assert continuation([1, 2, 3], [1, 2, 3, 4, 5]) == Continuation(fed=3, common=3, tokens=(4, 5))
    assert continuation([1, 2, 3], [1, 2, 3]).extends and continuation([1, 2, 3], [1, 2, 3]).tokens == ()
    assert continuation([], [7]).extends
    fork = continuation([1, 2, 3, 4], [1, 2, 9, 4, 5])
    assert (fork.extends, fork.common, fork.tokens) == (False, 2, (9, 4, 5))
    shorter = continuation([1, 2, 3], [1, 2])  # a rendering that stops inside what was fed
    assert (shorter.extends, shorter.common, shorter.tokens) == (False, 2, ())
    assert continuation([5], [6]).common == 0


def _turns(template: ChatTemplate, replies: list[dict[str, Any]], users: list[dict[str, Any]]
           ) -> list[Continuation]:
    """A conversation turn by turn, as a stream is fed: each turn renders the whole conversation
    with the generation prompt, compares it with what was fed, feeds the rest; then the reply is
    fed as the model would have generated it (its text as the template renders an answer now)."""
    encode = ByteTransform().encode
    fed: list[int] = []
    out = []
    messages: list[dict[str, Any]] = []
    for user, reply in zip(users, replies, strict=True):
        messages.append(user)
        step = continuation(fed, encode(template.render(messages)))
        out.append(step)
        fed = fed[: step.common] + list(step.tokens)
        generated = template.render([*messages, reply], add_generation_prompt=False)
        prompt = template.render(messages)
        # what the model generated: the reply's rendering after the prompt, up to its end token
        fed += encode(generated[len(prompt):].rstrip("\n"))
        messages.append(reply)
    return out


def test_a_turn_appended_extends_what_was_fed():
    template = ChatTemplate(CHATML)
    users = [{"role": "user", "content": f"question {i}"} for i in range(4)]
    replies = [{"role": "assistant", "content": f"answer {i}"} for i in range(4)]
    steps = _turns(template, replies, users)
    assert all(s.extends for s in steps)
    assert [s.common == s.fed for s in steps] == [True] * 4 and steps[-1].fed > 0
    # each turn feeds exactly the newline after the reply's end token and the new turn
    assert bytes(steps[1].tokens).decode() == "\n<|im_start|>user\nquestion 1<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_drops_earlier_reasoning_forks_where_it_rewrites():
    template = ChatTemplate(REASONING)
    users = [{"role": "user", "content": "q0"}, {"role": "user", "content": "q1"}]
    replies = [{"role": "assistant", "content": "a0", "reasoning_content": "think 0"},
               {"role": "assistant", "content": "a1", "reasoning_content": "think 1"}]
    first, second = _turns(template, replies, users)
    assert first.extends
    # the first reply was fed with its <think> block; once a later user turn exists the template
    # renders it without: the fork is right after that reply's header
    prompt0 = template.render([users[0]])
    assert not second.extends and second.common == len(prompt0.encode())
    assert bytes(second.tokens).decode().startswith("a0<|im_end|>\n<|im_start|>user\nq1")


def test_reasoning_kept_within_a_turn_extends():
    # a tool round trip inside one turn: no new user message, so the reasoning stays rendered
    template = ChatTemplate(REASONING)
    encode = ByteTransform().encode
    messages = [{"role": "user", "content": "q"}]
    fed = encode(template.render(messages)) + encode("<think>\nlook it up\n</think>\n\ncalling<|im_end|>")
    messages += [{"role": "assistant", "content": "calling", "reasoning_content": "look it up"},
                 {"role": "tool", "content": "42"}]
    step = continuation(fed, encode(template.render(messages)))
    assert step.extends and bytes(step.tokens).decode() == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_renders_the_last_system_prompt_forks_at_the_first_difference():
    template = ChatTemplate(LAST_SYSTEM)
    encode = ByteTransform().encode
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    fed = encode(template.render(messages)) + encode("hello<|im_end|>")
    messages += [{"role": "assistant", "content": "hello"}, {"role": "system", "content": "Be verbose."},
                 {"role": "user", "content": "again"}]
    step = continuation(fed, encode(template.render(messages)))
    assert not step.extends and step.fed == len(fed)
    assert step.common == len(b"<|im_start|>system\nBe ")
    assert bytes(step.tokens).decode().startswith("verbose.<|im_end|>\n<|im_start|>user\nhi")


# --- the presets' template and the loaded model's ------------------------------------------------


def test_presets_render_the_documented_plain_template():
    model = load_model("tiny-mamba2")
    template = model.chat_template
    assert template.source() == PLAIN_CHAT_TEMPLATE and template.special_tokens == {}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Zürich?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
            {"name": "get_time", "arguments": {"tz": "CET"}},
        ]},
        {"role": "tool", "content": "18 °C"},
    ]
    text = template.render(messages, tools=TOOLS)
    assert text == (
        "<|tools|>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n"
        "<|system|>\nBe brief.\n"
        "<|user|>\nWeather in Zürich?\n"
        '<|assistant|>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>\n'
        "<|tool|>\n18 °C\n"
        "<|assistant|>\n"
    )
    assert template.render(messages[:2], add_generation_prompt=False) == \
        "<|system|>\nBe brief.\n<|user|>\nWeather in Zürich?\n"
    # the round trip through the presets' byte transform
    assert model.transform.decode(model.transform.encode(text)) == text


def test_the_plain_template_only_ever_extends():
    template = ChatTemplate.plain()
    conversation = CONVERSATIONS["tool_turn"]
    for n in range(1, len(conversation)):
        before, after = conversation[:n], conversation[: n + 1]
        for tools in (None, TOOLS):
            assert template.render(after, tools=tools, add_generation_prompt=False).startswith(
                template.render(before, tools=tools, add_generation_prompt=False))
            if after[-1]["role"] == "assistant":  # the prompt, then what the model generates
                assert template.render(after, tools=tools, add_generation_prompt=False).startswith(
                    template.render(before, tools=tools))
    users = [{"role": "user", "content": f"q{i}"} for i in range(3)]
    replies = [{"role": "assistant", "content": f"a{i}"} for i in range(3)]
    assert all(s.extends for s in _turns(template, replies, users))


def test_trained_presets_have_the_plain_template():
    assert load_model("recall-mamba1").chat_template.source() == PLAIN_CHAT_TEMPLATE


def test_a_checkpoint_directory_brings_its_template(tmp_path):
    d = save_checkpoint(load_model("tiny-mamba2"), tmp_path / "ckpt")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>"}))
    model = load_model(d)
    assert model.chat_template.revision == ChatTemplate.from_directory(d).revision
    assert model.chat_template.render(CONVERSATIONS["chat"], now=FIXED_NOW).startswith("<|begin_of_text|>")


def test_a_model_without_a_template_is_refused_naming_the_file(tmp_path):
    d = save_checkpoint(load_model("tiny-mamba2"), tmp_path / "ckpt")
    model = load_model(d)  # it loads: tokens need no template
    for _ in range(2):  # the same refusal each time it is asked
        with pytest.raises(NoChatTemplate, match=r"tokenizer_config\.json") as caught:
            _ = model.chat_template
        assert caught.value.origin == str(d / "tokenizer_config.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    broken = load_model(d)
    with pytest.raises(ChatTemplateError, match="line 1") as caught:
        _ = broken.chat_template
    assert not isinstance(caught.value, NoChatTemplate)
    built = init_model(load_model("tiny-mamba1").config, seed=0)
    with pytest.raises(NoChatTemplate, match="has no chat template"):
        _ = built.chat_template


def test_a_template_survives_a_copy_a_deep_copy_and_a_pickle_and_renders_alike():
    """A model is deep-copied in places (and may be pickled to a process): its template with it."""
    import copy
    import pickle

    t = ChatTemplate({"default": "{{ messages[0]['content'] }}!", "tool_use": "T"}, special_tokens={"bos_token": "<s>"})
    msgs = [{"role": "user", "content": "hi"}]
    for other in (copy.copy(t), copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert other.render(msgs) == t.render(msgs) == "hi!" and other.revision == t.revision
        assert other.render(msgs, tools=[]) == "T"
