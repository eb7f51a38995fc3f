"""The size table: real model shapes x weight formats on the exact backend, against the machine's
read bandwidth measured in the same run.

For each shape (`bench/make_checkpoint.py`: random weights, Hugging Face layout) and each format
the checkpoint is stored in, a fresh process loads it and reports: the time from `load_model` to
the first token's logits (the first load of the process, then a second one: page cache warm, the
revision hash cached, as a restarted worker finds it), its peak RSS beside the weight file's size,
prefill tokens/s (one chunk of --prefill tokens, 128 at 7B; the last token's logits only,
`advance(logits="last")`, as llama-bench's prompt processing computes), decode tokens/s (median 1-token
step), the weight bytes a decode step reads over its time (GB/s) and that rate's share of the
measured read bandwidth (a threaded sum over 1 GiB). A decode step must read every matrix once:
that share is how close it runs to the memory's limit.

With LLAMA_BENCH=/path/to/llama-bench (docs/llamacpp.md says how to build it from the
llama-cpp-python sdist) and GGUF files beside the checkpoints (`<ckpt>/model-<format>.gguf`; with
LLAMA_CONVERT=/path/to/convert_hf_to_gguf.py of the same tree, made where missing), the same rows
run on llama.cpp, interleaved with ours (LLAMA_BENCH_ARGS: more arguments for it).

    python bench/bench_sizes.py [--sizes 130m,1.4b,7b] [--formats float32,bfloat16] [--dir DIR]

Size `7b-falcon` is FalconMamba-7B's shape (a Mamba-1 with B/C/dt norms), measured as `7b` is.
The hybrids (sizes `3b-hybrid`: Granite-4.0-H-Micro's shape, `8b-hybrid`: Nemotron-H-8B's,
`9b-hybrid`: Bamba-9B's, in q8 only) are measured at a context: prefill of --prefill tokens (1024)
from an empty state, then decode at each of --depths (default: the prefill's length; a deeper one
reached by advancing --prefill tokens at a time), on `load_model(d)`'s default backend (exact),
`max_positions` set to what the deepest context needs. llama.cpp beside them: `llama-bench -p
<prefill> -n 0` and `-p 0 -n <steps> -d <depth>` (the depth's prefill is not timed), `-r`
--llama-reps.

    python bench/bench_sizes.py --sizes 3b-hybrid --depths 1024,8192
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = {"130m": ("130m-mamba1", "130m-mamba2"), "1.4b": ("1.4b-mamba1", "1.3b-mamba2"),
         "7b": ("7b-mamba1", "7b-mamba2"), "7b-falcon": ("falcon-mamba-7b",), "3b-hybrid": ("granite-micro",),
         "8b-hybrid": ("nemotron-h-8b",), "9b-hybrid": ("bamba-9b",)}
#: formats a shape is measured in: a 7B model in float32 (29 GB) does not fit this machine kind (24 GB),
#: nor Bamba-9B in bfloat16 (19.6 GB of weights, with llama.cpp's copy in the page cache beside it)
FORMATS = {"130m": ("float32", "bfloat16", "q8"), "1.4b": ("float32", "bfloat16", "q8"), "7b": ("bfloat16", "q8"),
           "7b-falcon": ("bfloat16", "q8"), "3b-hybrid": ("bfloat16", "q8"), "8b-hybrid": ("bfloat16", "q8"),
           "9b-hybrid": ("q8",)}
HYBRID_SIZES = ("3b-hybrid", "8b-hybrid", "9b-hybrid")
#: sizes whose prefill of 128 and 8 decode steps already take minutes a row
_LARGE = ("7b", "7b-falcon", "8b-hybrid", "9b-hybrid")

log = logging.getLogger("bench_sizes")


def _rss_now() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e9


def engine_decode(model: Any, state: Any, logits: Any, streams: int, tokens: int) -> float:
    """Decode tokens/s through the worker's engine (`StreamEngine`) with `streams` streams
    generating at once (each a thread, as activities are), all from `state`: the engine batches
    their single-token steps into one step of the model (one read of the weights for all)."""
    import threading

    import torch

    from mamba_stream.activities import StreamEngine
    from mamba_stream.activities._engine import SeededSampler

    engine = StreamEngine(model)
    sids = [f"s{i}" for i in range(streams)]
    for sid in sids:
        engine.put(sid, state, epoch=0, state_key="k0", logits=logits)

    def run(sid: str) -> None:
        engine.generate(sid, SeededSampler(1.0, 0, torch.Generator().manual_seed(0)), tokens, expected_key="k0",
                        epoch=0, load=lambda: (state, logits))

    threads = [threading.Thread(target=run, args=(sid,)) for sid in sids]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    engine.close()
    return streams * tokens / wall


def child(ckpt: Path, weights: str, prefill: int, steps: int, runs: int, backend: str = "exact",
          depths: tuple[int, ...] = (), batch: int = 0) -> dict:
    """One process, one model: load, first token, prefill, decode (at each of `depths` after the
    prefill's own length, a deeper context reached `prefill` tokens at a time)."""
    t0 = time.perf_counter()
    import torch

    from mamba_stream.activities import tune_allocator
    from mamba_stream.scan import load_model

    tune_allocator()  # as a worker's engine does: a step's temporaries reused, not faulted in afresh

    t_import = time.perf_counter() - t0
    # a model with attention holds max_positions KV rows a stream: as many as the deepest context needs
    kw = {"max_positions": max(prefill, *depths) + steps + 4} if depths else {}
    t1 = time.perf_counter()
    model = load_model(ckpt, backend=backend, weights=weights, **kw)
    first = model.advance(model.initial_state(), [1])
    t_first = time.perf_counter() - t1
    # again, as a worker that restarts finds it: the file in the page cache, its revision hash
    # cached (`scan._loading._revision_of`), the kernels built
    del model, first
    gc.collect()  # the first model's mapping goes before the second is made (the peak RSS is one model's)
    t1 = time.perf_counter()
    model = load_model(ckpt, backend=backend, weights=weights, **kw)
    first = model.advance(model.initial_state(), [1])
    t_again = time.perf_counter() - t1
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (max(prefill, *depths, 0) + steps + 2,), generator=g).tolist()
    s0 = model.initial_state()
    pre = []
    for _ in range(runs):
        t = time.perf_counter()
        r = model.advance(s0, ids[:prefill], logits="last")  # the next token's row, as llama-bench computes
        pre.append(time.perf_counter() - t)
    def decode(st, at: int) -> float:  # the median 1-token step from a state at position `at`
        times = []
        for i in range(steps + 2):
            t = time.perf_counter()
            st = model.advance(st, [ids[at + i]]).state
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])

    step = decode(r.state, prefill)
    decode_at, st, at = {}, r.state, prefill
    for depth in depths:
        while at < depth:
            n = min(prefill, depth - at)
            st, at = model.advance(st, ids[at:at + n], logits="last").state, at + n
        decode_at[depth] = 1 / (step if depth == prefill else decode(st, depth))
    # the memory of one stream's work, before the engine's batch (its streams' states) adds its own
    rss_peak, rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, _rss_now()
    batched = {}
    if batch:  # one stream, then `batch` at once, through the engine (the first call warms it)
        engine_decode(model, r.state, r.logits[-1], 1, 4)
        batched = {str(n): engine_decode(model, r.state, r.logits[-1], n, steps) for n in (1, batch)}
    lm = model.module
    seen: set[int] = set()
    read = 0  # bytes a decode step reads: every parameter once (the embedding's one row aside, when untied)
    tensors = [*lm.named_parameters(remove_duplicate=False), *lm.named_buffers(remove_duplicate=False)]
    for name, p in tensors:  # q8 matrices are buffers (weight_q8, weight_scale)
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name.startswith("backbone.embedding.weight") and not model.config.tie_embeddings:
            read += p[0].numel() * p.element_size()
        else:
            read += p.numel() * p.element_size()
    return {"import_s": t_import, "first_token_s": t_first, "again_s": t_again, "probe_s": model.exact_probe.seconds,
            "path": first.path, "rss_peak_gb": rss_peak,
            "rss_gb": rss, "prefill_tok_s": prefill / statistics.median(pre), "decode_tok_s": 1 / step,
            "read_gb": read / 1e9, "weight_gbs": read / step / 1e9, "arithmetic": model.arithmetic().id,
            "decode_at": decode_at, "batched": batched}


