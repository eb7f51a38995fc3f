"""A generate held to a grammar (issue 48, item 5) against the real dev server: through
`StreamClient.generate` and `generate_stream` the reply is valid JSON, the stream's receipt is
the state a local scan of the prompt and the reply reaches, and the same seed gives the same
tokens; a grammar that does not compile is refused typed, naming `grammar`, with the stream where
it was; a request without a grammar keeps the update id the code before grammars gave it (the
recorded histories replay: tests/workflows/test_recorded_histories.py, and the stack's replay at
exit)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import Grammar, update_id
from mamba_stream.workflows._client import _shaping
from mamba_stream.workflows._model_stream import generate_request
from tests.activities.test_grammar import JSON, SCHEMA
from tests.workflows._sampling_owner import SamplingInput, SamplingOwner
from tests.workflows.conftest import Stack, make_stack
from tests.workflows.test_nothing_stuck import accepted_updates, reason
from tests.workflows.test_sampling_settings import FAST
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = list(b"Plan: ")


def scanned(tokens: list[int]) -> str:
    """The checksum of the state a local scan of PROMPT + tokens reaches on tiny-mamba2."""
    model = local("tiny-mamba2")
    return plaintext_checksum(model.advance(model.initial_state(), PROMPT + tokens).state.tensors)


async def test_a_generate_with_a_json_schema_replies_valid_json_and_a_bad_grammar_is_refused(stack: Stack):
    sids = [await stack.streams.open("alice", "tiny-mamba2") for _ in range(2)]
    for sid in sids:
        await stack.streams.advance(sid, "alice", tokens=PROMPT)
    gen = await stack.streams.generate(sids[0], "alice", 120, seed=7, temperature=0.8, grammar=JSON)
    reply = json.loads(gen.text)
    jsonschema.validate(reply, {k: v for k, v in SCHEMA.items() if k != "x-guidance"})
    assert gen.finish_reason == "stop" and gen.position == len(PROMPT) + len(gen.tokens)
    assert gen.receipt.checksum == scanned(gen.tokens)
    # the same chunk on another stream, shown as it is sampled: the same tokens and state bits
    shown = stack.streams.generate_stream(sids[1], "alice", 120, seed=7, temperature=0.8, grammar=JSON)
    events = [ev async for ev in shown]
    assert [t for ev in events for t in ev.tokens] == shown.result.tokens == gen.tokens
    assert shown.result.receipt.checksum == gen.receipt.checksum and events[-1].finish_reason == "stop"

    sid = sids[0]
    before, updates = await stack.streams.receipt(sid), await accepted_updates(stack, sid)
    # a form that is not a grammar's: refused by the client, typed, before anything is sent
    with pytest.raises(ApplicationError) as exc:
        await stack.streams.generate(sid, "alice", 4, grammar=Grammar.model_construct(kind="json_schema",
                                                                                      source="{not json"))
    assert exc.value.type == "InvalidRequest" and exc.value.details[0]["field"] == "grammar"
    assert await accepted_updates(stack, sid) == updates
    # a grammar llguidance does not compile: only the workers can tell; refused typed, naming the
    # grammar, and the stream has not moved
    with pytest.raises(WorkflowUpdateFailedError) as failed:
        await stack.streams.generate(sid, "alice", 4, seed=1, grammar=Grammar(kind="lark", source="start: nope"))
    assert reason(failed.value) == "InvalidRequest" and failed.value.cause.non_retryable
    assert failed.value.cause.details[0]["field"] == "grammar"
    assert await stack.streams.receipt(sid) == before
    assert (await stack.streams.stats(sid)).chunk_seq == gen.chunk_seq
    # the stream goes on from where it was: greedy, held to a regex
    nxt = await stack.streams.generate(sid, "alice", 30, seed=1, temperature=0.0,
                                       grammar=Grammar(kind="regex", source=r"[0-9]{3}-[a-z]{2,4}"))
    assert nxt.chunk_seq == gen.chunk_seq + 1 and nxt.finish_reason == "stop"
    assert nxt.text is not None and len(nxt.text) in range(6, 9) and nxt.text[3] == "-"
    assert nxt.receipt.checksum == plaintext_checksum(local("tiny-mamba2").advance(
        local("tiny-mamba2").initial_state(), PROMPT + gen.tokens + nxt.tokens).state.tensors)


async def test_a_request_without_a_grammar_keeps_its_update_id():
    """The update id (and so the signature's claims and the chunk's digest) of a generate the
    client builds without a grammar, its `grammar=None` now passed through, is the one the code
    before grammars gave it (pinned: computed by that code, at the commit before this one)."""
    fields = dict(principal="alice", chunk_seq=2, max_tokens=16, temperature=0.7, seed=5, stop=["\n"])
    old = generate_request(**fields)
    new = generate_request(**fields, **_shaping(1.0, 0.0, 0.0, 0.0, 1.0, None, None))
    assert new.grammar is None and new.claims() == old.claims()
    for req in (old, new):
        assert update_id("generate", req, epoch=1, key=b"k" * 32) == "generate-2-e1-4389268498940bbc"
    held = generate_request(**fields, **_shaping(1.0, 0.0, 0.0, 0.0, 1.0, None, JSON))
    assert held.claims()["grammar"] == {"kind": "json_schema", "source": JSON.source}
    assert update_id("generate", held, epoch=1, key=b"k" * 32) != "generate-2-e1-4389268498940bbc"


async def test_a_stream_in_a_workflow_generates_held_to_a_grammar(temporal_env, tmp_path, stack: Stack):
    """`ModelStream.generate(grammar=)` in the owner's workflow samples the tokens the client's
    generate samples from the same state with the same seed, held to the regex."""
    regex = Grammar(kind="regex", source=r"[a-z]{2,6}-[0-9]{2}")
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", tokens=PROMPT)
    want = await stack.streams.generate(sid, "alice", 12, seed=3, temperature=0.9, grammar=regex)
    s = await make_stack(temporal_env, tmp_path, owners=(SamplingOwner,))
    async with s.exits:
        out = await s.client.execute_workflow(
            SamplingOwner.run, SamplingInput(principal="alice", model_id="tiny-mamba2", options=FAST, prompt=PROMPT,
                                             max_tokens=12, seed=3, settings={"temperature": 0.9}, logit_bias={},
                                             grammar=regex),
            id=s.streams.new_id("alice"), task_queue=s.queue)
    assert out.tokens == want.tokens and out.checksum == want.receipt.checksum == scanned(want.tokens)
    assert want.finish_reason == "stop" and len(want.text or "") in range(5, 10) and "-" in (want.text or "")
    assert [r[:2] for r in out.refusals] == [("InvalidRequest", "top_p"), ("InvalidRequest", "logit_bias")]
