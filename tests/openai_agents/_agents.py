"""The agent workflows the provider's tests run (imported by the workflow sandbox)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from agents import Agent, ModelSettings, Runner, function_tool
    from pydantic import BaseModel, Field


#: a byte-level model's replies kept to ASCII (bytes over 127 banned): text that re-encodes to its tokens
ASCII = {b: -100.0 for b in range(128, 256)}


@function_tool
async def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@workflow.defn
class Assistant:
    """Turns chained by response ids: each model call after the first brings only its new items."""

    @workflow.run
    async def run(self, questions: list[str], previous: str | None = None, seed: int | None = None) -> list[str]:
        extra = {"top_k": 20, "logit_bias": ASCII, **({"seed": seed} if seed is not None else {})}
        settings = ModelSettings(max_tokens=6, temperature=0.8, extra_args=extra)
        agent = Agent(name="assistant", instructions="Answer in a few words.", model="tiny-mamba2", tools=[weather],
                      model_settings=settings)
        out = []
        for q in questions:
            result = await Runner.run(agent, q, previous_response_id=previous)
            previous = result.last_response_id
            out.extend([result.final_output, previous or ""])
        return out


@workflow.defn
class LongChat:
    """`turns` short turns chained by response ids, continuing as new every `per_run` turns with
    the last response id alone (the conversation stays behind it, in its stream)."""

    @workflow.run
    async def run(self, turns: int, per_run: int, previous: str | None = None, done: int = 0) -> str | None:
        settings = ModelSettings(max_tokens=2, extra_args={"top_k": 8, "logit_bias": ASCII})
        agent = Agent(name="chat", instructions="Reply.", model="tiny-mamba2", model_settings=settings)
        for i in range(done, min(turns, done + per_run)):
            previous = (await Runner.run(agent, f"turn {i}", previous_response_id=previous)).last_response_id
        if done + per_run < turns:
            workflow.continue_as_new(args=[turns, per_run, previous, done + per_run])
        return previous


class Place(BaseModel):
    """A short name: even a random model completes a call naming one in a few tokens."""

    city: str = Field(max_length=8)


@function_tool
async def sky(place: Place) -> str:
    """The sky over a place."""
    return f"clear over {place.city}"


class Forecast(BaseModel):
    """A structured output: bounded, so that even a random model completes it in a few tokens."""

    city: str = Field(max_length=8)
    days: int = Field(ge=0, le=30)


@workflow.defn
class HeldToGrammar:
    """A turn that must call a tool (tool_choice "required"; the SDK resets it after the call, so
    the next turn answers freely), then an agent whose answer is a `Forecast`."""

    @workflow.run
    async def run(self) -> list:
        extra = {"top_k": 20, "logit_bias": ASCII}
        # room for the longest reply the grammars allow (byte tokens): a call of `sky` whose city
        # is eight `\uXXXX` escapes is 124 bytes, then the end (the seed is the stream's: any run)
        agent = Agent(name="tools", instructions="Use the tool.", model="tiny-mamba2", tools=[sky],
                      model_settings=ModelSettings(max_tokens=160, tool_choice="required", extra_args=extra))
        used = await Runner.run(agent, "weather in Paris?", max_turns=3)
        calls = [[i.raw_item.name, i.raw_item.arguments] for i in used.new_items if i.type == "tool_call_item"]
        outputs = [i.output for i in used.new_items if i.type == "tool_call_output_item"]
        planner = Agent(name="planner", instructions="Plan a trip.", model="tiny-mamba2", output_type=Forecast,
                        model_settings=ModelSettings(max_tokens=160, extra_args=extra))
        plan = await Runner.run(planner, "Plan.")
        return [calls, outputs, plan.final_output.model_dump()]
