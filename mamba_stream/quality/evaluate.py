"""The model-quality suite: accuracy by task and delay, beside state bytes and decode latency.

    mamba-stream eval                  # every trained preset and the attention baseline
    make eval                          # the same; appends a run to docs/results/quality.md

For each trained Mamba preset (loaded by name through `load_model`, as a worker would):
  - recall accuracy by delay (distractor bytes), parity accuracy by length, one-shot;
  - the same recall sets fed in random chunkings: the predictions must be identical;
  - reset control: the state is reset between the facts and the queries, and accuracy on the
    pre-reset facts must fall into the chance band of a model that never saw them;
  - state bytes per stream (constant) and the median per-token decode latency.
A hybrid preset (recall-hybrid: Mamba-2 layers and an attention layer) is measured the same way;
its state holds its attention layer's KV, so its bytes grow with the context (less steeply than
the baseline's: one attention layer of 2 key/value heads, beside a fixed Mamba state).
The attention baseline gets the same sets; its KV cache bytes grow with the context.

Held-out sets use their own seed (`HELDOUT_SEED`); training batches use the training seed.
"""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import torch

from mamba_stream.quality.tasks import VALUES, Sample, parity_sample, recall_sample

__all__ = [
    "ATTENTION_BATCH",
    "HELDOUT_SEED",
    "EvalConfig",
    "architecture_label",
    "chance_band",
    "evaluate_attention",
    "evaluate_preset",
    "predict",
    "predict_after_reset",
    "predict_chunked",
    "render_run",
]

HELDOUT_SEED = 7919
ATTENTION_BASELINE = Path(__file__).resolve().parent / "baseline" / "attention"


@dataclass
class EvalConfig:
    n: int = 200  # samples per cell
    pairs: int = 4
    delays: tuple[int, ...] = (0, 32, 128, 512, 2048)
    parity_bits: tuple[int, ...] = (4, 8, 16, 32, 64)
    chunked_delays: tuple[int, ...] = (0, 32, 128)  # the chunked-vs-one-shot comparison
    chunk_seed: int = 11


@dataclass
class Report:
    name: str
    architecture: str
    schema: str  # "v<schema version>/<fingerprint prefix>", or "kv-cache" for attention
    revision: str
    recall: dict[int, float] = field(default_factory=dict)  # delay -> accuracy
    parity: dict[int, float] = field(default_factory=dict)  # bits -> accuracy
    chunked_identical: dict[int, tuple[int, int]] = field(default_factory=dict)  # delay -> (differ, total)
    reset_acc: float = 0.0
    reset_queries: int = 0
    memory_bytes: dict[int, int] = field(default_factory=dict)  # context tokens -> state or cache bytes
    decode_ms: float = 0.0
    parameters: int = 0


def recall_set(cfg: EvalConfig, delay: int) -> list[Sample]:
    return [recall_sample(HELDOUT_SEED, i, pairs=cfg.pairs, delay=delay) for i in range(cfg.n)]


def parity_set(cfg: EvalConfig, bits: int) -> list[Sample]:
    return [parity_sample(HELDOUT_SEED, i, bits=bits) for i in range(cfg.n)]


def _hits(samples: list[Sample], preds: list[list[int]]) -> float:
    hits = [p == a for s, ps in zip(samples, preds, strict=False)
            for p, a in zip(ps, s.answers(), strict=False)]
    return sum(hits) / len(hits)


#: streams advanced together by `predict` for a model with attention: the chunked backend's
#: attention masks (B, L, T) and may score (B, H, L, T) at once, 20 GB for 200 samples of 2,072
#: tokens; a recurrent model's batch stays whole (its rows are measured so)
ATTENTION_BATCH = 10


def predict(model: Any, samples: list[Sample]) -> list[list[int]]:
    """Argmax predictions at each target, each sample fed in one chunk from a fresh state."""
    step = ATTENTION_BATCH if model.config.has_attention else max(1, len(samples))
    results = []
    for i in range(0, len(samples), step):
        part = samples[i : i + step]
        results += model.advance_batch([model.initial_state() for _ in part], [s.tokens for s in part])
    return [[int(r.logits[o - 1].argmax()) for o in s.targets] for s, r in zip(samples, results, strict=True)]


def architecture_label(config: Any) -> str:
    """The table's architecture: the Mamba family, with the other layer kinds of a hybrid
    ("mamba2+attention")."""
    kinds = dict.fromkeys(config.kinds)  # first-seen order, no repeats
    return "+".join(kinds) if config.is_hybrid else config.architecture


