"""Prefill and decode throughput, per architecture and backend, beside Hugging Face transformers.

Our backends side by side: exact (the CPU default: bit-exact under any chunking), chunked
(approximate, within scan.TOLERANCES) and reference (exact, one token at a time), and the path
each ran. Same weights on both sides: each HF model (random init, fixed seed) is saved with
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
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mamba_stream.scan import ModelConfig, init_model, load_model

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
    ap.add_argument("--big-steps", type=int, default=16, help="decode steps on the 130M-shaped models (0: skip)")
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
            impls = {f"ours: {b}": _ours(ours[arch].with_backend(b), prefill_ids)
                     for b in ("reference", "chunked", "exact")}
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
            ex, ch = rows["ours: exact"], rows["ours: chunked"]
            print(f"{arch:<7} -> exact vs chunked: prefill {ex[0] / ch[0]:.2f}x, decode {ch[1] / ex[1]:.2f}x")
    if args.big_steps:
        big_prefill(args.prefill, args.runs, ("exact", "exact-fma", "chunked"))
        big_decode(args.big_steps, ("exact", "exact-fma", "chunked"))


#: the 130M shapes (d_model 768, 24 layers, vocab 50280) of each architecture
BIG = {"mamba1": {"d_state": 16}, "mamba2": {"d_state": 128, "headdim": 64},
       "mamba3": {"d_state": 64, "headdim": 64}}


def big_prefill(tokens: int, runs: int, backends: tuple[str, ...]) -> None:
    """Prefill of one `tokens`-token chunk on 130M-shaped models, the backends interleaved round by
    round (this machine's speed drifts by a fifth between minutes: only ratios within a run count);
    each backend's rate over the last one's."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50280, (tokens,), generator=g).tolist()
    print(f"\n130M-shaped models (d_model 768, 24 layers, vocab 50280, random weights), float32, prefill of one "
          f"{tokens}-token chunk, median of {runs} rounds, backends interleaved")
    last = backends[-1]
    print(f"{'arch':<7} " + " ".join(f"{b + ' tok/s':>18}" for b in backends) + " "
          + " ".join(f"{b + '/' + last:>18}" for b in backends[:-1]))
    for arch, extra in BIG.items():
        cfg = ModelConfig.create(architecture=arch, d_model=768, n_layer=24, vocab_size=50280, **extra)
        base = init_model(cfg, seed=0)
        models = {b: base.with_backend(b) for b in backends}
        for m in models.values():
            m.advance(m.initial_state(), ids[:32])
        times: dict[str, list[float]] = {b: [] for b in backends}
        for _ in range(runs):
            for b, m in models.items():
                t = time.perf_counter()
                m.advance(m.initial_state(), ids)
                times[b].append(time.perf_counter() - t)
        rate = {b: tokens / statistics.median(v) for b, v in times.items()}
        print(f"{arch:<7} " + " ".join(f"{rate[b]:>18,.1f}" for b in backends) + " "
              + " ".join(f"{rate[b] / rate[last]:>17.2f}x" for b in backends[:-1]))
        del base, models


def read_bandwidth(gib: float = 1.0, runs: int = 5) -> float:
    """Bytes per second of a threaded read of a large buffer (a sum), the best of `runs`."""
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def big_decode(steps: int, backends: tuple[str, ...]) -> None:
    """Decode on 130M-shaped models (d_model 768, 24 layers, vocab 50280), against the bandwidth
    limit: a decode step must read every weight once."""
    bw = read_bandwidth()
    print(f"\n130M-shaped models (d_model 768, 24 layers, vocab 50280, random weights), decode 1 token after a "
          f"16-token prefill, median of {steps} steps; read bandwidth {bw / 1e9:.1f} GB/s (a threaded sum of 1 GiB)")
    print(f"{'arch':<7} {'backend':<10} {'path':<11} {'decode tok/s':>13} {'ms/step':>8} {'weight MB':>10} "
          f"{'GB/s':>6} {'of limit':>9}")
    for arch in ("mamba1", "mamba2"):
        cfg = ModelConfig.create(architecture=arch, d_model=768, n_layer=24, vocab_size=50280, **BIG[arch])
        base = init_model(cfg, seed=0)
        weight_bytes = sum(p.numel() * p.element_size() for p in base.module.parameters())
        for backend in backends:
            model = base.with_backend(backend)
            st = model.advance(model.initial_state(), list(range(16))).state
            times, path = [], ""
            for i in range(steps + 2):
                t = time.perf_counter()
                r = model.advance(st, [i + 3])
                times.append(time.perf_counter() - t)
                st, path = r.state, r.path
            step = statistics.median(times[2:])
            rate = weight_bytes / step
            print(f"{arch:<7} {backend:<10} {path:<11} {1 / step:>13,.1f} {step * 1000:>8.2f} "
                  f"{weight_bytes / 1e6:>10,.0f} "
                  f"{rate / 1e9:>6.1f} {rate / bw:>8.0%}")
        del base


def transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
