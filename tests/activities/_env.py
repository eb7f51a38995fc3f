"""An `ActivityEnvironment` whose activity info names the stream's own workflow: the stream
activities refuse an attempt scheduled by any other (`StreamActivities._guarded`); and generates
run through the activities after a prompt."""

from __future__ import annotations

import dataclasses
from typing import Any

from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from mamba_stream.activities import MemoryStateStore, ModelRegistry, StreamActivities
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.workflows import AdvanceRequest, GenerateRequest
from mamba_stream.workflows.contract import AdvanceChunkRequest, GenerateChunkRequest, OpenStreamRequest


def stream_env(stream_id: str = "s1") -> ActivityEnvironment:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=stream_id)
    return env


def opened_and_fed(acts: StreamActivities, env: ActivityEnvironment, stream_id: str, tokens: list[int]) -> Any:
    """Open alice's stream `stream_id` on model "m" and feed it `tokens` (chunk 1), through the
    activities; returns the advance's result (its receipt is where a generate goes on)."""
    opened = env.run(acts.open_stream, OpenStreamRequest(stream_id=stream_id, principal="alice", model_id="m"))
    return env.run(acts.advance_chunk, AdvanceChunkRequest(
        stream_id=stream_id, principal="alice", receipt=opened.receipt,
        request=AdvanceRequest(principal="alice", chunk_seq=1, tokens=tokens)))


def generate_after(prompt: list[int], requests: list[dict]) -> tuple[list, list[list[str]]]:
    """Each generate (GenerateRequest's fields) after `prompt`, on a tiny-mamba2 stream of its own
    (reference backend), through the activities: the results (or the refusal raised) and each
    stream's store keys after it."""
    acts = StreamActivities(models=ModelRegistry({"m": "tiny-mamba2"}, backend="reference"),
                            store=MemoryStateStore(), keyring=Keyring.generate())
    out, keys = [], []
    try:
        for i, kw in enumerate(requests):
            sid = f"s{i}"
            env = stream_env(sid)
            fed = opened_and_fed(acts, env, sid, prompt)
            gen = GenerateChunkRequest(stream_id=sid, principal="alice", receipt=fed.result.receipt,
                                       request=GenerateRequest(principal="alice", chunk_seq=2, **kw))
            try:
                out.append(env.run(acts.generate_tokens, gen).result)
            except ApplicationError as exc:
                out.append(exc)
            keys.append(acts.store.list_stream(stream_id=sid))
        return out, keys
    finally:
        acts.close()
