"""Workflows (sandbox-safe: the standard library, temporalio, pydantic and state_codec's record).

    from workflows import ClientConfig, MambaStreamWorkflow, StreamClient
    cfg = ClientConfig()                               # address, task queue, keyring from the environment
    streams = StreamClient(client, cfg.task_queue)     # client built with MambaStreamPlugin
    sid = await streams.open("alice", "tiny-mamba2")
    result = await streams.advance(sid, "alice", text="hello")   # update id derived from chunk_seq
"""

from workflows._agent import AgentWorkflow
from workflows._client import StreamClient, new_stream_id, update_id
from workflows._config import DEFAULT_TASK_QUEUE, ClientConfig
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
    "ClientConfig",
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
