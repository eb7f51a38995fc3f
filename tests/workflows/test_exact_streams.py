"""The default worker configuration is exact: streams fed the same tokens in any chunking, decode
steps included, end with the same checksum, through Temporal, and it equals one local scan."""

from __future__ import annotations

import random

import pytest

from scan import load_model
from state_codec.codec import plaintext_checksum
from tests.workflows.conftest import make_stack
from tests.workflows.test_stream_workflow import chunking, digest, feed

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.mark.parametrize("model_id", ["tiny-mamba1", "tiny-mamba2", "tiny-mamba3"])
async def test_the_default_backend_gives_one_checksum_for_every_chunking(temporal_env, tmp_path, model_id):
    stack = await make_stack(temporal_env, tmp_path, backend="auto")  # what `python worker.py` runs
    async with stack.exits:
        rng = random.Random(7)
        prompt = [rng.randrange(256) for _ in range(61)]
        tail = [rng.randrange(256) for _ in range(9)]
        runs = []
        for chunks in ([61], [1] * 61, chunking(rng, 61)):
            sid = await stack.streams.open("alice", model_id)
            await feed(stack, sid, "alice", prompt, chunks)
            gen = await stack.streams.generate(sid, "alice", 6, temperature=0.0)  # decode steps in between
            last = await stack.streams.advance(sid, "alice", tokens=tail)
            runs.append((gen.tokens, last.output_digest, last.receipt))
        (gen0, out0, rec0), *others = runs
        assert rec0.backend == "exact:exact" and rec0.position == 61 + len(gen0) + 9  # backend:path
        for gen, out, rec in others:
            assert gen == gen0 and out == out0  # the same continuation, bit for bit
            assert rec.checksum == rec0.checksum and rec.position == rec0.position
        # and it is one local scan of the same tokens on the same backend
        local = load_model(model_id)
        one = local.advance(local.initial_state(), prompt + gen0 + tail)
        assert plaintext_checksum(one.state.tensors) == rec0.checksum
        assert digest(one.logits[-len(tail):]) == out0
