"""Helpers of the end-of-sequence tests: a checkpoint with an `eos_token_id`, and one stream's
open, prompt and seeded generate through the activities (no server)."""

from __future__ import annotations

import json
from pathlib import Path

from mamba_stream.activities import MemoryStateStore, ModelRegistry, StreamActivities
from mamba_stream.scan import State, load_model, save_checkpoint
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.workflows import AdvanceRequest, GenerateRequest, GenerateResult
from mamba_stream.workflows.contract import AdvanceChunkRequest, GenerateChunkRequest, OpenStreamRequest
from tests.activities._env import stream_env

PROMPT = [72, 101, 108, 108, 111, 32]  # "Hello "
SEED = 11
N = 24


def checkpoint(directory: Path, eos: int | list[int] | None) -> Path:
    """tiny-mamba2's weights as a checkpoint directory, with `eos` as its config's eos_token_id."""
    save_checkpoint(load_model("tiny-mamba2", backend="reference"), directory)
    if eos is not None:
        cfg = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    return directory


def first_new(tokens: list[int], start: int = 2) -> int:
    """The first index from `start` whose token was not sampled before it (an end of sequence
    there ends the generation there, not earlier)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def run(directory: Path, max_tokens: int, *, stop: list[str] | None = None, again: bool = False
        ) -> tuple[GenerateResult, StreamActivities, list[tuple[GenerateResult, list[str]]]]:
    """Open a stream on the checkpoint, feed PROMPT, generate once (seeded); `again`: send the
    same generate a second time (a retry after a lost response), with what the store holds of
    the stream before and after it."""
    acts = StreamActivities(models=ModelRegistry({"m": str(directory)}, backend="reference"),
                            store=MemoryStateStore(), keyring=Keyring.generate())
    try:
        env = stream_env()
        opened = env.run(acts.open_stream, OpenStreamRequest(stream_id="s1", principal="alice", model_id="m"))
        fed = env.run(acts.advance_chunk, AdvanceChunkRequest(
            stream_id="s1", principal="alice", receipt=opened.receipt,
            request=AdvanceRequest(principal="alice", chunk_seq=1, tokens=PROMPT)))
        gen = GenerateChunkRequest(stream_id="s1", principal="alice", receipt=fed.result.receipt,
                                   request=GenerateRequest(principal="alice", chunk_seq=2, max_tokens=max_tokens,
                                                           seed=SEED, stop=stop or []))
        out = env.run(acts.generate_tokens, gen).result
        retries = []
        if again:
            before = acts.store.list_stream(stream_id="s1")
            retries.append((env.run(acts.generate_tokens, gen).result, before))
            assert acts.store.list_stream(stream_id="s1") == before
        return out, acts, retries
    finally:
        acts.close()


def scanned(tokens: list[int]) -> State:
    """The state a local scan of PROMPT + tokens reaches (the committed state must be it)."""
    model = load_model("tiny-mamba2", backend="reference")
    return model.advance(model.initial_state(), PROMPT + tokens).state
