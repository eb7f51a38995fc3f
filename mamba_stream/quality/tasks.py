"""Seeded, byte-level tasks that need memory: what the trained presets are trained and judged on.

Every sample is ASCII text, so a person can read it in the demo and in `mamba-stream eval`:

    recall   facts, distractors, then queries:   "k7 m2 q9|RED FOX RED FOX|q9 k7"
             each query's value byte is a target; the delay is the distractor length in bytes
    parity   a bit string, then its parity:       "p:0110101=0"
    reset    a recall sample whose state is reset between the distractors and the queries: the
             model must fall to chance (the inequality control); built from the recall generator

A sample is fully determined by (task, seed, index, parameters): `generate` never touches global
randomness, so held-out sets are the same on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = [
    "DISTRACTOR_WORDS",
    "KEYS",
    "VALUES",
    "Sample",
    "parity_sample",
    "recall_sample",
]

KEYS = "abcdefghijklmnopqrstuvwxyz"
VALUES = "0123456789"
#: Uppercase only: no byte of a distractor can be read as a key, a value or a separator.
DISTRACTOR_WORDS = ("RED", "FOX", "BLUE", "OWL", "GREY", "CAT", "TALL", "OAK", "SLOW", "BEE", "DARK", "SEA")


@dataclass(frozen=True)
class Sample:
    """One example: `text`, and the byte offsets whose byte the model must predict.

    `targets[i]` is an offset into `text`; the prediction for it is read from the logits after
    the byte before it. `prefix_end` is where a reset may happen: recall's queries start there, after
    the facts and the distractors.
    """

    task: str
    text: str
    targets: tuple[int, ...]
    delay: int = 0
    prefix_end: int = 0
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def tokens(self) -> list[int]:
        return list(self.text.encode("ascii"))

    def answers(self) -> list[int]:
        data = self.text.encode("ascii")
        return [data[t] for t in self.targets]


def _rng(task: str, seed: int, index: int) -> random.Random:
    # str seeds hash the same way on every run (random.seed(str) uses sha512, not hash())
    return random.Random(f"{task}/{seed}/{index}")


def _distractor(rng: random.Random, length: int) -> str:
    """`length` bytes of uppercase words, drawn from a few phrases that repeat."""
    if length <= 0:
        return ""
    phrases = [" ".join(rng.choice(DISTRACTOR_WORDS) for _ in range(rng.randint(1, 3))) for _ in range(3)]
    out = ""
    while len(out) < length:
        out += rng.choice(phrases) + " "
    return out[:length]


def recall_sample(seed: int, index: int, *, pairs: int = 4, delay: int = 0, queries: int | None = None,
                  repeat: bool = False) -> Sample:
    """Associative recall: `pairs` distinct keys with values, `delay` distractor bytes, queries.

    Queries ask `queries` of the keys (all of them by default) in a shuffled order; every value
    byte of a query is a target. With `repeat`, each query draws its key afresh (a key may be
    asked twice, another never), so the last answer cannot be had by elimination: training on
    these pushes a model to bind keys to values rather than to track which values are left.
    """
    if not 1 <= pairs <= len(KEYS):
        raise ValueError(f"pairs must be in 1..{len(KEYS)}, got {pairs}")
    if delay < 0:
        raise ValueError(f"delay must be >= 0, got {delay}")
    rng = _rng("recall", seed, index)
    keys = rng.sample(KEYS, pairs)
    facts = {k: rng.choice(VALUES) for k in keys}
    n_asked = pairs if queries is None else min(queries, pairs)
    asked = [rng.choice(keys) for _ in range(n_asked)] if repeat else rng.sample(keys, n_asked)
    head = " ".join(f"{k}{facts[k]}" for k in keys) + "|" + _distractor(rng, delay) + "|"
    text, targets = head, []
    for i, k in enumerate(asked):
        if i:
            text += " "
        text += k
        targets.append(len(text))
        text += facts[k]
    return Sample("recall", text, tuple(targets), delay=delay, prefix_end=len(head),
                  meta={"pairs": pairs, "facts": facts, "repeat": repeat})


def parity_sample(seed: int, index: int, *, bits: int = 16) -> Sample:
    """Running parity: `bits` random bits, then "=" and their parity (the one target)."""
    if bits < 1:
        raise ValueError(f"bits must be >= 1, got {bits}")
    rng = _rng("parity", seed, index)
    s = "".join(rng.choice("01") for _ in range(bits))
    text = f"p:{s}=" + str(s.count("1") % 2)
    return Sample("parity", text, (len(text) - 1,), delay=bits, meta={"bits": bits})
