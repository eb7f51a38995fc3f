"""Serving many streams: what a fixed-size state buys. Three tables, each side by side in one run.

(a) An agent conversation of 50 turns: our stream fed only each turn's new tokens, against the
    usual way of re-feeding the whole history to Hugging Face transformers each turn (same
    weights). Per-turn latency and peak RSS growth, by turn.
(b) Throughput through Temporal with 1, 8, 32 and 128 concurrent streams: 1-token `advance`
    chunks per second, and decode tokens per second through `generate` updates (the engine batches
    every stream's sampling steps). p50 and p99 update latency, and batch occupancy (streams per
    batched step).
(c) Memory against position up to 1M tokens for one stream: state bytes and process RSS, beside
    the KV-cache bytes a same-width attention model would hold.

    python bench/bench_serving.py [--turns 50] [--positions 1000000] [--skip a,b,c]
    python bench/bench_serving.py --skip a,c,b-temporal     # (b)'s engine-alone table only
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mamba_stream.scan import load_model


def rss_bytes(field: str = "VmRSS") -> int:
    """Resident set size (VmRSS) or its high-water mark (VmHWM) of this process."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Peak RSS while a block runs (sampled every 0.5 ms)."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.0005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 1e6


def _hf_pair(tmp: Path):
    import transformers
    from transformers import Mamba2Config, Mamba2ForCausalLM

    transformers.logging.set_verbosity_error()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = Mamba2ForCausalLM(Mamba2Config(vocab_size=1024, hidden_size=256, num_hidden_layers=4, state_size=64,
                                            expand=2, head_dim=64, num_heads=8, n_groups=1, chunk_size=64)).eval()
    hf.save_pretrained(str(tmp / "hf"))
    return hf, load_model(tmp / "hf", backend="chunked")


