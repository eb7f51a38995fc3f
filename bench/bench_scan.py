"""Prefill and decode throughput, per architecture and backend, beside Hugging Face transformers.

Same weights on both sides: each HF model (random init, fixed seed) is saved with
`save_pretrained` and loaded through `load_model`. Prefill: one 512-token chunk from the initial
state, median of 5 runs. Decode: 1-token steps from the state after a 16-token prefill; median
step time over 64 steps, median of 3 repetitions. Prefill and decode are never averaged together.
CPU timings are relative: read the ratios, measured side by side in this one run.

    python bench/bench_scan.py [--prefill 512] [--steps 64] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scan import ModelConfig, init_model, load_model  # noqa: E402

D_MODEL, N_LAYER, VOCAB = 256, 4, 1024


class _Impl:
    """One implementation under test: a prefill call and a decode session."""

    def __init__(self, prefill: Callable[[], object], decode_steps: Callable[[int], list[float]]) -> None:
        self.prefill = prefill
        self.decode_steps = decode_steps
        self.prefill_times: list[float] = []
        self.step_medians: list[float] = []


def _ours(model, ids: list[int]) -> _Impl:
    s0 = model.initial_state()
    warm = model.advance(s0, ids[:16]).state

    def decode(steps: int) -> list[float]:
        st, times = warm, []
        for i in range(steps):
            t = time.perf_counter()
            st = model.advance(st, [ids[16 + i]]).state
            times.append(time.perf_counter() - t)
        return times

    return _Impl(lambda: model.advance(s0, ids), decode)


def _hf(hf, ids: list[int]) -> _Impl:
    from transformers import DynamicCache

    x = torch.tensor([ids])

    def prefill() -> object:
        with torch.no_grad():
            return hf(x, use_cache=False)

    def decode(steps: int) -> list[float]:
        with torch.no_grad():
            out = hf(x[:, :16], cache=DynamicCache(config=hf.config), use_cache=True)
            cache, times = out.cache, []
            for i in range(steps):
                t = time.perf_counter()
                out = hf(x[:, 16 + i : 17 + i], cache=cache, use_cache=True)
                times.append(time.perf_counter() - t)
                cache = out.cache
        return times

    return _Impl(prefill, decode)


def _measure(impls: dict[str, _Impl], rounds: int, steps: int, slow: set[str]) -> None:
    """Interleaved rounds, so that drift in the machine's speed hits every implementation alike."""
    for impl in impls.values():  # warm-up
        impl.prefill()
        impl.decode_steps(4)
    for r in range(rounds):
        for name, impl in impls.items():
            if name in slow and r >= 2:
                continue
            t = time.perf_counter()
            impl.prefill()
            impl.prefill_times.append(time.perf_counter() - t)
            impl.step_medians.append(statistics.median(impl.decode_steps(steps)))


def _hf_models(tmp: Path):
    import transformers
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    transformers.logging.set_verbosity_error()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m1 = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYER,
                                          state_size=16, expand=2, conv_kernel=4)).eval()
        m2 = Mamba2ForCausalLM(Mamba2Config(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYER,
                                            state_size=64, expand=2, head_dim=64, num_heads=8, n_groups=1,
                                            conv_kernel=4, chunk_size=64)).eval()
    out = {}
    for arch, hf in (("mamba1", m1), ("mamba2", m2)):
        d = tmp / arch
        hf.save_pretrained(str(d))
        out[arch] = (hf, load_model(d))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (max(args.prefill, 16 + args.steps),), generator=g).tolist()
    prefill_ids = ids[: args.prefill]

    with tempfile.TemporaryDirectory() as tmp:
        try:
            hf_models = _hf_models(Path(tmp))
        except ImportError:
            hf_models = {}
            print("transformers is not installed: HF rows skipped")
        cfg3 = ModelConfig.create(architecture="mamba3", d_model=D_MODEL, n_layer=N_LAYER, vocab_size=VOCAB,
                                  d_state=64, headdim=64)
        ours = {arch: m for arch, (_, m) in hf_models.items()}
        ours["mamba3"] = init_model(cfg3, seed=0)

        print(f"CPU, {torch.get_num_threads()} threads, float32; d_model {D_MODEL}, {N_LAYER} layers, "
              f"vocab {VOCAB}; prefill = one {args.prefill}-token chunk (median of {args.runs}); "
              f"decode = median 1-token step over {args.steps} steps (median of {args.runs} sessions); "
              "rounds interleaved")
        print(f"{'arch':<7} {'implementation':<26} {'prefill tok/s':>14} {'decode tok/s':>13} {'ms/step':>8}")
        for arch in ("mamba1", "mamba2", "mamba3"):
            impls = {f"ours: {b}": _ours(ours[arch].with_backend(b), prefill_ids) for b in ("reference", "chunked")}
            if arch in hf_models:
                impls[f"HF transformers {transformers_version()}"] = _hf(hf_models[arch][0], prefill_ids)
            _measure(impls, args.runs, args.steps, slow={"ours: reference"})
            rows = {k: (len(prefill_ids) / statistics.median(v.prefill_times), statistics.median(v.step_medians))
                    for k, v in impls.items()}
            for name, (pre, step) in rows.items():
                print(f"{arch:<7} {name:<26} {pre:>14,.0f} {1 / step:>13,.0f} {step * 1000:>8.2f}")
            best_pre = max((v[0], k) for k, v in rows.items() if k.startswith("ours"))
            best_dec = min((v[1], k) for k, v in rows.items() if k.startswith("ours"))
            hf_key = next((k for k in rows if k.startswith("HF")), None)
            if hf_key:
                hp, hd = rows[hf_key]
                print(f"{arch:<7} -> prefill: {best_pre[1]} at {best_pre[0] / hp:.2f}x HF "
                      f"({'ours' if best_pre[0] >= hp else 'HF'} wins); decode: {best_dec[1]} at "
                      f"{hd / best_dec[0]:.2f}x HF ({'ours' if best_dec[0] <= hd else 'HF'} wins)")
            else:
                print(f"{arch:<7} -> fastest prefill: {best_pre[1]}; fastest decode: {best_dec[1]} (no HF Mamba-3)")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
