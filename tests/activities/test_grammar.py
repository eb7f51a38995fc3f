"""A generate held to a grammar (issue 48, item 5; mamba_stream/activities/_grammar.py), through
the activities (`ActivityEnvironment`, no server), on tiny-mamba2's random weights (reference
backend): its text always validates (a JSON schema, a Lark grammar embedding one, a regex), at
every temperature and seed; the same seed gives the same tokens and state bits; the tokens are
those a hand-written loop samples over a local scan with llguidance's masks applied as -inf
(the plain sampler's arithmetic, or the shaped one's written out in plain floats); a grammar that
does not compile is refused typed before anything moves; a short max_tokens ends "length" with a
prefix of the longer generate; a request without a grammar keeps its content digest.
"""

from __future__ import annotations

import hashlib
import json
import re

import jsonschema
import llguidance
import pytest
import torch
from temporalio.exceptions import ApplicationError

from mamba_stream.activities import MemoryStateStore, ModelRegistry, StreamActivities
from mamba_stream.activities._engine import _sample_one
from mamba_stream.activities._grammar import grammar_vocab
from mamba_stream.activities._sampling import SHAPING_FIELDS, Shaping, neutral_settings
from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import Keyring, plaintext_checksum
from mamba_stream.workflows import PRESENTATION, GenerateRequest, Grammar
from mamba_stream.workflows.contract import GenerateChunkRequest
from tests.activities._env import generate_after, opened_and_fed, stream_env
from tests.activities.test_sampling import next_u, ref_adjust, ref_draw

