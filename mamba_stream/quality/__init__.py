"""The model-quality suite: memory tasks, the English text corpus, training, the attention baseline,
evaluation.

    from mamba_stream.quality import recall_sample
    s = recall_sample(seed=0, index=1, pairs=4, delay=12)   # "n6 t1 y8 m4|CAT BLUE CAT|t1 n6 y8 m4"
    python -m quality.train --arch mamba2 --out scan/presets/recall-mamba2
    python -m mamba_stream.quality.train --arch mamba2 --task text --out mamba_stream/scan/presets/kjv-mamba2
    mamba-stream eval --append docs/results/quality.md

`quality.tasks` and `quality.corpus` (the King James Version from Debian's bible-kjv-text, for
the text preset) are pure Python; `quality.train`, `quality.evaluate` and `quality.attention` use
torch (imported when those modules are).
"""

from typing import Any

from mamba_stream.quality.tasks import DISTRACTOR_WORDS, KEYS, VALUES, Sample, parity_sample, recall_sample

__all__ = ["DISTRACTOR_WORDS", "KEYS", "VALUES", "Corpus", "CorpusUnavailable", "Sample", "fetch_corpus",
           "parity_sample", "recall_sample"]

_CORPUS_NAMES = ("Corpus", "CorpusUnavailable", "fetch_corpus")


def __getattr__(name: str) -> Any:
    # quality.corpus is imported on first use, not here: `python -m mamba_stream.quality.corpus`
    # would otherwise find it imported already by its package and run it a second time (runpy's
    # RuntimeWarning)
    if name in _CORPUS_NAMES:
        from mamba_stream.quality import corpus

        return getattr(corpus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
