"""Measure the chunked backend against the reference backend; prints the table behind
`scan._tolerance.TOLERANCES`.

For every preset and dtype: random token sequences, scanned whole and in random partitions
(one-token chunks included) from a non-trivial starting state, by both backends. Reports the
largest absolute and relative (to max |reference|) differences of logits and of each state role,
and the same statistics for a deliberately misaligned state (one position off), which a
tolerance must reject by a wide margin.

    python bench/measure_tolerance.py [--sequences 6] [--length 300]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scan import PRESETS, load_model  # noqa: E402


def _partition(rng: random.Random, n: int) -> list[int]:
    out, total = [], 0
    while total < n:
        c = min(rng.choice([1, 1, 2, 3, 7, 16, 17, 64, 129]), n - total)
        out.append(c)
        total += c
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=6)
    ap.add_argument("--length", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"{'preset':<18} {'dtype':<8} {'logits abs':>11} {'logits rel':>11} {'state abs':>10} "
          f"{'worst role':>10} {'misaligned logits abs':>22}")
    for name in PRESETS:
        for dtype in (torch.float32, torch.float64):
            ref = load_model(name, backend="reference", dtype=dtype)
            fast = ref.with_backend("chunked")
            rng = random.Random(0)
            worst = {"logits": 0.0, "rel": 0.0, "state": 0.0, "role": "", "misaligned": float("inf")}
            for _ in range(args.sequences):
                warm = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
                start = ref.advance(ref.initial_state(), warm).state
                toks = [rng.randrange(256) for _ in range(args.length)]
                truth = ref.advance(start, toks)
                for chunks in ([args.length], _partition(rng, args.length)):
                    st, pos, rows = start, 0, []
                    for c in chunks:
                        step = fast.advance(st, toks[pos : pos + c])
                        rows.append(step.logits)
                        st, pos = step.state, pos + c
                    lg = torch.cat(rows)
                    d = (lg - truth.logits).abs().max().item()
                    worst["logits"] = max(worst["logits"], d)
                    worst["rel"] = max(worst["rel"], d / truth.logits.abs().max().item())
                    for key, t in st.tensors.items():
                        sd = (t - truth.state.tensors[key]).abs().max().item()
                        if sd > worst["state"]:
                            worst["state"], worst["role"] = sd, key.split(".")[-1]
                # negative control: the state one token behind, fed the same continuation
                behind = ref.advance(ref.initial_state(), warm[:-1]).state if len(warm) > 1 else ref.initial_state()
                mis = ref.advance(behind, toks).logits
                worst["misaligned"] = min(worst["misaligned"], (mis - truth.logits).abs().max().item())
            print(f"{name:<18} {str(dtype)[6:]:<8} {worst['logits']:>11.2e} {worst['rel']:>11.2e} "
                  f"{worst['state']:>10.2e} {worst['role']:>10} {worst['misaligned']:>22.2e}")


if __name__ == "__main__":
    main()
