"""What a chunk's result says of its outputs: the top-k next tokens, the digest of its logits, and
for a generate its seed and where it ends (`GenerateEnd`).

The engine samples (`activities._engine.SeededSampler`); what is decided here depends on the
sampled tokens and the model alone, so a retry decides the same.
"""

from __future__ import annotations

import hashlib
import time

import torch

from mamba_stream.activities._live import LiveTokens
from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.scan import Model
from mamba_stream.workflows import TokenLogprob

__all__ = ["GenerateEnd", "generate_seed", "output_digest", "top_k"]


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
    then the time between tokens. `live`: where a streaming generate's tokens go as they come."""

    def __init__(self, model: Model, stop: list[str], metrics: StreamMetrics, t0: float,
                 live: LiveTokens | None = None) -> None:
        self.sampled: list[int] = []
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
        return self.finish