#: llama.cpp's converter's --outtype for each of our formats (q8: Q8_0, from the float32 checkpoint)
_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8": "q8_0"}


def _convert(converter: Path, src: Path, fmt: str, gguf: Path) -> None:
    """`src` (a checkpoint in Hugging Face layout) -> `gguf` with llama.cpp's own converter (its
    gguf-py beside it). A Mamba-2 is converted from a copy of the config that pads the vocabulary to
    a multiple of 8, so that the token list is as long as the embedding (docs/llamacpp.md)."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(dir=gguf.parent) as tmp:
        cfg = json.loads((src / "config.json").read_text())
        if cfg.get("model_type") == "mamba2":
            cfg["pad_vocab_size_multiple"] = 8
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        (Path(tmp) / "model.safetensors").symlink_to(src / "model.safetensors")
        part = gguf.with_suffix(".part")
        cmd = [sys.executable, str(converter), tmp, "--outtype", _OUTTYPES[fmt], "--outfile", str(part)]
        proc = subprocess.run(cmd, cwd=converter.parent, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(converter.parent / "gguf-py")})
        if proc.returncode != 0:
            raise RuntimeError(f"{converter.name} failed on {src}: {proc.stderr.strip()[-300:]}")
        shutil.move(str(part), gguf)


def _llama(bench: str, gguf: Path, prefill: int, steps: int, depths: tuple[int, ...] = (), reps: int = 3
           ) -> dict | None:
    """llama-bench's prefill and decode tokens/s; with `depths`, prefill from an empty context and
    decode after each depth (`-d`, its prefill untimed), as the hybrids' rows measure ours."""
    if not gguf.exists():
        return None
    threads = str(os.cpu_count() or 1)
    extra = os.environ.get("LLAMA_BENCH_ARGS", "").split()  # e.g. "--repack 0" (docs/llamacpp.md)

    def run(*args: str) -> list[dict]:
        cmd = [bench, "-m", str(gguf), *args, "-t", threads, "-r", str(reps), "-o", "json", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode < 0 and "--repack" not in extra:
            # a native build's AMX Q8_0 kernel dies on a VM that does not hand out AMX's tile state
            # (docs/llamacpp.md): its weights kept in plain buffers instead, on the AVX-512 path
            log.warning("llama-bench died (signal %d) on %s; again with --repack 0", -out.returncode, gguf.name)
            extra.extend(["--repack", "0"])
            return run(*args)
        if out.returncode != 0:
            raise RuntimeError(f"llama-bench failed ({out.returncode}) on {gguf}: {out.stderr.strip()[-200:]}")
        return json.loads(out.stdout)

    if not depths:
        rows = run("-p", str(prefill), "-n", str(steps))
        pre = next(r["avg_ts"] for r in rows if r.get("n_prompt", 0) > 0)
        dec = next(r["avg_ts"] for r in rows if r.get("n_gen", 0) > 0)
        return {"prefill_tok_s": pre, "decode_tok_s": dec, "args": " ".join(extra)}
    pre = next(r["avg_ts"] for r in run("-p", str(prefill), "-n", "0") if r.get("n_prompt", 0) > 0)
    rows = run("-p", "0", "-n", str(steps), "-d", ",".join(map(str, depths)))
    decode_at = {r["n_depth"]: r["avg_ts"] for r in rows if r.get("n_gen", 0) > 0}
    return {"prefill_tok_s": pre, "decode_tok_s": decode_at[depths[0]], "decode_at": decode_at,
            "args": " ".join(extra)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="130m,1.4b")
    ap.add_argument("--formats", default="", help="only these formats (default: every format a size is measured in)")
    ap.add_argument("--shapes", default="", help="only these shapes, e.g. 7b-mamba1 (default: both of every size)")
    ap.add_argument("--dir", type=Path,
                    default=Path(os.environ.get("MAMBA_STREAM_BENCH_DIR", "/tmp/mamba-stream-bench")))
    ap.add_argument("--steps", type=int, default=0, help="decode steps (default 32; 16 hybrids; 8 at 7B and up)")
    ap.add_argument("--runs", type=int, default=3, help="prefill runs per process (medians)")
    ap.add_argument("--child", nargs=2, metavar=("CKPT", "WEIGHTS"), help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=int, default=0, help="prefill tokens (default 512; 128 at 1.4B and 7B)")
    ap.add_argument("--backends", default="",
                    help="exact backends, a row each: exact (exact-1), exact-fma (exact-2: fused multiply-adds); "
                    "default both, exact alone (load_model's default) for the hybrids")
    ap.add_argument("--depths", default="", help="hybrids: contexts to decode at (default: the prefill's length)")
    ap.add_argument("--llama-reps", type=int, default=0, help="llama-bench -r (default 3; 1 for the hybrids)")
    ap.add_argument("--batch", type=int, default=-1,
                    help="streams decoding at once through the engine, against one (default 32 at 130M; 0: none)")
    args = ap.parse_args()
    depths = tuple(int(d) for d in args.depths.split(",") if d)
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], args.prefill, args.steps, args.runs,
                               args.backends, depths, max(args.batch, 0))))
        return

    from bench.bench_scan import read_bandwidth
    from bench.make_checkpoint import make

    bw = read_bandwidth()
    llama = os.environ.get("LLAMA_BENCH")
    from mamba_stream.scan.exact import build_kernels

    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), []) if Path("/proc/cpuinfo").exists() else []
    isa = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags)
    print(f"CPU: {isa or 'unknown'}; our kernels: {build_kernels()[1]}"
          + (f"; llama-bench: {llama}" if llama else ""))
    which = args.backends or "exact,exact-fma; hybrids exact"
    print(f"exact backends ({which}), {os.cpu_count()} threads; read bandwidth {bw / 1e9:.1f} GB/s "
          f"(a threaded sum of 1 GiB); random-weight checkpoints (bench/make_checkpoint.py); one process per row")
    print(f"{'shape':<15} {'format':<9} {'file GB':>8} {'load s':>11} {'RSS GB':>7} {'RSS/file':>8} "
          f"{'prefill tok/s':>14} {'decode tok/s':>13} {'GB/s':>6} {'of bw':>6}  arithmetic")
    for size in args.sizes.split(","):
        hybrid = size in HYBRID_SIZES
        prefill = args.prefill or (512 if size == "130m" else 1024 if hybrid else 128)
        steps = args.steps or (8 if size in _LARGE else 16 if hybrid else 32)
        at = (depths or (prefill,)) if hybrid else ()
        backends = args.backends or ("exact" if hybrid else "exact,exact-fma")
        reps = args.llama_reps or (1 if hybrid else 3)
        batch = args.batch if args.batch >= 0 else (32 if size == "130m" else 0)
        for shape in SIZES[size]:
            if args.shapes and shape not in args.shapes.split(","):
                continue
            for fmt in FORMATS[size]:
                if args.formats and fmt not in args.formats.split(","):
                    continue
                ckpt = make(shape, fmt, args.dir / f"{shape}-{fmt}")
                converter = os.environ.get("LLAMA_CONVERT")  # llama.cpp's convert_hf_to_gguf.py
                if llama and converter and not (ckpt / f"model-{fmt}.gguf").exists():
                    # Q8_0 is quantized by llama.cpp's own rounding from the float32 checkpoint
                    src = make(shape, "float32", args.dir / f"{shape}-float32") if fmt == "q8" else ckpt
                    _convert(Path(converter), src, fmt, ckpt / f"model-{fmt}.gguf")
                file_gb = (ckpt / "model.safetensors").stat().st_size / 1e9
                rows = {}
                for backend in backends.split(","):
                    proc = subprocess.run([sys.executable, __file__, "--child", str(ckpt), fmt, "--prefill",
                                           str(prefill), "--steps", str(steps), "--runs", str(args.runs),
                                           "--backends", backend, "--depths", ",".join(map(str, at)),
                                           "--batch", str(batch)],
                                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
                    if proc.returncode != 0:
                        print(f"{shape:<15} {fmt:<9} {backend} failed: {proc.stderr.strip().splitlines()[-1:]}")
                        continue
                    r = rows[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
                    load = f"{r['first_token_s']:.1f}, {r['again_s']:.1f}"
                    print(f"{shape:<15} {fmt:<9} {file_gb:>8.2f} {load:>11} {r['rss_peak_gb']:>7.2f} "
                          f"{r['rss_peak_gb'] / file_gb:>8.2f} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.2f} "
                          f"{r['weight_gbs']:>6.1f} {r['weight_gbs'] * 1e9 / bw:>6.0%}  "
                          f"{r['arithmetic']} ({r['path']}, probe {r['probe_s']:.1f} s)")
                    if r.get("batched"):
                        one, many = r["batched"]["1"], r["batched"][str(batch)]
                        print(f"{'':<15} {'':<9} {'engine':>8} {f'{batch} / 1':>11} {'':>7} {'':>8} {'':>14} "
                              f"{many:>13.2f}   decode tok/s through the engine: {batch} streams {many:.1f}, "
                              f"1 stream {one:.1f}: {many / one:.1f}x")
                    for depth, tps in r.get("decode_at", {}).items():
                        print(f"{'':<15} {'':<9} {'decode at':>8} {depth:>11} {'':>7} {'':>8} {'':>14} {tps:>13.2f}")
                if llama and rows:
                    gguf = ckpt / f"model-{fmt}.gguf"
                    ll = _llama(llama, gguf, prefill, steps, at, reps)
                    if ll is None:
                        print(f"{'':<15} {'llama.cpp':<9} no {gguf} (docs/llamacpp.md: convert_hf_to_gguf.py)")
                    else:
                        ratios = "; ".join(f"{b} prefill {x['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x, decode "
                                           f"{x['decode_tok_s'] / ll['decode_tok_s']:.2f}x" for b, x in rows.items())
                        print(f"{'':<15} {'llama.cpp':<9} {'':>8} {'':>11} {'':>7} {'':>8} "
                              f"{ll['prefill_tok_s']:>14.1f} {ll['decode_tok_s']:>13.2f}   -> ours/llama.cpp: {ratios}"
                              + (f" (llama-bench {ll['args']})" if ll["args"] else ""))
                        for depth, tps in ll.get("decode_at", {}).items():
                            mine = "; ".join(f"{b} {x['decode_at'][str(depth)] / tps:.2f}x" for b, x in rows.items())
                            print(f"{'':<15} {'llama.cpp':<9} {'decode at':>8} {depth:>11} {'':>7} {'':>8} {'':>14} "
                                  f"{tps:>13.2f}   -> ours/llama.cpp decode at {depth}: {mine}")


if __name__ == "__main__":
    main()
