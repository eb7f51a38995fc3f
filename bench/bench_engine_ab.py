"""The engine alone, before and after a change, in one process: decode tokens/s by concurrent streams.

The "before" engine is the slot table and engine modules of a git revision (default: the base of
this branch, e3c5da8), loaded beside the current ones; both run the same model, backend and
load, alternating level by level and repeated, so that a shared machine's noise falls on both.
Every stream's sampled tokens must be the same on both sides (the run fails otherwise).

    python bench/bench_engine_ab.py [--base e3c5da8] [--levels 1,8,32,128] [--repeats 3]
        [--backend exact] [--gen-tokens 64]

Each stream makes 4 generate calls at 1 and 8 streams, 1 at 32 and 128 (at 64 tokens a call: 256,
2,048, 2,048 and 8,192 tokens in all).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mamba_stream.activities._engine import SeededSampler, StreamEngine  # noqa: E402
from mamba_stream.activities._engine import _sample_one as _sample  # noqa: E402  (the per-row path)
from mamba_stream.scan import ModelConfig, init_model, load_model, save_checkpoint  # noqa: E402


def _load_base(rev: str) -> type:
    """StreamEngine of revision `rev` (its _engine.py over its _slots.py)."""
    mods: dict[str, types.ModuleType] = {}
    for name in ("_slots", "_engine"):
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:activities/{name}.py"], check=True,
                             capture_output=True, text=True).stdout
        src = src.replace("from activities._slots import", "from _base_slots import")
        spec = importlib.util.spec_from_loader(f"_base{name}", loader=None)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[f"_base{name}"] = mod
        exec(compile(src, f"{rev}:activities/{name}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["_engine"].StreamEngine


def _run(engine, n: int, rounds: int, gen_tokens: int, first, batched: bool) -> tuple[float, float, float, dict]:
    """n streams, each `rounds` generate calls of gen_tokens: (tokens/s, process CPU ms per token,
    streams per step, the tokens)."""
    sids = [f"s{n}-{i}" for i in range(n)]
    for sid in sids:
        engine.put(sid, first.state, epoch=0, state_key="k0", logits=first.logits[-1])
    got: dict[str, list[int]] = {}

    def run(sid: str) -> None:
        gen = torch.Generator().manual_seed(hash(sid) % 10_000)
        sampler = SeededSampler(1.0, 0, gen) if batched else (lambda lg: _sample(lg, 1.0, 0, gen))
        toks: list[int] = []
        for _ in range(rounds):
            out = engine.generate(sid, sampler, gen_tokens, expected_key="k0", epoch=0,
                                  load=lambda: (first.state, first.logits[-1]))
            toks += out.tokens
            engine.mark_committed(sid, "k0")
        got[sid] = toks

    steps0, streams0 = engine.stats.steps, engine.stats.stepped_streams
    threads = [threading.Thread(target=run, args=(sid,)) for sid in sids]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for sid in sids:
        engine.release(sid)
    steps = engine.stats.steps - steps0
    total = n * rounds * gen_tokens
    return total / wall, cpu / total * 1e3, (engine.stats.stepped_streams - streams0) / max(steps, 1), got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="e3c5da8")
    ap.add_argument("--levels", default="1,8,32,128")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="exact")
    ap.add_argument("--gen-tokens", type=int, default=64)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        # bench_serving.py's model: Mamba-2, d_model 256, 4 layers, d_state 64, headdim 64
        cfg = ModelConfig.create(architecture="mamba2", d_model=256, n_layer=4, vocab_size=256, d_state=64, headdim=64)
        save_checkpoint(init_model(cfg, seed=0), Path(tmp) / "m")
        model = load_model(Path(tmp) / "m", backend=args.backend)
    first = model.advance(model.initial_state(), [1, 2, 3])
    engines = {"before": _load_base(args.base)(model), "after": StreamEngine(model)}
    rates: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    gains: dict[int, list[float]] = {}  # after / before of each back-to-back pair
    occupancy: dict[tuple[str, int], float] = {}
    for rep in range(args.repeats):
        for n in levels:
            rounds = max(1, 32 // max(n, 8))
            tokens: dict[str, dict] = {}
            pair: dict[str, float] = {}
            for side in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                rate, ms, occ, tokens[side] = _run(engines[side], n, rounds, args.gen_tokens, first, side == "after")
                rates.setdefault((side, n), []).append(rate)
                cpu.setdefault((side, n), []).append(ms)
                occupancy[(side, n)] = occ
                pair[side] = rate
            gains.setdefault(n, []).append(pair["after"] / pair["before"])
            if tokens["before"] != tokens["after"]:
                raise SystemExit(f"{n} streams: the sampled tokens differ between before and after")
    for e in engines.values():
        e.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"## The engine alone, {args.backend} backend: before ({args.base}) and after, in one run")
    print()
    print(f"bench_serving.py's model (Mamba-2, d_model 256, 4 layers, d_state 64), {torch.get_num_threads()} threads, "
          f"{args.gen_tokens}-token generate calls; medians of {args.repeats} back-to-back pairs (order alternating); "
          "the same tokens on both sides (checked). CPU ms/token: process CPU time (all threads) per decoded token, "
          "less sensitive than wall time to other processes on the machine.")
    print()
    print("| streams | before tok/s | before x1 | after tok/s | after x1 | after / before (pairs) | "
          "before CPU ms/tok | after CPU ms/tok | streams per step |")
    print("|---|---|---|---|---|---|---|---|---|")
    b1, a1 = med[("before", levels[0])], med[("after", levels[0])]
    for n in levels:
        b, a = med[("before", n)], med[("after", n)]
        print(f"| {n} | {b:,.0f} | {b / b1:.2f}x | {a:,.0f} | {a / a1:.2f}x | {statistics.median(gains[n]):.2f} | "
              f"{mcpu[('before', n)]:.3f} | {mcpu[('after', n)]:.3f} | {occupancy[('after', n)]:.1f} |")
    print()
    print("all runs (tok/s): " + "; ".join(f"{s} {n}: " + ", ".join(f"{r:,.0f}" for r in rates[(s, n)])
                                         for n in levels for s in ("before", "after")))


if __name__ == "__main__":
    main()
