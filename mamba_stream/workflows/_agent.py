"""The example agent: a conversation workflow that owns its model stream (README, "Embed a stream
in your agent workflow", shows this file from `ChatInput` on).

Each user message is a `say` update, sealed by the principal's key (`check_sender`): the agent
feeds it to its stream, generates a reply (streamed to the workflow's token-log readers, as a
`MambaStreamWorkflow`'s are) and answers with it. Every chunk is an activity of this workflow,
exactly once through a worker's SIGKILL (the commit protocol finds the chunk's record). A long
conversation continues as new with its stream carried over; an empty message ends it, and the
stream is disposed of. A Temporal cancel request, which anyone who reaches the frontend can send
without a key, is refused: the conversation goes on.
"""

from __future__ import annotations

import asyncio

from pydantic import Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from mamba_stream.workflows._model_stream import ModelStream, StreamOwner, check_sender
    from mamba_stream.workflows._models import CarriedStream, GenerateResult, SealedRequest, StreamOptions

__all__ = ["ChatAgent", "ChatInput", "ChatMessage"]


class ChatInput(SealedRequest):
    principal: str
    model_id: str
    options: StreamOptions = StreamOptions()
    reply_tokens: int = 32
    system: str | None = None  # the prompt it starts after: from the prefix store when an earlier agent stored it
    carried: CarriedStream | None = None  # set by the agent itself when it continues as new


class ChatMessage(SealedRequest):
    principal: str
    text: str = Field(default="", description="empty: the conversation ends")


@workflow.defn(name="ChatAgent")
class ChatAgent(StreamOwner):  # read_tokens, token_offset, receipt, stats: for StreamClient's readers
    @workflow.init
    def __init__(self, inp: ChatInput) -> None:
        self.inp, self.stream, self.ended, self.lock = inp, None, False, asyncio.Lock()

    @workflow.run
    async def run(self, inp: ChatInput) -> None:
        check_sender(inp, inp.principal, "start")  # the start input is the principal's
        self.stream = await ModelStream.open(inp.principal, inp.model_id, inp.options, carried=inp.carried,
                                             prefix=inp.system)
        while True:
            try:
                await workflow.wait_condition(lambda: self.ended or workflow.info().is_continue_as_new_suggested())
                await workflow.wait_condition(workflow.all_handlers_finished)
                break
            except asyncio.CancelledError:
                pass  # a Temporal cancel request carries no key: only the principal's empty message ends it
        if self.ended:
            return await self.stream.dispose()
        workflow.continue_as_new(inp.model_copy(update={"carried": await self.stream.carry_over(), "system": None}))

    @workflow.update
    async def say(self, msg: ChatMessage) -> GenerateResult | None:
        await workflow.wait_condition(lambda: self.stream is not None)
        async with self.lock:  # a turn's two chunks together
            if not msg.text:
                self.ended = True
                return None
            await self.stream.advance(text=f"User: {msg.text}\nAssistant:")
            return await self.stream.generate(self.inp.reply_tokens, stop=["\nUser:"], stream=True)

    @say.validator
    def _check_say(self, msg: ChatMessage) -> None:
        check_sender(msg, self.inp.principal, "say")  # sealed by the principal's key, or refused
