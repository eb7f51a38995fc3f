"""The demo's story holds for the shipped model: it recalls the fact across the distractors, and
the same question after a reset does not get the fact's answer."""

from __future__ import annotations

import torch

from mamba_stream.cli._demo import ANSWER, DISTRACTORS, FACTS, QUESTION
from mamba_stream.scan import load_model


def test_the_demo_model_answers_before_and_forgets_after_a_reset():
    model = load_model("recall-mamba2", backend="reference")
    enc = model.transform.encode
    state = model.initial_state()
    for chunk in [FACTS, *DISTRACTORS, QUESTION]:  # the demo's chunks, one advance each
        r = model.advance(state, enc(chunk))
        state = r.state
    assert chr(int(torch.argmax(r.logits[-1]))) == ANSWER
    after_reset = model.advance(model.initial_state(), enc(QUESTION))
    assert chr(int(torch.argmax(after_reset.logits[-1]))) != ANSWER
    assert "|" not in "".join(DISTRACTORS) and FACTS.endswith("|") and QUESTION.startswith("|")
