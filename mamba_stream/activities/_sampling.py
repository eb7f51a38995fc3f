"""What a chunk's result says of its outputs: the top-k next tokens, the digest of its logits, and
for a generate its seed, how it samples and where it ends (`GenerateEnd`).

A generate with temperature, top-k, seed and stop alone samples with the engine's
`activities._engine.SeededSampler` (batched across streams, the bits it always had); one that
sets any of the later settings (top_p, min_p, the penalties, logit_bias: `Shaping`) samples with
`ShapedSampler`, row by row; one with a grammar samples with `activities._grammar.GrammarSampler`
(the same arithmetic as the one of these it would have used, on logits whose tokens the grammar
does not allow are -inf). What is decided here depends on the sampled tokens, the model and
the seeded generator alone, so a retry decides the same.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mamba_stream.activities._live import LiveTokens
from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.scan import Model, NonFiniteOutput
from mamba_stream.scan.exact import TWIN_OPS
from mamba_stream.workflows import GenerateRequest, InvalidRequest, TokenLogprob

__all__ = ["SHAPING_FIELDS", "GenerateEnd", "ShapedSampler", "Shaping", "adjust_logits", "check_logit_bias",
           "draw", "generate_seed", "neutral_settings", "output_digest", "top_k"]


def output_digest(logits: torch.Tensor) -> str:
    """A chunk's `output_digest`: sha256 of its logits as float32."""
    return "sha256:" + hashlib.sha256(logits.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def top_k(last: torch.Tensor | None, k: int) -> list[TokenLogprob]:
    """The `k` likeliest next tokens after logits `last`, with their log-probabilities ([]: none asked or no logits)."""
    if last is None or k == 0:
        return []
    logp = torch.log_softmax(last.double(), dim=-1)
    vals, idx = torch.topk(logp, min(k, logp.numel()))
    return [TokenLogprob(token=int(i), logprob=float(v)) for v, i in zip(vals, idx, strict=True)]


def generate_seed(stream_id: str, chunk_seq: int, seed: int | None) -> int:
    """A generate's seed: the request's, else one derived from the stream and the chunk (a retry
    derives the same)."""
    if seed is not None:
        return seed
    return int.from_bytes(hashlib.sha256(f"{stream_id}|{chunk_seq}".encode()).digest()[:8], "little") >> 1


class GenerateEnd:
    """Where a generate ends, decided between the engine's rounds (`proceed`, told each sampled
    token by `taken`): after the token that completes one of the `stop` texts ("stop"), or after
    the model's end-of-sequence token ("eos"); otherwise after `max_tokens` ("length", the
    engine's bound). A token that completes a stop text and is an end-of-sequence token too ends
    it as "stop". The pace of its tokens is recorded as they come: the first one's time from `t0`,
    then the time between tokens. `live`: where a streaming generate's tokens go as they come.
    `complete`: whether the request's grammar is complete after the tokens sampled so far
    (`activities._grammar.GrammarGuide.complete`: nothing can follow but its end), which ends it
    as "stop" too, after the stop texts and the end of sequence are checked; None: no grammar."""

    def __init__(self, model: Model, stop: list[str], metrics: StreamMetrics, t0: float,
                 live: LiveTokens | None = None, complete: Callable[[], bool] | None = None) -> None:
        self.sampled: list[int] = []
        self._complete = complete
        self.finish = "length"
        self._stop, self._transform, self._eos = stop, model.transform, frozenset(model.eos_token_ids)
        self._metrics, self._labels, self._live = metrics, {"model": model.model_id}, live
        self._t0 = self._last_t = t0

    def _completes_stop(self, tokens: list[int]) -> bool:
        """Whether `tokens`, decoded, contain one of the stop texts (never without an input transform)."""
        if not self._stop or self._transform is None:
            return False
        return any(s and s in self._transform.decode(tokens) for s in self._stop)

    def proceed(self) -> bool:
        """Whether to sample another token (False: the generate ends here, `finish` says why)."""
        now = time.perf_counter()
        if self.sampled:
            self._metrics.decode_step.record(now - self._last_t, self._labels)
        else:
            self._metrics.time_to_first_output.record(now - self._t0, {**self._labels, "kind": "generate"})
        self._last_t = now
        if self.sampled and self._completes_stop(self.sampled):
            self.finish = "stop"
            return False
        if self.sampled and self.sampled[-1] in self._eos:
            self.finish = "eos"
            return False
        if self._complete is not None and self._complete():
            self.finish = "stop"  # the grammar is complete: its last token is in the state, as a stop text's
            return False
        return True

    def taken(self, tok: int) -> None:
        self.sampled.append(tok)
        if self._live is not None:
            self._live.take(tok)

    def finished(self, tokens: list[int]) -> str:
        """The finish reason of the generate that returned `tokens`: the last token the length
        allowed may have completed a stop text, or be the end of the sequence, too."""
        if self.finish == "length" and self._completes_stop(tokens):
            self.finish = "stop"  # the last sampled token completed a stop text
        if self.finish == "length" and tokens and tokens[-1] in self._eos:
            self.finish = "eos"  # the last token the length allowed was the end of the sequence
        if self.finish == "length" and self._complete is not None and self._complete():
            self.finish = "stop"  # the last token the length allowed completed the grammar
        return self.finish


# --- the settings people set (issue 48): top_p, min_p, penalties, logit bias ---------------------

#: generate's settings that came after its first histories: at their defaults (`neutral_settings`)
#: they are left out of the chunk's content digest, so a chunk committed before they existed keeps
#: its store key (`grammar`, None by default, is one of them; `Shaping` holds the others)
SHAPING_FIELDS = ("top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                  "grammar")
#: the SHAPING_FIELDS that adjust the logits or the draw (`Shaping`); a grammar masks them after
_SHAPES = tuple(f for f in SHAPING_FIELDS if f != "grammar")


def neutral_settings(ask: GenerateRequest) -> set[str]:
    """The `SHAPING_FIELDS` of `ask` at their defaults (the values that change nothing)."""
    fields = GenerateRequest.model_fields
    return {f for f in SHAPING_FIELDS if getattr(ask, f) == fields[f].get_default(call_default_factory=True)}


def check_logit_bias(ask: GenerateRequest, vocab_size: int) -> None:
    """Refuse, typed `InvalidRequest` naming `logit_bias`, a bias on a token outside the vocabulary
    (the request's model bounds every id at 2**31 only; the model's vocabulary is known here)."""
    bad = sorted(t for t in ask.logit_bias if t >= vocab_size)
    if bad:
        raise InvalidRequest(f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab_size})",
                             field="logit_bias", value=bad[0], limit=vocab_size)


