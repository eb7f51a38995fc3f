"""The Pydantic AI agent workflows the model's tests run (imported by the workflow sandbox)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel, ConfigDict, Field
    from pydantic_ai import Agent, ModelSettings, NativeOutput
    from pydantic_ai.durable_exec.temporal import TemporalDurability
    from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelRequest, UserPromptPart
    from pydantic_ai.models import ModelRequestParameters

    from mamba_stream.pydantic_ai import MambaModel
    from mamba_stream.workflows import Grammar

#: a byte-level model's replies kept to ASCII (bytes over 127 banned) and free of the plain
#: template's reply end ("\n"): each text reply is max_tokens bytes that re-encode to its tokens
BIAS = {str(b): -100 for b in (10, *range(128, 256))}
INSTRUCTIONS = "Answer in a few words."
#: the reply a question is answered with first: a few words, then a tool call, as the plain chat
#: template writes an assistant message with both (its reply end included)
CALL_TEXT, CALL_ARGS = "Checking. ", '{"city": "Paris"}'
CALL = f'{CALL_TEXT}<tool_call>{{"name": "weather", "arguments": {CALL_ARGS}}}</tool_call>\n'


def _literal(text: str) -> str:
    """`text` as a regular expression matching it alone (llguidance's syntax)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.+*?()|[]{}^$" else c for c in text)


class ToolFirst(MambaModel):
    """A random-weight model that calls the weather tool when asked a question: the request that
    ends on the user's prompt is held to `CALL` by a grammar (the reply is the call the template
    writes, sampled token by token like any reply); every other request is sampled freely."""

    def generate_settings(self, messages: Sequence[ModelMessage], model_settings: ModelSettings | None,
                          params: ModelRequestParameters) -> tuple[int, dict[str, Any]]:
        max_tokens, settings = super().generate_settings(messages, model_settings, params)
        last = messages[-1] if messages else None
        if isinstance(last, ModelRequest) and last.parts and isinstance(last.parts[-1], UserPromptPart):
            return len(CALL), {**settings, "grammar": Grammar(kind="regex", source=_literal(CALL))}
        return max_tokens, settings


#: the agent's model; its streams' task queue is the worker's MAMBA_STREAM_TASK_QUEUE (each test
#: sets its own)
MODEL = ToolFirst("tiny-mamba2", models="tiny-mamba2")
AGENT = Agent(MODEL, name="weather_chat", instructions=INSTRUCTIONS,
              model_settings=ModelSettings(max_tokens=6, temperature=0.8, top_k=20, logit_bias=BIAS),
              capabilities=[TemporalDurability(model_activity_config={
                  "start_to_close_timeout": timedelta(seconds=60)})])


@AGENT.tool_plain
def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@workflow.defn
class WeatherChat:
    """Questions asked in turn, each run given the messages of the ones before (Pydantic AI sends
    them all every request); `history`: the messages of an earlier conversation (JSON) to go on
    from; `seed`: every request's. Returns every message, as JSON."""

    __pydantic_ai_agents__: ClassVar[list[Agent]] = [AGENT]

    @workflow.run
    async def run(self, questions: list[str], history: str | None = None, seed: int | None = None) -> str:
        messages = ModelMessagesTypeAdapter.validate_json(history) if history else None
        fixed = ModelSettings(seed=seed) if seed is not None else None  # else derived from the stream
        for q in questions:
            messages = (await AGENT.run(q, message_history=messages, model_settings=fixed)).all_messages()
        return ModelMessagesTypeAdapter.dump_json(messages or []).decode()


class Forecast(BaseModel):
    """A structured output: bounded (no other properties, a short name), so that even a random
    model completes it in a few tokens."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=8)
    days: int = Field(ge=0, le=30)


#: a model with no help of the test's: what it must reply is held by the grammar its request asks for
PLAIN = MambaModel("tiny-mamba2", models="tiny-mamba2")
#: room for the longest reply the grammar allows (byte tokens): the call with a city of eight
#: `\uXXXX` escapes and 30 days is 134 bytes, then the end; 96 was cut on a city of escapes
_PLANNING = {"instructions": "Plan a trip.", "capabilities": [TemporalDurability(model_activity_config={
    "start_to_close_timeout": timedelta(seconds=60)})],
             "model_settings": ModelSettings(max_tokens=160, temperature=0.8, top_k=20, logit_bias=BIAS)}
#: its output through a tool call (Pydantic AI's default), and as the reply's text (native)
PLANNER = Agent(PLAIN, name="planner", output_type=Forecast, **_PLANNING)
NATIVE_PLANNER = Agent(PLAIN, name="native_planner", output_type=NativeOutput(Forecast), **_PLANNING)


@workflow.defn
class Plans:
    """A `Forecast` from each planner; returns them, and their responses' part kinds."""

    __pydantic_ai_agents__: ClassVar[list[Agent]] = [PLANNER, NATIVE_PLANNER]

    @workflow.run
    async def run(self) -> list[Any]:
        out = []
        for agent in (PLANNER, NATIVE_PLANNER):
            result = await agent.run("Plan.")
            kinds = [[p.part_kind for p in m.parts] for m in result.all_messages() if m.kind == "response"]
            out.append([result.output.model_dump(), kinds])
        return out
