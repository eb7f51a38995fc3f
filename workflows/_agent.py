"""The example agent: a conversation workflow that owns its model stream (README, "Embed a stream
in your agent workflow").

Each user message is a `say` update, sealed by the principal's key (`check_sender`): the agent
feeds it to its stream, generates a reply (streamed to the workflow's token-log readers, as a
`MambaStreamWorkflow`'s are) and answers with it. Every chunk is an activity of this workflow,
exactly once through a worker's SIGKILL (the commit protocol finds the chunk's record). A long
conversation continues as new with its stream carried over; `end` disposes of the stream.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows._model_stream import ModelStream, TokenLogQueries, check_sender
    from workflows._models import CarriedStream, SealedRequest, StreamOptions

__all__ = ["ChatAgent", "ChatEnd", "ChatInput", "ChatMessage", "ChatReply"]


class ChatInput(SealedRequest):
    principal: str
    model_id: str
    options: StreamOptions = StreamOptions()
    reply_tokens: int = 32
    turns: int = 0
    carried: CarriedStream | None = None  # set by the agent itself when it continues as new


class ChatMessage(SealedRequest):
    principal: str
    text: str


class ChatEnd(SealedRequest):
    principal: str


class ChatReply(BaseModel):
    turn: int
    text: str | None
    tokens: list[int]
    position: int


@workflow.defn(name="ChatAgent")
class ChatAgent(TokenLogQueries):  # read_tokens, token_offset, receipt, stats: for StreamClient's readers
    @workflow.init
    def __init__(self, inp: ChatInput) -> None:
        self.inp, self.stream, self.turns, self.ended = inp, None, inp.turns, False
        self.lock = asyncio.Lock()

    @workflow.run
    async def run(self, inp: ChatInput) -> int:
        check_sender(inp, inp.principal, "start")  # the start input is the principal's
        self.stream = await (ModelStream.carried_over(inp.carried) if inp.carried
                             else ModelStream.open(inp.principal, inp.model_id, inp.options))
        try:
            await workflow.wait_condition(lambda: self.ended or workflow.info().is_continue_as_new_suggested())
            await workflow.wait_condition(workflow.all_handlers_finished)
        except asyncio.CancelledError:
            await self.stream.dispose()
            raise
        if self.ended:
            await self.stream.dispose()
            return self.turns
        workflow.continue_as_new(inp.model_copy(update={"turns": self.turns,
                                                        "carried": await self.stream.carry_over()}))

    @workflow.update
    async def say(self, msg: ChatMessage) -> ChatReply:
        await workflow.wait_condition(lambda: self.stream is not None)
        async with self.lock:  # a turn's two chunks together
            await self.stream.advance(text=f"User: {msg.text}\nAssistant:")
            out = await self.stream.generate(self.inp.reply_tokens, stop=["\nUser:"], stream=True)
            self.turns += 1
            return ChatReply(turn=self.turns, text=out.text, tokens=out.tokens, position=out.position)

    @workflow.update
    async def end(self, req: ChatEnd) -> int:
        self.ended = True
        return self.turns

    @say.validator
    def _check_say(self, msg: ChatMessage) -> None:
        check_sender(msg, self.inp.principal, "say")

    @end.validator
    def _check_end(self, req: ChatEnd) -> None:
        check_sender(req, self.inp.principal, "end")
