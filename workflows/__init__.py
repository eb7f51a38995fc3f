"""Workflows (sandbox-safe: the standard library, temporalio, pydantic and state_codec's record).

    from workflows import MambaStreamWorkflow, StreamClient
    streams = StreamClient(client)                     # client built with MambaStreamPlugin
    sid = await streams.open("alice", "tiny-mamba2")
    result = await streams.advance(sid, "alice", text="hello")   # update id derived from chunk_seq
"""

from workflows._agent import AgentWorkflow
from workflows._client import DEFAULT_TASK_QUEUE, StreamClient, new_stream_id, update_id
from workflows._models import (
    AdvanceRequest,
    AdvanceResult,
    AgentInput,
    AgentResult,
    CheckpointRequest,
    CheckpointResult,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    OpenStreamInput,
    ResetRequest,
    StreamOptions,
    StreamStats,
    TokenLogprob,
)
from workflows._stream import MambaStreamWorkflow

__all__ = [
    "DEFAULT_TASK_QUEUE",
    "AdvanceRequest",
    "AdvanceResult",
    "AgentInput",
    "AgentResult",
    "AgentWorkflow",
    "CheckpointRequest",
    "CheckpointResult",
    "GenerateRequest",
    "GenerateResult",
    "MambaStreamWorkflow",
    "ModelInfo",
    "OpenStreamInput",
    "ResetRequest",
    "StreamClient",
    "StreamOptions",
    "StreamStats",
    "TokenLogprob",
    "new_stream_id",
    "update_id",
]
