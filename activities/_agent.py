"""The example agent's activity: feed one turn to the agent's stream through the client."""

from __future__ import annotations

from temporalio import activity

from workflows import ACTIVITY_AGENT_FEED, AdvanceResult, AgentFeedRequest, StreamClient

__all__ = ["agent_feed_stream"]


@activity.defn(name=ACTIVITY_AGENT_FEED)
async def agent_feed_stream(req: AgentFeedRequest) -> AdvanceResult:
    """Send turn `chunk_seq` as the `advance` update whose id is that turn: idempotent."""
    streams = StreamClient(activity.client(), activity.info().task_queue)
    return await streams.advance(req.stream_id, req.principal, text=req.text, chunk_seq=req.chunk_seq)
