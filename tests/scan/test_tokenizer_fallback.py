"""A checkpoint directory without tokenizer.json says, once, that its text is read as bytes."""

from __future__ import annotations

import json
import logging

import pytest

from mamba_stream.scan import ByteTransform, HFTokenizerTransform, ModelConfig, init_model, load_model, save_checkpoint


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "mamba_stream.scan._loading"]


def test_no_tokenizer_json_warns_once_that_text_is_bytes(tmp_path, caplog):
    save_checkpoint(load_model("tiny-mamba2"), tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="mamba_stream.scan._loading"):
        first = load_model(tmp_path / "ckpt")
        load_model(tmp_path / "ckpt")  # the same model again: said once is enough
    assert isinstance(first.transform, ByteTransform)
    [record] = _warnings(caplog)
    msg = record.getMessage()
    assert str(tmp_path / "ckpt") in msg and "no tokenizer.json" in msg and "UTF-8 bytes" in msg
    assert "\n" not in msg


def test_a_vocabulary_too_small_for_bytes_warns_that_it_takes_token_ids_only(tmp_path, caplog):
    small = init_model(ModelConfig.create(architecture="mamba2", d_model=64, n_layer=1, vocab_size=64,
                                          pad_vocab_size_multiple=8, d_state=16, headdim=16), seed=1)
    save_checkpoint(small, tmp_path / "small")
    assert json.loads((tmp_path / "small" / "config.json").read_text())["vocab_size"] == 64
    with caplog.at_level(logging.WARNING, logger="mamba_stream.scan._loading"):
        model = load_model(tmp_path / "small")
    assert model.transform is None
    [record] = _warnings(caplog)
    assert str(tmp_path / "small") in record.getMessage() and "token ids only" in record.getMessage()


def test_a_checkpoint_with_its_tokenizer_and_the_shipped_presets_do_not_warn(tmp_path, caplog):
    tokenizers = pytest.importorskip("tokenizers")
    save_checkpoint(load_model("tiny-mamba2"), tmp_path / "ckpt")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    with caplog.at_level(logging.WARNING, logger="mamba_stream.scan._loading"):
        assert isinstance(load_model(tmp_path / "ckpt").transform, HFTokenizerTransform)
        load_model("recall-mamba2")  # shipped byte-level by design: nothing to warn of
        load_model("tiny-mamba1")
    assert _warnings(caplog) == []
