"""Kernel matrix: prefill and decode, kept apart, per architecture, dtype, d_state, length, batch.

For each configuration the first call (compile, autotune, warm-up) is timed on its own, then the
steady state (median of repeats, CUDA-synchronized). Per layer-shaped scan with synthetic inputs:
- prefill: one chunk of L tokens at batch 1, from a non-zero state: tokens/s and us/token, and the
  crossover (the shortest L whose per-token cost is within 10% of the best);
- decode: one token for each of B streams: us/step, us per stream-token, state bytes read and
  written, and the bandwidth limit (those bytes over the measured device copy bandwidth);
- mamba-ssm's own `Mamba2.step()` beside our step at batch 1 and 64 (same weights), on CUDA.

On CUDA the scans are the triton backend's kernels; on CPU (for CI and smoke runs) the chunked
backend's torch scans. Markdown goes to stdout and, with --out, to a file.

    python bench/bench_kernels.py [--quick] [--device cuda] [--out docs/results/kernels.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mamba_stream.scan import ModelConfig, init_model
from mamba_stream.scan._forward import backend_named

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--archs", default="mamba2,mamba3,mamba1")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--d-states", default="128")
    ap.add_argument("--lengths", default=",".join(str(2**i) for i in range(13)), help="prefill chunk lengths")
    ap.add_argument("--batches", default="1,8,64,256", help="decode batch sizes")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="a small sweep (CI smoke runs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.batches, args.repeats, args.d_states = "1,4,16,64", "1,4", 3, "16"
    for name in ("lengths", "batches", "d_states"):
        try:
            vals = [int(v) for v in getattr(args, name).split(",")]
        except ValueError:
            ap.error(f"--{name.replace('_', '-')} takes comma-separated integers")
        if not vals or min(vals) < 1:
            ap.error(f"--{name.replace('_', '-')} values must be positive")
        setattr(args, name, vals)
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    for a in args.archs.split(","):
        if a not in ("mamba1", "mamba2", "mamba3"):
            ap.error(f"unknown architecture {a!r}")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(first call seconds, median steady-state seconds)."""
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    x = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    _, t = _time(lambda: y.copy_(x), device, 5)
    return 2 * x.numel() / t


def _layer(arch: str, d_state: int, device: torch.device):
    """One mixer shaped like a 130M model's layer (d_model 768, 24 heads of 64)."""
    extra = {"headdim": 64} if arch != "mamba1" else {}
    cfg = ModelConfig.create(architecture=arch, d_model=768, n_layer=1, vocab_size=256, d_state=d_state, **extra)
    model = init_model(cfg, seed=0, device=device, backend="auto")
    return model, model.module.mixers[0]


def _states(mixer, batch: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)
    return tuple((torch.randn(batch, *shape, generator=g) * 0.1).to(device) for _, shape in mixer.state_shapes())