def predict_chunked(model: Any, samples: list[Sample], rng: random.Random) -> list[list[int]]:
    """The same, each sample cut into random chunks fed one after another."""
    out = []
    for s in samples:
        toks, state, rows = s.tokens, model.initial_state(), []
        cuts = sorted(rng.sample(range(1, len(toks)), k=min(len(toks) - 1, rng.randint(1, 8))))
        for a, b in zip([0, *cuts], [*cuts, len(toks)], strict=True):
            r = model.advance(state, toks[a:b])
            state = r.state
            rows.append(r.logits)
        logits = torch.cat(rows)
        out.append([int(logits[o - 1].argmax()) for o in s.targets])
    return out


def predict_after_reset(model: Any, samples: list[Sample]) -> list[list[int]]:
    """Facts and distractors, then a reset (the fresh state a stream's reset installs), then the
    queries: what the model can still say about the facts."""
    out = []
    for s in samples:
        toks = s.tokens
        model.advance(model.initial_state(), toks[: s.prefix_end])  # the work a reset throws away
        r = model.advance(model.initial_state(), toks[s.prefix_end :])
        out.append([int(r.logits[o - s.prefix_end - 1].argmax()) if o > s.prefix_end else -1 for o in s.targets])
    return out


def chance_band(queries: int, p: float = 1 / len(VALUES), z: float = 3.29) -> tuple[float, float]:
    """The two-sided 99.9% band of accuracy for a predictor independent of the answer."""
    half = z * math.sqrt(p * (1 - p) / queries)
    return max(0.0, p - half), min(1.0, p + half)


def decode_latency_ms(model: Any, steps: int = 200) -> float:
    """Median wall time of one-token `advance` calls after a 64-token prompt."""
    state = model.advance(model.initial_state(), list(range(64))).state
    times = []
    for i in range(steps):
        t = time.perf_counter()
        state = model.advance(state, [i % 256]).state
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def evaluate_preset(name: str, cfg: EvalConfig, *, backend: str = "chunked", weights: str | None = None) -> Report:
    """Every measurement for one Mamba preset, loaded through `load_model` (`weights`: the format its
    matrices are read in, on the exact backend; the row is named after it)."""
    from mamba_stream.scan import load_model

    model = load_model(name, backend=backend, weights=weights)
    schema = model.schema
    label = name if weights is None else f"{name} ({backend}, {weights})"
    rep = Report(label, architecture_label(model.config), f"v{schema.schema_version}/{schema.fingerprint()[:12]}",
                 model.revision[:19], parameters=sum(p.numel() for p in model.module.parameters())
                 + sum(b.numel() for n, b in model.module.named_buffers() if n.endswith("weight_q8")))
    rng = random.Random(cfg.chunk_seed)
    for delay in cfg.delays:
        samples = recall_set(cfg, delay)
        preds = predict(model, samples)
        rep.recall[delay] = _hits(samples, preds)
        if delay in cfg.chunked_delays:
            chunked = predict_chunked(model, samples, rng)
            differ = sum(a != b for pa, pb in zip(preds, chunked, strict=True) for a, b in zip(pa, pb, strict=True))
            rep.chunked_identical[delay] = (differ, sum(len(p) for p in preds))
        end = model.advance(model.initial_state(), samples[0].tokens).state
        rep.memory_bytes[len(samples[0].text)] = end.nbytes
    for bits in cfg.parity_bits:
        samples = parity_set(cfg, bits)
        rep.parity[bits] = _hits(samples, predict(model, samples))
    samples = recall_set(cfg, cfg.delays[0])
    after = predict_after_reset(model, samples)
    rep.reset_queries = sum(len(p) for p in after)
    rep.reset_acc = _hits(samples, after)
    rep.decode_ms = decode_latency_ms(model)
    return rep


def evaluate_attention(cfg: EvalConfig, directory: Path = ATTENTION_BASELINE) -> Report | None:
    """The attention baseline on the same sets; None when its weights are not there."""
    from mamba_stream.quality.attention import KVCache, load_attention

    if not (directory / "attention.json").is_file():
        return None
    tf = load_attention(directory)
    from mamba_stream.scan import weights_revision

    rep = Report("attention-baseline", "attention", "kv-cache", weights_revision(tf.state_dict())[:19],
                 parameters=sum(p.numel() for p in tf.parameters()))

    def run(samples: list[Sample]) -> list[list[int]]:
        preds = []
        with torch.no_grad():
            for i in range(0, len(samples), 50):
                part = samples[i : i + 50]
                length = max(len(s.text) for s in part)
                x = torch.zeros((len(part), length), dtype=torch.long)
                for b, s in enumerate(part):
                    x[b, : len(s.text)] = torch.tensor(s.tokens)
                pred = tf(x).argmax(-1)
                preds += [[int(pred[b, o - 1]) for o in s.targets] for b, s in enumerate(part)]
        return preds

    for delay in cfg.delays:
        samples = recall_set(cfg, delay)
        rep.recall[delay] = _hits(samples, run(samples))
        cache = KVCache([], [])
        with torch.no_grad():
            tf(torch.tensor([samples[0].tokens]), cache)
        rep.memory_bytes[len(samples[0].text)] = cache.nbytes
    for bits in cfg.parity_bits:
        samples = parity_set(cfg, bits)
        rep.parity[bits] = _hits(samples, run(samples))
    cache = KVCache([], [])
    with torch.no_grad():
        tf(torch.arange(64).unsqueeze(0) % 256, cache)
        times = []
        for i in range(200):
            t = time.perf_counter()
            tf(torch.tensor([[i % 256]]), cache)
            times.append(time.perf_counter() - t)
    rep.decode_ms = statistics.median(times) * 1e3
    return rep


