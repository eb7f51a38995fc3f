"""generate's sampling settings (issue 48, item 6) against the real dev server: one generate with
every setting through `StreamClient` and through a `ModelStream` in a workflow of the tests' own,
the same tokens as the settings sampled by hand over a local scan; refusals typed, naming the
setting, with the stream where it was; the recorded histories replay (the stack's replay at exit)."""

from __future__ import annotations

import pytest
import torch
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from mamba_stream.activities._sampling import ShapedSampler, Shaping
from mamba_stream.state_codec.codec import plaintext_checksum
from tests.workflows._sampling_owner import SamplingInput, SamplingOwner
from tests.workflows.conftest import FAST, Stack, make_stack
from tests.workflows.test_nothing_stuck import accepted_updates, reason
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = list(b"Once upon")
SETTINGS = {"temperature": 0.8, "top_p": 0.9, "min_p": 0.01, "frequency_penalty": 0.5, "presence_penalty": 0.2,
            "repetition_penalty": 1.1}
BIAS = {101: 1.5, 32: -100.0}


def sampled_here(n: int, seed: int, top_k: int = 0) -> tuple[list[int], str]:
    """The tokens the settings sample after PROMPT over a local scan of tiny-mamba2 (the sampler's
    arithmetic is checked against a hand reference in tests/activities/test_sampling.py), and the
    checksum of the state after them."""
    model = local("tiny-mamba2")
    s = {k: v for k, v in SETTINGS.items() if k != "temperature"}
    sampler = ShapedSampler(SETTINGS["temperature"], top_k, Shaping(**s, logit_bias=tuple(sorted(BIAS.items()))),
                            torch.Generator().manual_seed(seed))
    out = model.advance(model.initial_state(), PROMPT)
    state, tokens = out.state, []
    for _ in range(n):
        tokens.append(sampler(out.logits[-1]))
        out = model.advance(state, tokens[-1:])
        state = out.state
    return tokens, plaintext_checksum(state.tensors)


async def test_a_generate_with_the_settings_is_seeded_and_a_refusal_names_the_setting(stack: Stack):
    want, checksum = sampled_here(10, seed=5, top_k=40)
    sids = [await stack.streams.open("alice", "tiny-mamba2") for _ in range(2)]
    for sid in sids:
        await stack.streams.advance(sid, "alice", tokens=PROMPT)
    gen = await stack.streams.generate(sids[0], "alice", 10, seed=5, top_k=40, logit_bias=BIAS, **SETTINGS)
    assert (gen.tokens, gen.receipt.checksum) == (want, checksum)
    assert 32 not in gen.tokens
    # the same chunk on another stream, shown as it is sampled: the same tokens
    shown = stack.streams.generate_stream(sids[1], "alice", 10, seed=5, top_k=40, logit_bias=BIAS, **SETTINGS)
    events = [ev async for ev in shown]
    assert [t for ev in events for t in ev.tokens] == shown.result.tokens == want
    other = await stack.streams.generate(sids[1], "alice", 10, seed=6, top_k=40, logit_bias=BIAS, **SETTINGS)
    assert other.tokens != want

    sid = sids[0]
    before, updates = await stack.streams.receipt(sid), await accepted_updates(stack, sid)
    # out of range: refused by the client, typed, before anything is sent
    for field, value in (("top_p", 0.0), ("presence_penalty", 2.5), ("logit_bias", {7: 101.0})):
        with pytest.raises(ApplicationError) as exc:
            await stack.streams.generate(sid, "alice", 2, **{field: value})
        assert exc.value.type == "InvalidRequest" and exc.value.details[0]["field"] == field
    assert await accepted_updates(stack, sid) == updates
    # a bias outside the model's vocabulary: only the stream knows the vocabulary; refused typed,
    # naming the setting, and the stream has not moved
    with pytest.raises(WorkflowUpdateFailedError) as failed:
        await stack.streams.generate(sid, "alice", 2, seed=1, logit_bias={256: 1.0})
    assert reason(failed.value) == "InvalidRequest" and failed.value.cause.non_retryable
    assert failed.value.cause.details[0]["field"] == "logit_bias"
    assert await stack.streams.receipt(sid) == before
    assert (await stack.streams.stats(sid)).chunk_seq == gen.chunk_seq
    nxt = await stack.streams.generate(sid, "alice", 2, seed=1, temperature=0.0, repetition_penalty=3.0)
    assert nxt.chunk_seq == gen.chunk_seq + 1 and nxt.position == gen.position + 2


async def test_a_stream_in_a_workflow_generates_with_the_settings_and_refuses_typed(temporal_env, tmp_path):
    want, checksum = sampled_here(8, seed=9)
    s = await make_stack(temporal_env, tmp_path, owners=(SamplingOwner,))
    async with s.exits:
        out = await s.client.execute_workflow(
            SamplingOwner.run, SamplingInput(principal="alice", model_id="tiny-mamba2", options=FAST, prompt=PROMPT,
                                             max_tokens=8, seed=9, settings=SETTINGS, logit_bias=BIAS),
            id=s.streams.new_id("alice"), task_queue=s.queue)
    assert (out.tokens, out.checksum) == (want, checksum)
    assert out.refusals == [("InvalidRequest", "top_p", checksum), ("InvalidRequest", "logit_bias", checksum)]
    assert out.position == len(PROMPT) + 8
