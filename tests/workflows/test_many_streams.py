"""Many streams on one worker through Temporal: batching never separates a state from its stream."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from mamba_stream.state_codec.codec import plaintext_checksum
from tests.workflows.conftest import Stack
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")

N_STREAMS = 200


def _text(i: int) -> str:
    rng = random.Random(i)
    words = ["state", "stream", "chunk", "mamba", "scan", "slot", "batch", "epoch", "agent", "tenant"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 6))) + f" #{i}"


def _cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), k=min(3, len(text) - 1)))
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


async def test_two_hundred_concurrent_streams_each_end_with_their_solo_checksum(stack: Stack):
    model = local("tiny-mamba2")

    async def one(i: int) -> tuple[str, str, str]:
        rng = random.Random(1000 + i)
        sid = await stack.streams.open(f"tenant-{i % 7}", "tiny-mamba2")
        text = _text(i)
        last = None
        for piece in _cuts(text, rng):
            if rng.random() < 0.35 and len(piece) > 1:
                # some pieces start with a few chunks of one token (decode steps, batched with the
                # other streams'), the rest of the piece in one chunk
                k = rng.randint(1, min(3, len(piece) - 1))
                for ch in piece[:k]:
                    last = await stack.streams.advance(sid, f"tenant-{i % 7}", text=ch)
                last = await stack.streams.advance(sid, f"tenant-{i % 7}", text=piece[k:])
            else:
                last = await stack.streams.advance(sid, f"tenant-{i % 7}", text=piece)
        truth = model.advance(model.initial_state(), model.transform.encode(text))
        return sid, last.receipt.checksum, plaintext_checksum(truth.state.tensors)

    results = await asyncio.gather(*(one(i) for i in range(N_STREAMS)))
    mismatched = [sid for sid, got, want in results if got != want]
    assert not mismatched, f"{len(mismatched)} streams diverged from their solo run"
    engine = stack.acts.engines["tiny-mamba2"]
    assert engine.stats.max_batch > 1, "single-token steps of different streams were never batched"
    assert len(engine.slots) == N_STREAMS
    await asyncio.gather(*(stack.streams.cancel(sid) for sid, _, _ in results))
    assert len(engine.slots) == 0  # no active states remain
    assert stack.acts.store.usage().objects == 0  # and no blobs
