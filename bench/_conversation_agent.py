"""The agent workflow bench/bench_conversations.py drives (imported by the workflow sandbox): one
OpenAI Agents SDK turn per update, each turn a forced call of a function tool and then a free
answer, chained by response ids (ours) or sent whole every time (stateless)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from agents import Agent, ModelSettings, Runner, function_tool
    from pydantic import BaseModel, Field

#: a byte-level model's replies kept to ASCII (bytes over 127 banned): text that re-encodes to its
#: tokens, so that no turn forks for a reply cut inside a UTF-8 character
ASCII = {b: -100.0 for b in range(128, 256)}


class Query(BaseModel):
    """What the tool looks up: a short word (a random model completes a call naming one)."""

    word: str = Field(max_length=6)


@function_tool
async def lookup(query: Query) -> str:
    """Look a word up in the glossary."""
    return f"{query.word}: a word of {len(query.word)} letters"


class TurnInput(BaseModel):
    question: str
    model: str
    max_tokens: int
    seed: int


class TurnOutput(BaseModel):
    fed_tokens: int
    output_tokens: int
    model_calls: int
    tool_calls: int


@workflow.defn
class BenchConversation:
    """`stateless`: every turn sends the whole conversation and no previous response id (as to a
    server that keeps nothing); otherwise each turn chains the last response id and sends only
    its new message."""

    @workflow.init
    def __init__(self, stateless: bool) -> None:  # before any update: a turn may come with the start
        self.stateless = stateless
        self.previous: str | None = None
        self.items: list = []
        self.ended = False

    @workflow.run
    async def run(self, stateless: bool) -> None:
        await workflow.wait_condition(lambda: self.ended and workflow.all_handlers_finished())

    @workflow.update
    async def turn(self, inp: TurnInput) -> TurnOutput:
        settings = ModelSettings(max_tokens=inp.max_tokens, tool_choice="required",
                                 extra_args={"seed": inp.seed, "top_k": 20, "logit_bias": ASCII})
        agent = Agent(name="glossary", instructions="Look the word up, then answer in one line.", model=inp.model,
                      tools=[lookup], model_settings=settings)
        if self.stateless:
            result = await Runner.run(agent, [*self.items, {"role": "user", "content": inp.question}], max_turns=4)
            self.items = result.to_input_list()
        else:
            result = await Runner.run(agent, inp.question, previous_response_id=self.previous, max_turns=4)
            self.previous = result.last_response_id
        return TurnOutput(fed_tokens=sum(r.usage.input_tokens for r in result.raw_responses),
                          output_tokens=sum(r.usage.output_tokens for r in result.raw_responses),
                          model_calls=len(result.raw_responses),
                          tool_calls=sum(1 for i in result.new_items if i.type == "tool_call_item"))

    @workflow.signal
    def end(self) -> None:
        self.ended = True
