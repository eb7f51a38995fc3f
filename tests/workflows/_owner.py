"""A workflow of the tests' own that owns a `ModelStream` (tests/workflows/test_model_stream.py):
it feeds its chunks, resets before one of them, continues as new when the server suggests it,
generates when signalled, and waits until it is cancelled, which disposes the stream."""

from __future__ import annotations

import asyncio

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from mamba_stream.workflows import (
        CarriedStream,
        ModelStream,
        SealedRequest,
        StreamOptions,
        StreamOwner,
        check_sender,
    )


class OwnerInput(SealedRequest):
    principal: str
    model_id: str
    options: StreamOptions
    chunks: list[list[int]]
    reset_before: int = -1
    generate: int = 0
    done: int = 0
    carried: CarriedStream | None = None
    prefix: list[int] | None = None


@workflow.defn(name="TestStreamOwner")
class TestOwner(StreamOwner):
    @workflow.init
    def __init__(self, inp: OwnerInput) -> None:
        self.stream: ModelStream | None = None
        self.fed = self.go = self.finished = False

    @workflow.run
    async def run(self, inp: OwnerInput) -> None:
        check_sender(inp, inp.principal, "start")
        self.stream = await ModelStream.open(inp.principal, inp.model_id, inp.options, carried=inp.carried,
                                             prefix=inp.prefix)
        try:
            for i in range(inp.done, len(inp.chunks)):
                if i == inp.reset_before:
                    await self.stream.reset()
                await self.stream.advance(tokens=inp.chunks[i])
                if workflow.info().is_continue_as_new_suggested() and i + 1 < len(inp.chunks):
                    workflow.continue_as_new(inp.model_copy(update={"done": i + 1, "prefix": None,
                                                                    "carried": await self.stream.carry_over()}))
            self.fed = True
            if inp.generate:  # once told to, outside any update (a reader learns of it from history alone)
                await workflow.wait_condition(lambda: self.go)
                await self.stream.generate(inp.generate, temperature=0.0)
            self.finished = True
            await workflow.wait_condition(lambda: False)  # until cancelled
        except asyncio.CancelledError:
            await self.stream.dispose()
            raise

    @workflow.signal
    def generate_now(self) -> None:
        self.go = True

    @workflow.query
    def done(self) -> bool:
        return self.finished

    @workflow.query
    def all_fed(self) -> bool:
        return self.fed
