"""The model-quality suite: memory tasks, training, the attention baseline, evaluation.

    from mamba_stream.quality import recall_sample
    s = recall_sample(seed=0, index=1, pairs=4, delay=12)   # "n6 t1 y8 m4|CAT BLUE CAT|t1 n6 y8 m4"
    python -m quality.train --arch mamba2 --out scan/presets/recall-mamba2
    mamba-stream eval --append docs/results/quality.md

`quality.tasks` is pure Python; `quality.train`, `quality.evaluate` and `quality.attention` use
torch (imported when those modules are).
"""

from mamba_stream.quality.tasks import DISTRACTOR_WORDS, KEYS, VALUES, Sample, parity_sample, recall_sample

__all__ = ["DISTRACTOR_WORDS", "KEYS", "VALUES", "Sample", "parity_sample", "recall_sample"]
