"""The reference check of served chunks: every Nth advanced chunk is run again from the same input
state, and how far the served results are from the second run is recorded
(`StreamActivities(drift_check_every=N)`; docs/metrics.md, `mamba_stream_drift_logits_abs` and
`mamba_stream_exact_mismatches`).
"""

from __future__ import annotations

import itertools
import logging

import torch

from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.scan import Model, State

__all__ = ["DriftCheck"]

log = logging.getLogger(__name__)


class DriftCheck:
    """Which advanced chunks are checked (every `every`th; 0: none), and the check itself."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._advanced = itertools.count(1)  # chunks advanced, for the sampling

    def due(self) -> bool:
        """Count an advanced chunk; whether it is one to check."""
        nth = next(self._advanced)
        return bool(self.every) and nth % self.every == 0

    def sample(self, metrics: StreamMetrics, model: Model, state: State, tokens: list[int], logits: torch.Tensor,
               served: State) -> None:
        """Run the chunk again from the same input state; record in `metrics` how far the served
        results are.

        Where the arithmetic is exact, the chunk runs again on the same backend in another
        partition (its first token alone, then two uneven pieces) and must give the same bits,
        logits and state; any difference is counted as an exact mismatch. Elsewhere the reference
        backend runs it and max |logits difference| goes to the drift histogram.
        """
        if not tokens:
            return
        labels = {"model": model.model_id, "backend": model.backend}
        if model.arithmetic().exact:
            cut = 1 + (len(tokens) - 1) // 3
            rows, st = [], state
            for piece in (tokens[:1], tokens[1:cut], tokens[cut:]):
                if piece:
                    step = model.advance(st, piece)
                    rows.append(step.logits)
                    st = step.state
            again = torch.cat(rows)
            same = torch.equal(again, logits) and all(torch.equal(st.tensors[k], served.tensors[k])
                                                       for k in served.tensors)
            diff = float((again.to(torch.float64) - logits.to(torch.float64)).abs().max())
            metrics.drift.record(diff, labels)
            if not same:
                metrics.exact_mismatches.add(1, labels)
                log.error("exact backend: %s gave other bits for a chunk of %d tokens in another partition "
                          "(max |logits difference| %.3e)", model.model_id, len(tokens), diff)
            return
        ref = model.with_backend("reference").advance(state, tokens).logits
        diff = float((logits.to(torch.float64) - ref.to(torch.float64)).abs().max())
        metrics.drift.record(diff, labels)
        log.debug("drift sample %s: max |logits - reference| %.3e over %d tokens", model.model_id, diff, len(tokens))