@dataclass(frozen=True)
class Shaping:
    """The later settings of a generate (`GenerateRequest`'s fields of the same names) but its
    grammar; `of` gives None when all of them are at the values that change nothing."""

    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias), by token id

    @classmethod
    def of(cls, ask: GenerateRequest) -> Shaping | None:
        if neutral_settings(ask) >= set(_SHAPES):
            return None
        return cls(top_p=ask.top_p, min_p=ask.min_p, frequency_penalty=ask.frequency_penalty,
                   presence_penalty=ask.presence_penalty, repetition_penalty=ask.repetition_penalty,
                   logit_bias=tuple(sorted(ask.logit_bias.items())))


def adjust_logits(logits: torch.Tensor, shaping: Shaping, counts: dict[int, int]) -> torch.Tensor:
    """The logits a generate chooses from (V,) float64, before the temperature: `logits` (V,)
    widened to float64 (exact), then, in this order, each a correctly rounded IEEE operation per
    element (the same bits on every CPU):

    1. logit_bias: x[t] + bias[t];
    2. repetition_penalty r, for each token t this generate has sampled (`counts[t] > 0`):
       x[t] / r where x[t] > 0, else x[t] * r (transformers' `RepetitionPenaltyLogitsProcessor`);
    3. frequency and presence penalties, for the same tokens: (x[t] - counts[t] * frequency) -
       presence (OpenAI's, over the sampled tokens).

    `counts`: how often this generate has sampled each token so far. The prompt's tokens do not
    count: a stream keeps its state, not its tokens, and OpenAI counts the sampled ones too.
    """
    x = logits.detach().to(device="cpu", dtype=torch.float64).clone()
    if shaping.logit_bias:
        ids = torch.tensor([t for t, _ in shaping.logit_bias], dtype=torch.long)
        x[ids] = x[ids] + torch.tensor([b for _, b in shaping.logit_bias], dtype=torch.float64)
    if counts:
        seen = sorted(counts)
        ids = torch.tensor(seen, dtype=torch.long)
        if shaping.repetition_penalty != 1.0:
            v = x[ids]
            x[ids] = torch.where(v > 0, v / shaping.repetition_penalty, v * shaping.repetition_penalty)
        if shaping.frequency_penalty != 0.0 or shaping.presence_penalty != 0.0:
            c = torch.tensor([counts[t] for t in seen], dtype=torch.float64)
            x[ids] = (x[ids] - c * shaping.frequency_penalty) - shaping.presence_penalty
    return x


