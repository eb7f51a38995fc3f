"""An example agent: a conversation workflow that owns a stream as a child workflow.

Each turn is fed through an activity that sends the `advance` update to the child with the
update id of its turn number, so a retried turn is answered from the first result instead of
being fed twice. When the conversation ends the agent sends the child its `cancel` signal (sealed
by the workers, as the agent's principal) and its parent close policy the Temporal cancel request:
the child disposes of its state.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from workflows._models import (
        ACTIVITY_AGENT_FEED,
        AdvanceResult,
        AgentFeedRequest,
        AgentInput,
        AgentResult,
        CancelRequest,
        OpenStreamInput,
    )
    from workflows._stream import MambaStreamWorkflow

__all__ = ["AgentWorkflow"]


@workflow.defn(name="AgentConversation")
class AgentWorkflow:
    @workflow.run
    async def run(self, inp: AgentInput) -> AgentResult:
        stream_id = f"{workflow.info().workflow_id}-stream"
        await workflow.start_child_workflow(
            MambaStreamWorkflow.run,
            OpenStreamInput(principal=inp.principal, model_id=inp.model_id, options=inp.options),
            id=stream_id,
            parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,  # the stream ends with the agent
        )
        turns: list[AdvanceResult] = []
        for seq, text in enumerate(inp.turns, start=1):
            turns.append(await workflow.execute_activity(
                ACTIVITY_AGENT_FEED,
                AgentFeedRequest(stream_id=stream_id, principal=inp.principal, chunk_seq=seq, text=text),
                start_to_close_timeout=timedelta(seconds=inp.options.activity_timeout_s),
                retry_policy=RetryPolicy(maximum_attempts=inp.options.retry_max_attempts),
                result_type=AdvanceResult,
            ))
        # the stream's own cancel (sealed by the workers, as the agent's principal), then the
        # parent close policy's Temporal cancel request ends it as cancelled
        await workflow.get_external_workflow_handle(stream_id).signal(
            MambaStreamWorkflow.cancel, CancelRequest(principal=inp.principal))
        return AgentResult(stream_id=stream_id, turns=turns)
