"""The two shapes of one agent turn (bench/bench_agent.py), as workflows (bench only).

`InWorkflowAgent`: the agent owns its stream (`workflows.ModelStream`): a turn is two chunks, each
an activity of the agent's own workflow. `ChildPathAgent`: the shape agents had before
ModelStream: the stream is a `MambaStreamWorkflow` child, and a turn is an activity of the agent
that sends the child its `advance` and `generate` updates through a client (the child then runs
its own workflow task and chunk activity for each).
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel
from temporalio import activity, workflow
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from mamba_stream.workflows import (
        CancelRequest,
        MambaStreamWorkflow,
        ModelStream,
        OpenStreamInput,
        SealedRequest,
        StreamOptions,
        check_sender,
    )

ACTIVITY_CHILD_TURN = "bench_child_turn"


class AgentInput(SealedRequest):
    principal: str
    model_id: str
    options: StreamOptions = StreamOptions()


class Turn(SealedRequest):
    principal: str
    tokens: list[int]
    generate: int


class ChildTurn(BaseModel):
    stream_id: str
    principal: str
    chunk_seq: int
    tokens: list[int]
    generate: int


@workflow.defn(name="BenchInWorkflowAgent")
class InWorkflowAgent:
    @workflow.init
    def __init__(self, inp: AgentInput) -> None:
        self.inp, self.stream, self.done = inp, None, False

    @workflow.run
    async def run(self, inp: AgentInput) -> None:
        check_sender(inp, inp.principal, "start")
        self.stream = await ModelStream.open(inp.principal, inp.model_id, inp.options)
        await workflow.wait_condition(lambda: self.done)
        await workflow.wait_condition(workflow.all_handlers_finished)
        await self.stream.dispose()

    @workflow.update
    async def turn(self, t: Turn) -> list[int]:
        await workflow.wait_condition(lambda: self.stream is not None)
        await self.stream.advance(tokens=t.tokens)
        return (await self.stream.generate(t.generate, temperature=0.0)).tokens

    @workflow.update
    async def feed(self, t: Turn) -> int:
        """One advance alone (bench/trip_count.py)."""
        await workflow.wait_condition(lambda: self.stream is not None)
        return (await self.stream.advance(tokens=t.tokens)).position

    @turn.validator
    def _check(self, t: Turn) -> None:
        check_sender(t, self.inp.principal, "turn")

    @feed.validator
    def _check_feed(self, t: Turn) -> None:
        check_sender(t, self.inp.principal, "feed")

    @workflow.signal
    def finish(self) -> None:
        self.done = True


@workflow.defn(name="BenchChildPathAgent")
class ChildPathAgent:
    @workflow.init
    def __init__(self, inp: AgentInput) -> None:
        self.inp, self.done, self.seq = inp, False, 0
        self.stream_id = f"{workflow.info().workflow_id}-stream"

    @workflow.run
    async def run(self, inp: AgentInput) -> None:
        await workflow.start_child_workflow(
            MambaStreamWorkflow.run, OpenStreamInput(principal=inp.principal, model_id=inp.model_id,
                                                     options=inp.options),
            id=self.stream_id, parent_close_policy=ParentClosePolicy.REQUEST_CANCEL)
        await workflow.wait_condition(lambda: self.done)
        await workflow.wait_condition(workflow.all_handlers_finished)
        await workflow.get_external_workflow_handle(self.stream_id).signal(
            MambaStreamWorkflow.cancel, CancelRequest(principal=inp.principal))

    @workflow.update
    async def turn(self, t: Turn) -> list[int]:
        self.seq += 2
        return await workflow.execute_activity(
            ACTIVITY_CHILD_TURN, ChildTurn(stream_id=self.stream_id, principal=t.principal, chunk_seq=self.seq - 1,
                                           tokens=t.tokens, generate=t.generate),
            start_to_close_timeout=timedelta(seconds=60), result_type=list[int])

    @workflow.signal
    def finish(self) -> None:
        self.done = True


@activity.defn(name=ACTIVITY_CHILD_TURN)
async def child_turn(req: ChildTurn) -> list[int]:
    """The turn's two updates to the child stream, under ids of their chunk: idempotent."""
    from mamba_stream.workflows import StreamClient

    streams = StreamClient(activity.client(), activity.info().task_queue)
    await streams.advance(req.stream_id, req.principal, tokens=req.tokens, chunk_seq=req.chunk_seq)
    out = await streams.generate(req.stream_id, req.principal, req.generate, temperature=0.0,
                                 chunk_seq=req.chunk_seq + 1)
    return out.tokens
