"""The agent workflows the provider's tests run (imported by the workflow sandbox)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from agents import Agent, ModelSettings, Runner, function_tool


#: a byte-level model's replies kept to ASCII (bytes over 127 banned): text that re-encodes to its tokens
ASCII = {b: -100.0 for b in range(128, 256)}


@function_tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@workflow.defn
class Assistant:
    """Turns chained by response ids: each model call after the first brings only its new items."""

    @workflow.run
    async def run(self, questions: list[str], previous: str | None = None) -> list[str]:
        settings = ModelSettings(max_tokens=6, temperature=0.8, extra_args={"top_k": 20, "logit_bias": ASCII})
        agent = Agent(name="assistant", instructions="Answer in a few words.", model="tiny-mamba2", tools=[weather],
                      model_settings=settings)
        out = []
        for q in questions:
            result = await Runner.run(agent, q, previous_response_id=previous)
            previous = result.last_response_id
            out.extend([result.final_output, previous or ""])
        return out
