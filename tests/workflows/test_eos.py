"""A generate stops at the model's end-of-sequence token through Temporal: the update's result,
the stream's receipt and its token log all say "eos", and the stream advanced by exactly the
tokens returned."""

from __future__ import annotations

import asyncio

import pytest

from mamba_stream.state_codec.codec import plaintext_checksum
from tests.activities._eos import PROMPT, SEED, N, checkpoint, first_new, run, scanned
from tests.workflows.conftest import FAST, make_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_stream_generate_ends_at_the_end_of_sequence_token(temporal_env, tmp_path):
    # what the same weights sample without an end of sequence, and one of its tokens made the end
    plain, _, _ = await asyncio.to_thread(run, checkpoint(tmp_path / "plain", None), N)
    k = first_new(plain.tokens)
    eos_dir = checkpoint(tmp_path / "eos", plain.tokens[k])
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        await stack.worker(stack.new_activities(models={"eos-tiny": str(eos_dir)}))
        sid = await stack.streams.open("alice", "eos-tiny", options=FAST)
        fed = await stack.streams.advance(sid, "alice", tokens=PROMPT)
        assert fed.position == len(PROMPT)
        out = await stack.streams.generate(sid, "alice", N, seed=SEED)
        assert out.tokens == plain.tokens[: k + 1] and out.finish_reason == "eos"
        assert out.position == len(PROMPT) + k + 1
        receipt = await stack.streams.receipt(sid)
        assert receipt == out.receipt and receipt.position == len(PROMPT) + k + 1
        assert receipt.checksum == plaintext_checksum(scanned(out.tokens).tensors)
        batch = await stack.streams.read_tokens(sid)
        assert [t for e in batch.events for t in e.tokens] == out.tokens
        assert batch.events[-1].done and batch.events[-1].finish_reason == "eos"
        # the stream goes on from there: a generate after the end of sequence is a new chunk
        more = await stack.streams.generate(sid, "alice", 2, seed=SEED + 1)
        assert more.position == out.position + len(more.tokens)