def table_a(turns: int, tmp: Path) -> list[str]:
    hf, ours = _hf_pair(tmp)
    g = torch.Generator().manual_seed(1)
    turn_tokens = [torch.randint(0, 1024, (int(torch.randint(24, 56, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(turns)]
    rows = ["## (a) Agent conversation: new tokens only vs re-feeding the history (HF transformers)", "",
            "same weights (Mamba-2, d_model 256, 4 layers), CPU; peak RSS growth during the turn", "",
            "| turn | new tokens | history tokens | ours ms | ours peak MB | HF re-prefill ms | HF peak MB "
            "| HF / ours |",
            "|---|---|---|---|---|---|---|---|"]
    state, history, ours_ms, hf_ms = ours.initial_state(), [], [], []
    with torch.inference_mode():
        for i, toks in enumerate(turn_tokens, start=1):
            history += toks
            with PeakRSS() as m1:
                t = time.perf_counter()
                state = ours.advance(state, toks).state
                a = time.perf_counter() - t
            with PeakRSS() as m2:
                t = time.perf_counter()
                hf(torch.tensor([history]), use_cache=False)
                b = time.perf_counter() - t
            ours_ms.append(a * 1e3)
            hf_ms.append(b * 1e3)
            if i in (1, 2, 5, 10, 20, 30, 40, 50) or i == turns:
                rows.append(f"| {i} | {len(toks)} | {len(history)} | {a * 1e3:.1f} | {m1.growth_mb:.1f} | "
                            f"{b * 1e3:.1f} | {m2.growth_mb:.1f} | {b / a:.1f}x |")
    k = max(1, turns // 5)
    sizes = [len(t) for t in turn_tokens]
    ours_us = [ms * 1e3 / n for ms, n in zip(ours_ms, sizes, strict=True)]
    hist = [sum(sizes[:i + 1]) for i in range(turns)]
    rows.append("")
    rows.append(f"first {k} turns vs last {k} (medians): ours {statistics.median(ours_ms[:k]):.1f} -> "
                f"{statistics.median(ours_ms[-k:]):.1f} ms per turn, {statistics.median(ours_us[:k]):.0f} -> "
                f"{statistics.median(ours_us[-k:]):.0f} us per new token; HF {statistics.median(hf_ms[:k]):.1f} -> "
                f"{statistics.median(hf_ms[-k:]):.1f} ms per turn")
    if turns >= 3:
        rows.append(f"least-squares slope against history length: ours {_slope(hist, ours_ms) * 1e3:+.2f} ms, "
                    f"HF {_slope(hist, hf_ms) * 1e3:+.2f} ms per 1,000 history tokens")
    return rows


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / sum((x - mx) ** 2 for x in xs)


def _bench_model(tmp: Path) -> Path:
    """The served model of table (b): Mamba-2, d_model 256, 4 layers, d_state 64, headdim 64."""
    from mamba_stream.scan import ModelConfig, init_model, save_checkpoint

    path = tmp / "bench-mamba2"
    if not path.exists():
        cfg = ModelConfig.create(architecture="mamba2", d_model=256, n_layer=4, vocab_size=256, d_state=64, headdim=64)
        save_checkpoint(init_model(cfg, seed=0), path)
    return path


async def _throughput(levels: list[int], steps: int, gen_tokens: int, tmp: Path, backend: str = "exact") -> list[str]:
    from temporalio.client import Client
    from temporalio.worker import Worker

    from mamba_stream.activities import StreamActivities, open_store
    from mamba_stream.activities._registry import ModelRegistry
    from mamba_stream.plugin import MambaStreamPlugin
    from mamba_stream.state_codec.codec import Keyring
    from mamba_stream.worker import start_dev_server
    from mamba_stream.workflows import StreamClient, StreamOptions

    env = await start_dev_server()
    ring = Keyring.generate()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    _bench_model(tmp)
    acts = StreamActivities(models=ModelRegistry({"tiny-mamba2": str(tmp / "bench-mamba2")}, backend=backend),
                            store=open_store(f"file://{tmp / 'states'}"), keyring=ring, worker_queue=f"{queue}@w")
    client = await Client.connect(env.client.service_client.config.target_host,
                                  plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    pool = concurrent.futures.ThreadPoolExecutor(256)
    rows = ["## (b) Throughput through Temporal, by concurrent streams", "",
            f"Mamba-2 d_model 256, 4 layers, `{backend}` backend; one worker (256 activity threads) and the dev "
            f"server, all on {os.cpu_count()} CPU cores. "
            f"Chunks: 1-token `advance` updates, {steps} per stream. Decode: `generate` updates of {gen_tokens} "
            "tokens, 4 per stream; the engine batches the streams' sampling steps. Occupancy: streams per batched "
            "step. Both run as local activities (the stream options' defaults).", "",
            "| streams | chunks/s | chunk p50 ms | chunk p99 ms | decode tokens/s | x single stream | "
            "generate p50 ms | generate p99 ms | batch occupancy |", "|---|---|---|---|---|---|---|---|---|"]
    opts = StreamOptions()  # the defaults: chunks this short run as local activities (docs/deploying.md)
    async with Worker(client, task_queue=queue, activity_executor=pool, max_concurrent_activities=256), \
            Worker(client, task_queue=f"{queue}@w", activity_executor=pool):
        streams = StreamClient(client, queue)
        base = None
        for n in levels:
            sids = await asyncio.gather(*(streams.open("bench", "tiny-mamba2", options=opts) for _ in range(n)))
            await asyncio.gather(*(streams.advance(s, "bench", tokens=[1, 2, 3]) for s in sids))
            eng = acts.engines["tiny-mamba2"]
            chunk_lat: list[float] = []
            gen_lat: list[float] = []

            async def chunks(sid: str) -> None:
                for i in range(steps):
                    t = time.perf_counter()
                    await streams.advance(sid, "bench", tokens=[i % 256], chunk_seq=i + 2)
                    chunk_lat.append(time.perf_counter() - t)  # noqa: B023 - gathered below, within this iteration

            async def decode(sid: str) -> None:
                for i in range(4):
                    t = time.perf_counter()
                    await streams.generate(sid, "bench", gen_tokens, seed=i, chunk_seq=steps + 2 + i)
                    gen_lat.append(time.perf_counter() - t)  # noqa: B023 - gathered below, within this iteration

            t0 = time.perf_counter()
            await asyncio.gather(*(chunks(s) for s in sids))
            chunk_rate = n * steps / (time.perf_counter() - t0)
            before = (eng.stats.steps, eng.stats.stepped_streams)
            t0 = time.perf_counter()
            await asyncio.gather(*(decode(s) for s in sids))
            tok_rate = n * 4 * gen_tokens / (time.perf_counter() - t0)
            base = base or tok_rate
            batches = eng.stats.steps - before[0]
            occupancy = (eng.stats.stepped_streams - before[1]) / batches if batches else 0.0
            chunk_lat.sort()
            gen_lat.sort()
            p99 = lambda xs: xs[int(0.99 * (len(xs) - 1))] * 1e3  # noqa: E731
            rows.append(f"| {n} | {chunk_rate:,.1f} | {statistics.median(chunk_lat) * 1e3:.1f} | "
                        f"{p99(chunk_lat):.1f} | {tok_rate:,.0f} | {tok_rate / base:.1f}x | "
                        f"{statistics.median(gen_lat) * 1e3:.1f} | "
                        f"{p99(gen_lat):.1f} | {occupancy:.1f} |")
            await asyncio.gather(*(streams.cancel(s) for s in sids))
    acts.close()
    await env.shutdown()
    return rows


def table_b_engine(levels: list[int], gen_tokens: int, tmp: Path,
                   backends: tuple[str, ...] = ("exact", "chunked")) -> list[str]:
    """The same decode load on the engine alone (no Temporal): what batching buys before the RPCs,
    on each backend side by side, with the streams' sampling batched by the engine (a
    `SeededSampler`) and, beside it, one callback per row (what activities/_chunk.py passes today)."""
    _bench_model(tmp)
    rows = ["### (b, beside it) the engine alone: the same model and decode load, one thread per stream", "",
            "sampling: `batched` = a SeededSampler per stream, sampled with the batch (`sample_rows`); `per row` = "
            "a callable per stream (the per-row path, `activities._engine._sample_one`), called once per row. "
            "Same tokens either way.", "",
            "| backend | sampling | streams | decode tokens/s | x single stream | round ms "
            "| of which batched step ms | streams per step |", "|---|---|---|---|---|---|---|---|"]
    for backend in backends:
        for batched in (True, False):
            rows += _engine_rows(levels, gen_tokens, tmp, backend, batched)
    return rows


def _engine_rows(levels: list[int], gen_tokens: int, tmp: Path, backend: str, batched: bool) -> list[str]:
    from mamba_stream.activities import StreamEngine
    from mamba_stream.activities._engine import SeededSampler
    from mamba_stream.activities._engine import _sample_one as _sample

    model = load_model(tmp / "bench-mamba2", backend=backend)
    engine = StreamEngine(model)
    first = model.advance(model.initial_state(), [1, 2, 3])
    rows: list[str] = []
    base = None
    for n in levels:
        sids = [f"e{n}-{i}" for i in range(n)]
        for sid in sids:
            engine.put(sid, first.state, epoch=0, state_key="k0", logits=first.logits[-1])

        def run(sid: str) -> None:
            gen = torch.Generator().manual_seed(0)
            sampler = SeededSampler(1.0, 0, gen) if batched else (lambda lg: _sample(lg, 1.0, 0, gen))
            for _ in range(4):
                engine.generate(sid, sampler, gen_tokens, expected_key="k0", epoch=0,
                                load=lambda: (first.state, first.logits[-1]))
                engine.mark_committed(sid, "k0")

        steps0, streams0, step_s0 = engine.stats.steps, engine.stats.stepped_streams, engine.stats.step_seconds
        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(sid,)) for sid in sids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        steps = engine.stats.steps - steps0
        rate = n * 4 * gen_tokens / wall
        base = base or rate
        step_ms = (engine.stats.step_seconds - step_s0) / steps * 1e3
        rows.append(f"| {backend} | {'batched' if batched else 'per row'} | {n} | {rate:,.0f} | {rate / base:.1f}x | "
                    f"{wall / steps * 1e3:.2f} | {step_ms:.2f} | "
                    f"{(engine.stats.stepped_streams - streams0) / steps:.1f} |")
        for sid in sids:
            engine.release(sid)
    engine.close()
    return rows


def table_c(positions: int) -> list[str]:
    model = load_model("tiny-mamba2", backend="chunked")
    cfg = model.config
    rows = ["## (c) Memory against position: one stream", "",
            f"tiny-mamba2 (d_model {cfg.d_model}, {cfg.n_layer} layers), chunks of 4,096 tokens; KV cache of a "
            f"same-width attention model: 2 (K, V) x layers x positions x d_model x 4 bytes", "",
            "| position | state bytes | RSS MB | RSS vs first chunk | peak RSS MB | peak vs first chunk | "
            "attention KV cache MB |", "|---|---|---|---|---|---|---|"]
    # The first row is one full chunk in: RSS is taken against it, after the allocator has grown to a
    # chunk's working set, so the column shows growth with position rather than first-touch workspace.
    marks = sorted({m for m in (4_096, 10_000, 100_000, 250_000, 500_000, 1_000_000, positions) if m <= positions})
    g = torch.Generator().manual_seed(2)
    state, pos, first, first_peak = model.initial_state(), 0, None, None
    chunk = torch.randint(0, 256, (4096,), generator=g).tolist()
    with torch.inference_mode():
        for mark in marks:
            while pos < mark:  # whole chunks only: a row is at the first chunk boundary past its mark
                state = model.advance(state, chunk).state
                pos += len(chunk)
            rss, peak = rss_bytes() / 1e6, rss_bytes("VmHWM") / 1e6
            first, first_peak = first or rss, first_peak or peak
            kv = 2 * cfg.n_layer * pos * cfg.d_model * 4 / 1e6
            rows.append(f"| {pos:,} | {state.nbytes:,} | {rss:.1f} | {(rss / first - 1) * 100:+.1f}% | {peak:.1f} | "
                        f"{(peak / first_peak - 1) * 100:+.1f}% | {kv:,.1f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--levels", default="1,8,32,128")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--positions", type=int, default=1_000_000)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--skip", default="", help="tables to skip: a, b, c; or b-temporal / b-engine, one half of (b)")
    ap.add_argument("--engine-backends", default="exact,chunked", help="backends of (b)'s engine-alone table")
    ap.add_argument("--temporal-backend", default="exact", help="backend of (b)'s through-Temporal table")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    from mamba_stream.activities import tune_allocator

    # The worker's allocator settings (mamba_stream/activities/_alloc.py), for every table and both sides of (a).
    tuned = tune_allocator()
    out: list[str] = [f"allocator: {tuned or 'glibc defaults'}", ""]
    with tempfile.TemporaryDirectory() as tmp:
        if "a" not in skip:
            out += [*table_a(args.turns, Path(tmp)), ""]
        if "b" not in skip:
            levels = [int(x) for x in args.levels.split(",")]
            if "b-temporal" not in skip:
                out += [*asyncio.run(_throughput(levels, args.steps, args.gen_tokens, Path(tmp),
                                                 args.temporal_backend)), ""]
            if "b-engine" not in skip:
                backends = tuple(args.engine_backends.split(","))
                out += [*table_b_engine(levels, args.gen_tokens, Path(tmp), backends), ""]
        if "c" not in skip:
            if skip >= {"a", "b"}:
                out += table_c(args.positions)
            else:  # a process of its own, so the RSS column does not carry the other tables' heap
                import subprocess

                child = subprocess.run([sys.executable, __file__, "--skip", "a,b", "--positions", str(args.positions)],
                                       capture_output=True, text=True, check=True)
                out += child.stdout.splitlines()[2:]  # without the child's allocator line
    print("\n".join(out))


if __name__ == "__main__":
    main()
