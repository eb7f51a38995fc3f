"""One model's whole stream lifecycle through Temporal, timed: for the big shapes (a 7B model in
bfloat16 or q8 on a 24 GB machine) what serving it costs, not only decoding it.

A real dev server, one worker with MambaStreamPlugin in this process serving the checkpoint in the
given format on the exact backend; then open, a prefill chunk, a few decode chunks and a generate,
a checkpoint, a resume from that receipt into a second stream (its next chunk must give the first
stream's bits: the same checksum after the same tokens), and cancel of both. Prints each step's
time and the process's RSS after it (and its peak so far), the receipts' arithmetic and the peak RSS
beside the weight file.

    python bench/serve_model.py /tmp/mamba-stream-bench/7b-mamba2-bfloat16 [--weights bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from temporalio.client import Client
from temporalio.worker import Worker

from mamba_stream.activities import ModelRegistry, StreamActivities, open_store
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.worker import start_dev_server
from mamba_stream.workflows import StreamClient, StreamOptions

#: a big model's chunk takes seconds: no local attempt, timeouts to match
OPTIONS = StreamOptions(local_chunks=False, activity_timeout_s=1800.0, heartbeat_timeout_s=120.0)


async def serve(ckpt: Path, weights: str | None, prefill: int, decode: int) -> list[str]:
    out: list[str] = []

    def step(label: str, t0: float, extra: str = "") -> None:
        # the memory after the step and the peak so far: where a peak above the weights comes from
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 1e9
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        line = f"{label:<34} {time.perf_counter() - t0:>8.1f} s  RSS {rss:5.2f} GB, peak {peak:5.2f} GB  {extra}"
        out.append(line)
        print(line, flush=True)

    env = await start_dev_server()
    ring = Keyring.generate()
    queue = f"serve-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        source = f"{ckpt}#{weights}" if weights else str(ckpt)
        acts = StreamActivities(models=ModelRegistry({"big": source}, backend="exact"),
                                store=open_store(f"file://{tmp}/states"), keyring=ring, worker_queue=f"{queue}@w")
        client = await Client.connect(env.client.service_client.config.target_host,
                                      plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
        pool = concurrent.futures.ThreadPoolExecutor(8)
        try:
            t = time.perf_counter()
            model = acts.models.get("big")
            step("load (first use)", t, f"{model.weight_format}, {model.arithmetic().id}")
            async with Worker(client, task_queue=queue, activity_executor=pool), \
                    Worker(client, task_queue=f"{queue}@w", activity_executor=pool):
                streams = StreamClient(client, queue)
                t = time.perf_counter()
                sid = await streams.open("bench", "big", options=OPTIONS)
                step("open", t)
                t = time.perf_counter()
                await streams.advance(sid, "bench", tokens=[(7 * i) % 256 for i in range(prefill)])
                step(f"advance ({prefill}-token prefill)", t, f"{prefill / (time.perf_counter() - t):.1f} tok/s")
                for i in range(decode):
                    t = time.perf_counter()
                    await streams.advance(sid, "bench", tokens=[i + 1])
                    step(f"advance (1 token, #{i + 1})", t)
                t = time.perf_counter()
                gen = await streams.generate(sid, "bench", decode, temperature=0.0)
                step(f"generate ({decode} tokens)", t, f"{decode / (time.perf_counter() - t):.2f} tok/s")
                t = time.perf_counter()
                cp = await streams.checkpoint(sid, "bench")
                step("checkpoint", t, f"position {cp.receipt.position}, {cp.receipt.state_bytes:,} state bytes")
                t = time.perf_counter()
                resumed = await streams.open("bench", "big", options=OPTIONS, resume=cp.receipt)
                step("resume from the receipt", t)
                tail = [5, 6, 7]
                a = await streams.advance(sid, "bench", tokens=tail)
                b = await streams.advance(resumed, "bench", tokens=tail)
                same = a.receipt.checksum == b.receipt.checksum and a.output_digest == b.output_digest
                out.append(f"resumed stream continues with the original's bits: {same}")
                print(out[-1], flush=True)
                if not same:
                    raise SystemExit("the resumed stream gave other bits")
                t = time.perf_counter()
                await streams.cancel(sid, "bench")
                await streams.cancel(resumed, "bench")
                step("cancel both", t)
                out.append(f"generated {gen.tokens}; arithmetic {a.receipt.arithmetic.id}")
        finally:
            acts.close()
            await env.shutdown()
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9
    out.append(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB; weight file {size:.2f} GB")
    print(out[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--weights", default=None, help="the format to serve it in (default: as stored)")
    ap.add_argument("--prefill", type=int, default=32)
    ap.add_argument("--decode", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(serve(args.checkpoint, args.weights, args.prefill, args.decode))


if __name__ == "__main__":
    main()
