"""Drift of every backend against the float64 reference: the measurements behind
`scan.TOLERANCES` (issue 5's table), and the negative control.

For each preset, backend and dtype: one scan of N tokens from a warmed-up state, as one call and
in a random partition (one-token, prime, short and long chunks), each against the float64
reference backend on the same weights. Prints markdown: the summary (max abs and relative
logits error, max state error and its tensor, the 2x rule, the misalignment margin), logits
error by position and state error by layer.

    python bench/measure_drift.py [--tokens 1024] [--backends reference,chunked] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mamba_stream.scan import PRESETS, TRAINED_PRESETS, load_model
from mamba_stream.scan._drift import measure_drift, misalignment, random_partition

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
#: a dtype may name a weight format after a slash: "float32/q8" computes in float32 on q8 weights
#: (the exact backend reads them; the truth keeps the checkpoint's own float weights)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens scanned after the warm-up")
    ap.add_argument("--presets", default=",".join([*PRESETS, *TRAINED_PRESETS]))
    ap.add_argument("--backends", default="reference,chunked,exact", help="comma-separated; triton needs CUDA")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    for d in args.dtypes.split(","):
        if d.partition("/")[0] not in DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}, optionally /<weight format>")
    if args.tokens < 2:
        ap.error("--tokens must be at least 2")
    return args


def run(args: argparse.Namespace) -> str:
    rng = random.Random(args.seed)
    lines = [f"# Drift against the float64 reference ({datetime.date.today()})", "",
             f"{args.tokens} tokens after a 17-token warm-up; device {args.device}; torch {torch.__version__}; "
             f"{platform.processor() or platform.machine()}"
             + (f"; {torch.cuda.get_device_name()}" if args.device == "cuda" else ""), "",
             "Relative errors are normwise: |diff| over the largest |truth| of the logits row or of the state tensor "
             "(what `scan.Tolerance` bounds).", "",
             "| preset | backend | dtype | logits abs (1 call / partition) | logits rel | state abs (1 call / "
             "partition) | state rel | worst tensor | 2x rule | misaligned logits (min) | margin |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    detail: list[str] = []
    for preset in args.presets.split(","):
        truth = load_model(preset, backend="reference", dtype=torch.float64, device=args.device)
        start = [rng.randrange(256) for _ in range(17)]
        other = [rng.randrange(256) for _ in range(17)]
        tokens = [rng.randrange(256) for _ in range(args.tokens)]
        chunks = random_partition(args.tokens, args.seed)
        for backend in args.backends.split(","):
            for dname in args.dtypes.split(","):
                if backend == "reference" and dname == "float64":
                    continue  # the truth itself
                try:
                    compute, _, weights = dname.partition("/")
                    model = load_model(preset, backend=backend, dtype=DTYPES[compute], device=args.device,
                                       weights=weights or None)
                    pair = measure_drift(model, truth, tokens, chunks, start)
                    mis = misalignment(model, truth, tokens[:64], start, other)
                except Exception as exc:  # noqa: BLE001 - one broken backend must not hide the others
                    lines.append(f"| {preset} | {backend} | {dname} | error: {type(exc).__name__}: "
                                 f"{str(exc)[:120]} | | | | | | | |")
                    continue
                worst = max(pair.chunked.state_abs, key=pair.chunked.state_abs.get)
                # the noise floor is relative too: 1e-6 (float32) or 1e-12 of the largest truth
                floor = 1e-6 if dname.startswith("float32") else 1e-12
                ok = pair.chunked_within_rule(floor * max(1.0, pair.full.logits_scale),
                                              floor * max(1.0, *pair.full.state_scale.values()))
                bound = max(pair.full.logits_abs, pair.chunked.logits_abs)
                margin = min(mis.values()) / bound if bound else float("inf")
                lines.append(
                    f"| {preset} | {backend} | {dname} | {pair.full.logits_abs:.2e} / {pair.chunked.logits_abs:.2e} "
                    f"| {max(pair.full.logits_rel, pair.chunked.logits_rel):.2e} "
                    f"| {pair.full.state_abs_max:.2e} / {pair.chunked.state_abs_max:.2e} "
                    f"| {max(pair.full.state_rel, pair.chunked.state_rel):.2e} | {worst.split('.', 2)[-1]} "
                    f"| {'ok' if ok else 'BROKEN'} | {min(mis.values()):.2e} | {margin:.0e}x |")
                detail.append(f"\n## {preset}, {backend}, {dname}\n")
                detail.append("| positions | logits abs, 1 call | logits abs, partition |")
                detail.append("|---|---|---|")
                for (rng_txt, a), (_, b) in zip(pair.full.by_position_buckets(), pair.chunked.by_position_buckets(),
                                                strict=False):
                    detail.append(f"| {rng_txt} | {a:.2e} | {b:.2e} |")
                detail.append("\n| layer | state abs, 1 call | state abs, partition |")
                detail.append("|---|---|---|")
                full_l, chunk_l = pair.full.state_by_layer(), pair.chunked.state_by_layer()
                for layer in sorted(full_l):
                    detail.append(f"| {layer} | {full_l[layer]:.2e} | {chunk_l[layer]:.2e} |")
    return "\n".join(lines + detail) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