PROMPT = list(b"Trip: ")
#: bounded (a short string, a small integer, no free whitespace), so that even a random model ends
#: it well within MAX_TOKENS at any temperature, greedy included
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 0, "maximum": 365}},
          "required": ["city", "days"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
JSON = Grammar(kind="json_schema", source=json.dumps(SCHEMA))
TOOL_CALL = Grammar(kind="lark", source='start: "<tool_call>" %json ' + json.dumps(SCHEMA) + ' "</tool_call>"')
EMAIL = Grammar(kind="regex", source=r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)")
MAX_TOKENS = 120
TEMPERATURES = (0.0, 0.7, 1.5)
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-mamba2", backend="reference")


def _generate(requests: list[dict]) -> tuple[list, list[list[str]]]:
    return generate_after(PROMPT, requests)


def _matcher(model, grammar: Grammar) -> llguidance.LLMatcher:
    compile_ = {"lark": llguidance.LLMatcher.grammar_from_lark, "regex": llguidance.LLMatcher.grammar_from_regex,
                "json_schema": llguidance.LLMatcher.grammar_from_json_schema}[grammar.kind]
    m = llguidance.LLMatcher(grammar_vocab(model).tokenizer, compile_(grammar.source), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _allowed(m: llguidance.LLMatcher) -> list[int]:
    """The bytes (token ids < 256) llguidance allows next, read bit by bit."""
    mask = m.compute_bitmask()
    return [i for i in range(256) if mask[i // 8] >> (i % 8) & 1]


def _reference(model, grammar: Grammar, kw: dict) -> tuple[list[int], str, str]:
    """The tokens, finish reason and state checksum the request specifies, by hand: after PROMPT,
    while the grammar is not stopped and allows a byte, the model's row with every byte it does
    not allow at -inf, drawn by the plain sampler (`_sample_one`, what a generate without the
    later settings draws with) or, with them, by the plain-float reference of
    tests/activities/test_sampling.py over the whole masked row."""
    m = _matcher(model, grammar)
    out = model.advance(model.initial_state(), PROMPT)
    state, row = out.state, out.logits[-1]
    gen = torch.Generator().manual_seed(kw["seed"])
    shaped = Shaping.of(GenerateRequest(principal="p", chunk_seq=1, **kw)) is not None
    counts: dict[int, int] = {}
    tokens: list[int] = []
    finish = "length"
    while len(tokens) < kw["max_tokens"]:
        allowed = _allowed(m)
        if m.is_stopped() or not allowed:
            finish = "stop"
            break
        if shaped:
            x = ref_adjust(row.tolist(), bias=kw.get("logit_bias"), rep=kw.get("repetition_penalty", 1.0),
                           freq=kw.get("frequency_penalty", 0.0), pres=kw.get("presence_penalty", 0.0),
                           counts=counts)
            x = [v if i in allowed else float("-inf") for i, v in enumerate(x)]
            tok = ref_draw(x, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0),
                           next_u(gen))
            if kw["temperature"]:
                torch.rand((), dtype=torch.float64, generator=gen)
        else:
            masked = torch.full_like(row, float("-inf"))
            masked[allowed] = row[allowed]
            tok = _sample_one(masked, kw["temperature"], kw.get("top_k", 0), gen)
        assert tok in allowed
        tokens.append(tok)
        counts[tok] = counts.get(tok, 0) + 1
        assert m.consume_token(tok)
        step = model.advance(state, [tok])
        state, row = step.state, step.logits[-1]
    else:
        if m.is_stopped() or not _allowed(m):
            finish = "stop"
    return tokens, finish, plaintext_checksum(state.tensors)


def _valid_json(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, {k: v for k, v in SCHEMA.items() if k != "x-guidance"})
    return value


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_a_json_schema_holds_at_every_seed_and_the_tokens_are_the_masked_samplers(model, temperature):
    asks = [{"max_tokens": MAX_TOKENS, "seed": s, "temperature": temperature, "grammar": JSON} for s in SEEDS]
    outs, _ = _generate([*asks, asks[0]])
    for ask, got in zip(asks, outs, strict=False):
        _valid_json(got.text)
        assert got.finish_reason == "stop" and got.position == len(PROMPT) + len(got.tokens)
        want, finish, checksum = _reference(model, JSON, ask)
        assert (got.tokens, got.finish_reason, got.receipt.checksum) == (want, finish, checksum)
    again = outs[-1]  # the same request and seed on another stream: the same tokens and state bits
    assert (again.tokens, again.receipt.checksum, again.output_digest) == \
        (outs[0].tokens, outs[0].receipt.checksum, outs[0].output_digest)
    if temperature:
        assert len({tuple(o.tokens) for o in outs[:3]}) > 1  # the seeds sample different objects


def test_the_later_settings_then_the_mask_are_the_shaped_draw_over_the_masked_row(model):
    """With top_k, top_p, min_p, the penalties and a bias, the grammar masks after them: the
    plain-float reference draw over the whole row with the disallowed bytes at -inf (the activity
    draws over the allowed ones alone: the same draw)."""
    settings = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "frequency_penalty": 0.4,
                "presence_penalty": 0.2, "repetition_penalty": 1.2, "logit_bias": {ord("1"): 2.0, ord("a"): -3.0}}
    asks = [{**settings, "max_tokens": MAX_TOKENS, "seed": s, "grammar": JSON} for s in (4, 5)]
    outs, _ = _generate(asks)
    for ask, got in zip(asks, outs, strict=True):
        _valid_json(got.text)
        want, finish, checksum = _reference(model, JSON, ask)
        assert (got.tokens, got.finish_reason, got.receipt.checksum) == (want, finish, checksum)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_a_lark_tool_call_embedding_the_schema_holds(model, temperature):
    asks = [{"max_tokens": MAX_TOKENS, "seed": s, "temperature": temperature, "grammar": TOOL_CALL} for s in SEEDS]
    outs, _ = _generate([*asks, asks[-1]])
    for ask, got in zip(asks, outs, strict=False):
        call = re.fullmatch(r"<tool_call>(.*)</tool_call>", got.text, re.S)
        assert call is not None, got.text
        _valid_json(call.group(1))
        assert got.finish_reason == "stop"
        assert (got.tokens, got.finish_reason, got.receipt.checksum) == _reference(model, TOOL_CALL, ask)
    assert (outs[-1].tokens, outs[-1].receipt.checksum) == (outs[2].tokens, outs[2].receipt.checksum)


def test_a_regex_holds_and_ends_the_generate_where_it_is_complete(model):
    asks = [{"max_tokens": 40, "seed": s, "temperature": 1.0, "grammar": EMAIL} for s in SEEDS]
    outs, _ = _generate(asks)
    for ask, got in zip(asks, outs, strict=True):
        assert re.fullmatch(EMAIL.source, got.text), got.text
        assert (got.tokens, got.finish_reason, got.receipt.checksum) == _reference(model, EMAIL, ask)


def test_a_short_max_tokens_ends_length_with_a_prefix_of_the_longer_generate(model):
    full, short = _generate([{"max_tokens": MAX_TOKENS, "seed": 2, "grammar": JSON},
                             {"max_tokens": 9, "seed": 2, "grammar": JSON}])[0]
    assert full.finish_reason == "stop" and len(full.tokens) > 9
    assert short.finish_reason == "length" and short.tokens == full.tokens[:9]
    assert full.text.startswith(short.text)
    m = _matcher(model, JSON)  # a prefix of a valid object: the grammar takes it, and is not complete
    assert m.consume_tokens(short.tokens) and not m.is_accepting()
    # a max_tokens that ends exactly where the grammar does: "stop", not "length"
    exact = _generate([{"max_tokens": len(full.tokens), "seed": 2, "grammar": JSON}])[0][0]
    assert (exact.tokens, exact.finish_reason) == (full.tokens, "stop")


@pytest.mark.parametrize("grammar", [
    Grammar(kind="lark", source="start: undefined_rule"),
    Grammar(kind="regex", source="[a-"),
    Grammar(kind="json_schema", source='{"type": "string", "format": "no-such-format"}'),
    Grammar(kind="json_schema", source='{"type": "no-such-type"}'),
], ids=["lark", "regex", "json-format", "json-type"])
def test_a_grammar_that_does_not_compile_is_refused_typed_before_anything_moves(grammar):
    ok = {"max_tokens": 4, "seed": 1}
    outs, keys = _generate([ok, {**ok, "grammar": grammar}])
    refused = outs[1]
    assert isinstance(refused, ApplicationError) and refused.type == "InvalidRequest" and refused.non_retryable
    assert refused.details[0]["field"] == "grammar"
    # nothing of the chunk was stored: the stream's keys are its open and its prompt's
    assert not any(".c2." in k for k in keys[1]) and any(".c1." in k for k in keys[1])
    assert any(".c2." in k for k in keys[0])


def test_a_model_without_byte_strings_is_refused_typed(tmp_path):
    from mamba_stream.scan import ModelConfig, init_model, save_checkpoint

    # a checkpoint without tokenizer.json of a vocabulary that is not the 256 bytes: token ids only
    save_checkpoint(init_model(ModelConfig.create(architecture="mamba2", d_model=64, n_layer=1, vocab_size=64,
                                                  d_state=16, headdim=16), seed=1), tmp_path / "ids")
    acts = StreamActivities(models=ModelRegistry({"m": str(tmp_path / "ids")}, backend="reference"),
                            store=MemoryStateStore(), keyring=Keyring.generate())
    try:
        env = stream_env("s1")
        fed = opened_and_fed(acts, env, "s1", [1, 2, 3])
        with pytest.raises(ApplicationError) as exc:
            env.run(acts.generate_tokens, GenerateChunkRequest(
                stream_id="s1", principal="alice", receipt=fed.result.receipt,
                request=GenerateRequest(principal="alice", chunk_seq=2, max_tokens=4, grammar=EMAIL)))
        assert exc.value.type == "InvalidRequest" and exc.value.details[0]["field"] == "grammar"
        assert not any(".c2." in k for k in acts.store.list_stream(stream_id="s1"))
    finally:
        acts.close()


def test_a_request_without_a_grammar_keeps_its_content_digest():
    """The chunk's content digest (its store key's, `_chunk.generate`) of a request without a
    grammar, or with grammar=None given, is the one the code before grammars computed (pinned:
    computed by that code, at the commit before this one)."""
    for req in (GenerateRequest(principal="alice", chunk_seq=2, max_tokens=16, temperature=0.7, seed=5, stop=["\n"]),
                GenerateRequest(principal="alice", chunk_seq=2, max_tokens=16, temperature=0.7, seed=5, stop=["\n"],
                                grammar=None)):
        assert "grammar" in neutral_settings(req) and neutral_settings(req) == set(SHAPING_FIELDS)
        assert Shaping.of(req) is None
        body = req.model_dump(mode="json", exclude={"principal", *PRESENTATION, *neutral_settings(req)}) | {"seed": 5}
        assert hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() == \
            "41f9651b82130c93773eef699e7a909e632c2f6a3cb6bc7ddcec21ec62f8d4f5"
    with_grammar = GenerateRequest(principal="alice", chunk_seq=2, max_tokens=16, seed=5, grammar=JSON)
    assert "grammar" not in neutral_settings(with_grammar) and Shaping.of(with_grammar) is None


def test_a_grammar_failing_mid_generate_leaves_the_stream_where_it_was(monkeypatch):
    """A matcher that fails after some tokens (a dead end, llguidance's limits): the generate is
    refused typed, nothing of it is stored, and the stream's next generate samples what a stream
    that never saw the failed one samples (the half-advanced slot was dropped, not kept)."""
    from mamba_stream.activities import _grammar

    real, seen = _grammar.GrammarGuide.take, []

    def failing(self, tok: int) -> None:
        seen.append(tok)
        if len(seen) == 3:
            raise self._fail("refused a token")
        real(self, tok)

    ask = {"max_tokens": MAX_TOKENS, "seed": 4, "temperature": 0.9, "grammar": JSON}
    acts = StreamActivities(models=ModelRegistry({"m": "tiny-mamba2"}, backend="reference"),
                            store=MemoryStateStore(), keyring=Keyring.generate())
    try:
        env = stream_env("s1")
        fed = opened_and_fed(acts, env, "s1", PROMPT)
        keys = acts.store.list_stream(stream_id="s1")
        gen = GenerateChunkRequest(stream_id="s1", principal="alice", receipt=fed.result.receipt,
                                   request=GenerateRequest(principal="alice", chunk_seq=2, **ask))
        with monkeypatch.context() as mp:
            mp.setattr(_grammar.GrammarGuide, "take", failing)
            with pytest.raises(ApplicationError) as exc:
                env.run(acts.generate_tokens, gen)
        assert exc.value.type == "InvalidRequest" and exc.value.details[0]["field"] == "grammar"
        assert len(seen) == 3 and acts.store.list_stream(stream_id="s1") == keys
        again = env.run(acts.generate_tokens, gen).result
    finally:
        acts.close()
    [fresh], _ = _generate([ask])
    assert (again.tokens, again.receipt.checksum) == (fresh.tokens, fresh.receipt.checksum)