def draw(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
         generator: torch.Generator) -> int:
    """One token from adjusted logits `x` (V,) float64 (`adjust_logits`), exactly: every step is
    a correctly rounded IEEE operation, a comparison, a sum in a stated order or the exact
    arithmetic's exp, so the token is the same on every CPU for the same `x` and generator state.

    Temperature 0: the argmax of x (the lowest id among equals); top_k, top_p and min_p never
    change an argmax, so they do not apply. Otherwise, with z = x / temperature, the tokens
    ranked by z, descending, equal values by token id:

    1. w = exp(z - max z) by the exact arithmetic's exp (`scan.exact`): the unnormalized
       probabilities (the likeliest token's w is 1);
    2. top_k > 0: the first top_k tokens of the ranking are kept;
    3. top_p < 1: of those, the shortest ranked prefix whose running sum of w (in rank order)
       reaches top_p times S is kept, S the sum of w over the tokens step 2 kept, in token-id
       order (the token that crosses is kept: at least one token is);
    4. min_p > 0: of those, the ones with w >= min_p (probability at least min_p times the
       likeliest's);
    5. u: one float64 in [0, 1) from `generator` (`torch.rand`: 53 random bits); the token is the
       first of the kept ones, in token-id order, whose running sum of w exceeds u times their sum.

    A distribution that is not finite raises NonFiniteOutput, as the engine's sampler does.
    """
    if temperature == 0.0:
        return int(torch.argmax(x))
    z = x / temperature
    if not bool(torch.isfinite(z).all()):
        raise NonFiniteOutput("non-finite sampling distribution")
    w = TWIN_OPS.exp(z - z.max())
    kept: torch.Tensor | None = None  # token ids, ascending; None: every token
    if top_k and top_k < z.numel():
        kept = torch.sort(_ranked(z, top_k)).values
    if top_p < 1.0:
        total = float(_in_order(w if kept is None else w[kept])[-1])
        kept = torch.sort(_nucleus(z, w, kept, top_p * total)).values
    if min_p > 0.0:
        kept = torch.nonzero(w >= min_p).squeeze(1) if kept is None else kept[w[kept] >= min_p]
    weights = w if kept is None else w[kept]
    run = _in_order(weights)
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    j = min(int((run <= u * float(run[-1])).sum()), weights.numel() - 1)
    return j if kept is None else int(kept[j])


def _in_order(w: torch.Tensor) -> torch.Tensor:
    """The running sums of `w` (1-D float64), added in index order one after the other: the CPU's
    cumsum is that loop (pinned by tests/activities/test_sampling.py), so each sum is a function
    of `w` alone, however torch vectorizes other reductions."""
    return torch.cumsum(w, dim=0)


def _ranked(z: torch.Tensor, m: int) -> torch.Tensor:
    """The ids of the first `m` tokens ranked by z, descending, equal values by id (m <= V).

    Without sorting the vocabulary: the m-th largest value v (topk's values are exact, whichever
    of equal elements it picks), every token with z >= v (in id order), stably sorted; those are
    the ranking's first ones, the ties at v included, and its first m are the answer."""
    v = torch.topk(z, m, sorted=True).values[-1]
    cand = torch.nonzero(z >= v).squeeze(1)
    return cand[torch.sort(z[cand], descending=True, stable=True).indices[:m]]


def _nucleus(z: torch.Tensor, w: torch.Tensor, kept: torch.Tensor | None, threshold: float) -> torch.Tensor:
    """The shortest prefix of the ranking (of the `kept` ids; None: all) whose running sum of w,
    in rank order, reaches `threshold` (all of them, if none does). The ranking is built in
    growing pieces: a nucleus is usually a small part of the vocabulary."""
    if kept is not None:
        ranked = kept[torch.sort(z[kept], descending=True, stable=True).indices]
        run = _in_order(w[ranked])
        return ranked[: min(int((run < threshold).sum()) + 1, ranked.numel())]
    n = z.numel()
    m = min(64, n)
    while True:
        ranked = _ranked(z, m)
        run = _in_order(w[ranked])
        if m == n or float(run[-1]) >= threshold:
            return ranked[: min(int((run < threshold).sum()) + 1, m)]
        m = min(4 * m, n)


class ShapedSampler:
    """A generate's sampler when it sets any of the later settings (`Shaping`): each call adjusts
    the row's logits by the tokens this sampler has returned so far (`adjust_logits`), then draws
    (`draw`). The engine calls it row by row (it is not a `SeededSampler`), for the first token
    and after each step.

    proceed: called before each token is sampled; False ends the generation there. taken: told
    each token sampled. (As `SeededSampler`'s.)
    """

    def __init__(self, temperature: float, top_k: int, shaping: Shaping, generator: torch.Generator, *,
                 proceed: Callable[[], bool] | None = None, taken: Callable[[int], None] | None = None) -> None:
        self.temperature, self.top_k, self.shaping, self.generator = temperature, top_k, shaping, generator
        self.proceed, self.taken = proceed, taken
        self.counts: dict[int, int] = {}

    def __call__(self, next_logits: torch.Tensor) -> int | None:
        if self.proceed is not None and not self.proceed():
            return None
        s = self.shaping
        tok = draw(adjust_logits(next_logits, s, self.counts), self.temperature, self.top_k, s.top_p, s.min_p,
                   self.generator)
        self.counts[tok] = self.counts.get(tok, 0) + 1
        if self.taken is not None:
            self.taken(tok)
        return tok
