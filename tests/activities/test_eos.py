"""A generate stops at the model's end-of-sequence token, inside the chunk's activity, exactly once.

The end-of-sequence token is found, not guessed: a generate on the same weights without one
samples a sequence, and a token it samples is made the end of the sequence of a second model
(the same weights, `eos_token_id` set in its config.json). The seeded generate on that model must
be the same sequence cut after that token, committed with the state of the prompt and those
tokens and nothing more.
"""

from __future__ import annotations

import json

import pytest
import torch

from mamba_stream.scan import load_model, save_checkpoint
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import GenerateResult
from tests.activities._eos import PROMPT, N, checkpoint, first_new, run, scanned


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> GenerateResult:
    """What the seeded generate samples on the weights with no end-of-sequence token."""
    out, _, _ = run(checkpoint(tmp_path_factory.mktemp("plain"), None), N)
    assert out.finish_reason == "length" and len(out.tokens) == N
    return out


def test_generate_stops_at_the_end_of_sequence_token_and_commits_exactly_what_it_returns(plain, tmp_path):
    k = first_new(plain.tokens)
    eos = plain.tokens[k]
    out, acts, [(retry, stored)] = run(checkpoint(tmp_path / "eos", eos), N, again=True)
    assert acts.models.get("m").eos_token_ids == (eos,)
    # the same sequence, cut after the end-of-sequence token, which is the last token returned
    assert out.tokens == plain.tokens[: k + 1] and out.tokens[-1] == eos
    assert out.finish_reason == "eos"
    assert out.text == load_model("tiny-mamba2").transform.decode(plain.tokens[: k + 1])
    # the committed position and state are the prompt's and every token returned, the eos included
    assert out.position == out.receipt.position == len(PROMPT) + k + 1
    assert out.receipt.checksum == plaintext_checksum(scanned(out.tokens).tensors)
    # a retry (a lost response) gets the committed result again and writes nothing: nothing advanced twice
    assert retry.model_dump(exclude={"duplicate"}) == out.model_dump(exclude={"duplicate"})
    assert out.receipt.state_key in stored


def test_an_end_of_sequence_token_that_is_also_the_last_one_allowed_is_reported_as_eos(plain, tmp_path):
    k = first_new(plain.tokens)
    out, _, _ = run(checkpoint(tmp_path / "eos", plain.tokens[k]), k + 1)
    assert out.tokens == plain.tokens[: k + 1] and out.finish_reason == "eos"
    assert out.receipt.checksum == plaintext_checksum(scanned(out.tokens).tensors)


def test_any_of_several_end_of_sequence_tokens_ends_it_at_the_first_sampled(plain, tmp_path):
    k = first_new(plain.tokens)
    j = first_new(plain.tokens, k + 1)
    out, _, _ = run(checkpoint(tmp_path / "eos", [plain.tokens[j], plain.tokens[k]]), N)
    assert out.tokens == plain.tokens[: k + 1] and out.finish_reason == "eos"


def test_an_end_of_sequence_token_never_sampled_changes_nothing(plain, tmp_path):
    unsampled = next(t for t in range(256) if t not in plain.tokens)
    out, _, _ = run(checkpoint(tmp_path / "eos", unsampled), N)
    assert out.model_dump(exclude={"receipt"}) == plain.model_dump(exclude={"receipt"})
    assert out.receipt.checksum == plain.receipt.checksum == plaintext_checksum(scanned(plain.tokens).tensors)


def test_a_stop_text_completed_by_the_end_of_sequence_token_is_reported_as_stop(plain, tmp_path):
    k = first_new(plain.tokens)
    text = load_model("tiny-mamba2").transform.decode(plain.tokens[: k + 1])
    out, _, _ = run(checkpoint(tmp_path / "eos", plain.tokens[k]), N, stop=[text])
    assert out.tokens == plain.tokens[: k + 1] and out.finish_reason == "stop"


def test_end_of_sequence_ids_are_read_from_the_config_and_bad_ones_refused(tmp_path):
    from mamba_stream.scan import ConfigError

    assert load_model("tiny-mamba2").eos_token_ids == ()
    assert load_model(checkpoint(tmp_path / "none", None)).eos_token_ids == ()
    assert load_model(checkpoint(tmp_path / "list", [5, 9, 5])).eos_token_ids == (5, 9)
    for bad in (256, -1, "5", True, [], [1.5]):
        with pytest.raises(ConfigError) as err:
            load_model(checkpoint(tmp_path / f"bad-{bad!r}", bad))
        assert err.value.field == "eos_token_id"
    # a checkpoint written from a model with one keeps it
    model = load_model(checkpoint(tmp_path / "one", 7))
    save_checkpoint(model, tmp_path / "again")
    assert load_model(tmp_path / "again").eos_token_ids == (7,)
    assert torch.equal(model.module.lm_head.weight, load_model(tmp_path / "again").module.lm_head.weight)


def test_end_of_sequence_from_generation_config_or_the_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    directory = checkpoint(tmp_path / "gen", None)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert load_model(directory).eos_token_ids == (3,)
    # a tokenizer whose config names its end-of-sequence token: that token's id
    directory = checkpoint(tmp_path / "tok", None)
    vocab = {"<unk>": 0, "</s>": 1, "a": 2, "b": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.save(str(directory / "tokenizer.json"))
    assert load_model(directory).eos_token_ids == ()  # tokenizer.json alone names no end of sequence
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert load_model(directory).eos_token_ids == (1,)
    # config.json's own id comes first
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 2}))
    assert load_model(directory).eos_token_ids == (2,)
