"""The shipped text preset, kjv-mamba2: it loads by name and is served by default, its card is
the run that made it, and on the default (exact) path it writes readable English that a
random-weight model does not.

Offline: the vocabulary it is held to is tests/quality/kjv-words.txt (the training text's words,
`python -m mamba_stream.quality.corpus --words ...`), whose sha256 the card records.
"""

from __future__ import annotations

import hashlib
import json
import math
import string
from pathlib import Path

import pytest
import torch

from mamba_stream.quality.corpus import CORPUS_PACKAGES, words
from mamba_stream.quality.train import SAMPLE_BYTES, SAMPLE_PROMPT, TEXT_ARCH_CONFIGS, TEXT_RECIPES, greedy_text
from mamba_stream.scan import TRAINED_PRESETS, load_model
from mamba_stream.scan._presets import trained_preset_dir

NAME = "kjv-mamba2"
CARD = json.loads((trained_preset_dir(NAME) / "card.json").read_text())
WORDS_FILE = Path(__file__).with_name("kjv-words.txt")
#: letters, space, newline and the punctuation of the KJV's text
READABLE = set(string.ascii_letters + " \n.,;:?!'()-")
#: the shipped model's 200-byte greedy sample measured 1.00 and 1.00 (43 words, every one in the
#: vocabulary); tiny-mamba2's (random weights) 0.25 and 0.00
MIN_READABLE, MIN_KNOWN_WORDS = 0.95, 0.85
#: the end of Revelation (22:17-21, held out from training), as the corpus normalizes it
HELD_OUT_PASSAGE = (
    "And the Spirit and the bride say, Come. And let him that heareth say, Come. And let him that is athirst come. "
    "And whosoever will, let him take the water of life freely.\n"
    "For I testify unto every man that heareth the words of the prophecy of this book, If any man shall add unto "
    "these things, God shall add unto him the plagues that are written in this book:\n"
    "And if any man shall take away from the words of the book of this prophecy, God shall take away his part out "
    "of the book of life, and out of the holy city, and from the things which are written in this book.\n"
    "He which testifieth these things saith, Surely I come quickly. Amen. Even so, come, Lord Jesus.\n"
    "The grace of our Lord Jesus Christ be with you all. Amen.\n"
)
MAX_HELD_OUT_BPB = 2.5  # measured 1.44 (tiny-mamba2: 8.01; the card's whole-book figure is 1.59)


@pytest.fixture(scope="module")
def kjv():
    return load_model(NAME)  # the default path: exact on a CPU


@pytest.fixture(scope="module")
def vocabulary() -> set[str]:
    text = WORDS_FILE.read_text()
    # the list is the one the card was trained with: its sha256 is recorded there
    assert hashlib.sha256(text.encode()).hexdigest() == CARD["corpus"]["words_sha256"]
    return set(text.split())


def readable_share(text: str) -> float:
    return sum(c in READABLE for c in text) / max(1, len(text))


def known_word_share(text: str, vocab: set[str]) -> float:
    # the last token may be a word cut off by the byte budget: not counted
    ws = words(text.rsplit(None, 1)[0] if len(text.split()) > 1 else text)
    return sum(w in vocab for w in ws) / max(1, len(ws))


def test_it_is_a_trained_preset_served_by_default_and_in_the_release_packet(kjv, monkeypatch):
    from mamba_stream.cli._release import PACKET_MODELS
    from mamba_stream.workflows import ClientConfig

    assert TRAINED_PRESETS[NAME] == "mamba2" and kjv.model_id == NAME and kjv.backend == "exact"
    monkeypatch.delenv("MAMBA_STREAM_MODELS", raising=False)
    assert NAME in ClientConfig().models.split(",")  # what a worker serves when nothing is set
    assert NAME in PACKET_MODELS
    assert kjv.transform is not None and kjv.transform.encode("Amen") == [65, 109, 101, 110]


def test_its_card_is_the_recipe_run_and_names_the_weights_it_describes(kjv):
    assert kjv.revision == CARD["revision"]
    assert CARD["task"] == "text" and CARD["model_config"] == TEXT_ARCH_CONFIGS["mamba2"]
    recipe, tc = TEXT_RECIPES["mamba2"], CARD["train_config"]
    assert {k: tc[k] for k in recipe} == recipe and tc["seed"] == 0
    assert CARD["seconds"] <= 30 * 60 and CARD["corpus"]["packages"].keys() == set(CORPUS_PACKAGES)
    assert CARD["parameters"] == sum(p.numel() for p in kjv.module.parameters())
    md = (trained_preset_dir(NAME) / "card.md").read_text()
    for fact in ("`bible-kjv-text` " + CARD["corpus"]["packages"]["bible-kjv-text"], "public domain",
                 CARD["corpus"]["sha256"], f"{CARD['held_out_bits_per_byte']:.3f}", CARD["sample"]["text"]):
        assert fact in md, fact
    assert (trained_preset_dir(NAME) / "model.safetensors").stat().st_size < 10 * 2**20


def test_greedy_text_on_the_default_path_is_the_cards_sample_and_reads_as_english(kjv, vocabulary):
    text = greedy_text(kjv, SAMPLE_PROMPT, SAMPLE_BYTES)
    # the exact arithmetic gives the same bits on every CPU: the sample the card shows, byte for byte
    assert text == CARD["sample"]["text"]
    assert readable_share(text) >= MIN_READABLE, (readable_share(text), text)
    assert known_word_share(text, vocabulary) >= MIN_KNOWN_WORDS, (known_word_share(text, vocabulary), text)
    assert len(words(text)) >= 20, text


def test_a_random_weight_model_fails_the_same_bar(vocabulary):
    text = greedy_text(load_model("tiny-mamba2"), SAMPLE_PROMPT, SAMPLE_BYTES)
    assert readable_share(text) < MIN_READABLE and known_word_share(text, vocabulary) < MIN_KNOWN_WORDS, text


def _bits_per_byte(model, text: str) -> float:
    ids = model.transform.encode(text)
    logits = model.advance(model.initial_state(), ids[:-1]).logits
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))) / math.log(2)


def test_it_predicts_held_out_text_and_a_random_weight_model_does_not(kjv):
    assert _bits_per_byte(kjv, HELD_OUT_PASSAGE) <= MAX_HELD_OUT_BPB
    assert _bits_per_byte(load_model("tiny-mamba2"), HELD_OUT_PASSAGE) > 6.0