def run(args: argparse.Namespace) -> str:
    device = torch.device(args.device)
    use_kernels = device.type == "cuda"
    if use_kernels:
        from mamba_stream.scan import _triton

        reason = _triton.unavailable_reason(device)
        if reason:
            raise SystemExit(f"bench_kernels: {reason}")
        backend, impl = _triton.TRITON, "triton kernels"
    else:
        backend, impl = backend_named("chunked"), "chunked backend (torch, CPU)"

    def step_fn(m, u, st):  # one token: (B, D) in, (B, D) out
        out, new, path = backend.mix(m, u.unsqueeze(1), st)
        return out[:, 0], new, path

    def chunk_fn(m, u, st):
        return backend.mix(m, u, st)

    bw = copy_bandwidth(device) if use_kernels else float("nan")
    out = [f"# Kernel matrix ({datetime.date.today()})", "",
           f"device {torch.cuda.get_device_name() if use_kernels else 'cpu'}; torch {torch.__version__}; {impl}; "
           f"one layer shaped like a 130M model (d_model 768); median of {args.repeats} after a timed first call"
           + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if use_kernels else ""), ""]
    prefill = ["## Prefill (one chunk, batch 1)", "",
               "| arch | dtype | d_state | tokens | first call ms | steady ms | us/token | tokens/s | path |",
               "|---|---|---|---|---|---|---|---|---|"]
    decode = ["## Decode (one token per stream)", "",
              "| arch | dtype | d_state | batch | first call ms | us/step | us/stream-token | state MB moved | "
              "bandwidth limit us | x limit | path |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    crossover = ["## Crossover (shortest chunk within 10% of the best per-token prefill cost)", "",
                 "| arch | dtype | d_state | crossover tokens | best us/token |", "|---|---|---|---|---|"]
    for arch in args.archs.split(","):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            if dtype != torch.float32 and not use_kernels:
                continue  # the torch paths compute in the model's float32
            for d_state in args.d_states:
                model, mixer = _layer(arch, d_state, device)
                mixer = mixer.to(dtype)  # bfloat16 weights and activations; states stay float32
                per_token: dict[int, float] = {}
                with torch.inference_mode():
                    for length in args.lengths:
                        u = torch.randn(1, length, 768, device=device).to(dtype)
                        st = _states(mixer, 1, device)
                        try:
                            result: list = []
                            # _time calls it at once (B023); `mixer` is deleted only after this loop (F821)
                            first, t = _time(lambda: result.append(chunk_fn(mixer, u, st)), device, args.repeats)  # noqa: B023, F821
                            path = result[-1][2]
                        except Exception as exc:  # noqa: BLE001 - report, keep sweeping
                            prefill.append(f"| {arch} | {dname} | {d_state} | {length} | error: {type(exc).__name__}: "
                                           f"{str(exc)[:80]} | | | | |")
                            continue
                        per_token[length] = t / length
                        prefill.append(f"| {arch} | {dname} | {d_state} | {length} | {first * 1e3:.1f} | "
                                       f"{t * 1e3:.3f} | {t / length * 1e6:.2f} | {length / t:,.0f} | {path} |")
                    for batch in args.batches:
                        u = torch.randn(batch, 768, device=device).to(dtype)
                        st = _states(mixer, batch, device)
                        moved = 2 * batch * sum(x[0].numel() * x.element_size() for x in st)
                        try:
                            result = []
                            # _time calls it at once (B023); `mixer` is deleted only after this loop (F821)
                            first, t = _time(lambda: result.append(step_fn(mixer, u, st)), device, args.repeats)  # noqa: B023, F821
                            path = result[-1][2]
                        except Exception as exc:  # noqa: BLE001
                            decode.append(f"| {arch} | {dname} | {d_state} | {batch} | error: {type(exc).__name__}: "
                                          f"{str(exc)[:80]} | | | | | | |")
                            continue
                        limit = moved / bw if use_kernels else float("nan")
                        decode.append(f"| {arch} | {dname} | {d_state} | {batch} | {first * 1e3:.1f} | {t * 1e6:.1f} | "
                                      f"{t / batch * 1e6:.2f} | {moved / 1e6:.2f} | {limit * 1e6:.2f} | "
                                      f"{t / limit if use_kernels else float('nan'):.1f} | {path} |")
                if per_token:
                    best = min(per_token.values())
                    cross = min(length for length, v in per_token.items() if v <= 1.1 * best)
                    crossover.append(f"| {arch} | {dname} | {d_state} | {cross} | {best * 1e6:.2f} |")
                del model, mixer
    text = out + prefill + [""] + decode + [""] + crossover
    if use_kernels:
        text += ["", *mamba_ssm_step_comparison(device, args.repeats)]
    return "\n".join(text) + "\n"


def mamba_ssm_step_comparison(device: torch.device, repeats: int) -> list[str]:
    """Our Mamba-2 step against mamba-ssm's own `Mamba2.step()` with the same weights."""
    from mamba_ssm.modules.mamba2 import Mamba2

    from mamba_stream.scan import _triton

    rows = ["## Decode step: ours vs mamba-ssm's `Mamba2.step()` (one layer, same weights)", "",
            "| batch | ours us | mamba-ssm us | ours / theirs speed |", "|---|---|---|---|"]
    _model, mixer = _layer("mamba2", 128, device)
    theirs = Mamba2(768, d_state=128, headdim=64, layer_idx=0, device=device)
    theirs.load_state_dict(mixer.state_dict(), strict=True)
    with torch.inference_mode():
        for batch in (1, 64):
            u = torch.randn(batch, 768, device=device)
            st = _states(mixer, batch, device)
            conv = st[0].clone()
            ssm = st[1].clone()
            _, ours = _time(lambda: _triton.TRITON.mix(mixer, u.unsqueeze(1), st), device, repeats)  # noqa: B023 - _time calls it at once
            _, ref = _time(lambda: theirs.step(u.unsqueeze(1), conv, ssm), device, repeats)  # noqa: B023 - _time calls it at once
            rows.append(f"| {batch} | {ours * 1e6:.1f} | {ref * 1e6:.1f} | {ref / ours:.2f}x |")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