def _git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[1])
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def render_run(reports: list[Report], cfg: EvalConfig) -> str:
    """One run's section for docs/results/quality.md (appended, never replacing older runs)."""
    lo, hi = chance_band(max(1, reports[0].reset_queries)) if reports else (0.0, 0.0)
    lines = [f"## Run of {date.today().isoformat()}, code {_git_revision()}", "",
             f"{cfg.n} held-out samples per cell (seed {HELDOUT_SEED}), {cfg.pairs} key-value pairs per recall "
             f"sample (every key queried: {cfg.n * cfg.pairs} queries per cell); CPU, chunked backend unless a "
             "row names its backend and weight format.", "",
             "### Recall accuracy by delay (distractor bytes between the facts and the queries)", "",
             "| model | architecture | schema | revision | params | "
             + " | ".join(f"delay {d}" for d in cfg.delays) + " |",
             "|---|---|---|---|---|" + "---|" * len(cfg.delays)]
    for r in reports:
        lines.append(f"| {r.name} | {r.architecture} | {r.schema} | {r.revision} | {r.parameters:,} | "
                     + " | ".join(f"{r.recall[d]:.3f}" for d in cfg.delays) + " |")
    lines += ["", "### State tracking: parity accuracy by length (chance 0.5)", "",
              "| model | " + " | ".join(f"{b} bits" for b in cfg.parity_bits) + " |",
              "|---|" + "---|" * len(cfg.parity_bits)]
    for r in reports:
        lines.append(f"| {r.name} | " + " | ".join(f"{r.parity[b]:.3f}" for b in cfg.parity_bits) + " |")
    lines += ["", "### Memory per stream against context, and decode latency", "",
              "| model | " + " | ".join(f"{n:,} tokens" for n in sorted(reports[0].memory_bytes)) +
              " | decode ms/token (CPU, median) |",
              "|---|" + "---|" * (len(reports[0].memory_bytes) + 1)]
    for r in reports:
        lines.append(f"| {r.name} | " + " | ".join(f"{r.memory_bytes[n]:,} B" for n in sorted(r.memory_bytes))
                     + f" | {r.decode_ms:.2f} |")
    mamba = [r for r in reports if r.chunked_identical]
    lines += ["", "### Chunking is invisible; reset is unmistakable", "",
              f"Chunked: the recall sets of delays {list(cfg.chunked_delays)} fed in random chunkings (1 to 8 cuts "
              f"per sample). Reset: the state reset between the facts and the queries (delay {cfg.delays[0]}); "
              f"a model that never saw the facts scores in [{lo:.3f}, {hi:.3f}] (99.9%).", "",
              "| model | predictions differing, chunked vs one-shot | accuracy before reset | after reset "
              "| in the chance band |",
              "|---|---|---|---|---|"]
    for r in mamba:
        differ = sum(d for d, _ in r.chunked_identical.values())
        total = sum(t for _, t in r.chunked_identical.values())
        band = chance_band(r.reset_queries)
        lines.append(f"| {r.name} | {differ} of {total} | {r.recall[cfg.delays[0]]:.3f} | {r.reset_acc:.3f} | "
                     f"{'yes' if band[0] <= r.reset_acc <= band[1] else 'NO'} |")
    return "\n".join(lines) + "\n"


QUALITY_HEADER = """# Model quality by architecture version

Each run appends a section; older runs stay as baselines. Regenerate with `make eval` (or
`mamba-stream eval --append docs/results/quality.md`). The presets are trained by
`python -m quality.train` (cards beside the weights in `mamba_stream/scan/presets/*/card.md`); the tasks are
`mamba_stream/quality/tasks.py`.

"""


def append_run(path: Path, section: str) -> None:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(QUALITY_HEADER)
    with path.open("a") as fh:
        fh.write("\n" + section)
