"""One tenant floods, the others keep chatting: the quiet tenants' chunk latency, alone and during
the flood, and the flood's throughput, by fairness policy. Issue 50's scenario, measured side by
side in one run on one machine.

Each quiet tenant (bob; with `--tenants 4` also carol and dave) feeds its stream a 16-byte chunk
every 0.5 s. Alice opens `--streams` streams at once and feeds each `--chunks` chunks of 200 bytes.
One worker process (`python worker.py`, tiny-mamba2, the defaults) serves them against a Temporal
dev server started here; the clients run in this process.

Policies (a fresh dev server and worker each):
    off        the server without fairness (`matching.enableFairness=false`), the worker first come
               first served (MAMBA_STREAM_FAIRNESS=off)
    temporal   the server's fairness keys (the streams' principal tags) only
    full       the server's fairness and the worker's own (per-principal round robin of chunks
               admitted and of engine rows)
    embedded-temporal
               the embedded stack (the worker starts its own server: `python worker.py` without
               TEMPORAL_ADDRESS, as `make run` does; fairness keys on there, as always) with the
               worker's own fairness off: the embedded stack's unfair baseline
    embedded   `full` on the embedded stack

The flood's chunks/s is given against the first policy of its stack that ran: `off` for the
external server's, `embedded-temporal` for the embedded one's (the external `off` where that did
not run): the embedded server keeps its history in SQLite on disk, another cost than the external
one's memory.

    python bench/bench_fairness.py [--streams 300] [--chunks 4] [--tenants 1,4]
                                   [--policies off,temporal,full,embedded-temporal,embedded]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench_fairness")

QUIET = ("bob", "carol", "dave")
POLICIES = ("off", "temporal", "full", "embedded-temporal", "embedded")
CADENCE_S = 0.5
QUIET_BYTES = 16
FLOOD_BYTES = 200


@dataclass
class Run:
    quiet_alone: list[float] = field(default_factory=list)
    quiet_flood: list[float] = field(default_factory=list)
    quiet_opening: list[float] = field(default_factory=list)  # sent while the flood's streams were opening
    quiet_feeding: list[float] = field(default_factory=list)  # sent after they were all open
    flood_chunks: int = 0
    flood_s: float = 0.0
    rss_mb: float = 0.0
    where: dict[str, float] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text(n: int, i: int) -> str:
    base = f"chunk {i} of a tenant's conversation, plain bytes. "
    return (base * (n // len(base) + 1))[:n]


def _worker_env(home: Path, queue: str, policy: str, address: str | None, ports: dict[str, int]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"MAMBA_STREAM_HOME": str(home), "MAMBA_STREAM_MODELS": "tiny-mamba2",
                "MAMBA_STREAM_TASK_QUEUE": queue, "MAMBA_STREAM_METRICS": "off",
                "MAMBA_STREAM_FAIRNESS": "off" if policy in ("off", "temporal", "embedded-temporal") else "on",
                "MAMBA_STREAM_TEMPORAL_PORT": str(ports["temporal"]), "MAMBA_STREAM_UI_PORT": str(ports["ui"]),
                "MAMBA_STREAM_CODEC_PORT": str(ports["codec"])})
    env.pop("TEMPORAL_ADDRESS", None)
    if address is not None:
        env["TEMPORAL_ADDRESS"] = address
    return env


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def _quiet(streams, principal: str, stop: asyncio.Event, out: list[tuple[float, float]], sid: str,
                 seq: list[int]) -> None:
    """Feed `sid` a QUIET_BYTES chunk every CADENCE_S until `stop`; (sent at, latency) into `out`."""
    nxt = time.perf_counter()
    while not stop.is_set():
        seq[0] += 1
        sent, t = time.time(), time.perf_counter()
        await streams.advance(sid, principal, text=_text(QUIET_BYTES, seq[0]), chunk_seq=seq[0])
        out.append((sent, time.perf_counter() - t))
        nxt += CADENCE_S
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, nxt - time.perf_counter()))


async def _scenario(policy: str, tenants: int, n_streams: int, n_chunks: int, alone_s: float) -> Run:
    from temporalio.client import Client

    from mamba_stream.devserver import DEV_SERVER_DYNAMIC_CONFIG, start_dev_server
    from mamba_stream.plugin import MambaStreamPlugin
    from mamba_stream.state_codec.keyring import Keyring
    from mamba_stream.workflows import StreamClient

    run = Run()
    ports = {"temporal": _free_port(), "ui": _free_port(), "codec": _free_port()}
    queue = f"fair-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-fair-") as tmp:
        home = Path(tmp) / "home"
        env_server = None
        if policy.startswith("embedded"):
            address = f"127.0.0.1:{ports['temporal']}"
            worker_address = None
        else:
            config = dict(DEV_SERVER_DYNAMIC_CONFIG)
            config["matching.enableFairness"] = policy != "off"
            env_server = await start_dev_server(config)
            address = worker_address = env_server.client.service_client.config.target_host
        with open(Path(tmp) / "worker.log", "w") as errors:
            proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], cwd=tmp,
                                    env=_worker_env(home, queue, policy, worker_address, ports),
                                    stdout=subprocess.DEVNULL, stderr=errors)
        try:
            ring_path = home / "keyring.json"
            deadline = time.monotonic() + 120
            while not ring_path.exists() and proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            if not ring_path.exists():
                raise RuntimeError(f"the worker did not start: {(Path(tmp) / 'worker.log').read_text()[-2000:]}")
            ring = Keyring.from_file(ring_path)
            client = None
            while client is None and time.monotonic() < deadline:
                try:
                    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring)])
                except RuntimeError:
                    await asyncio.sleep(0.5)
            if client is None:
                raise RuntimeError(f"cannot connect to the Temporal server at {address}: "
                                   f"{(Path(tmp) / 'worker.log').read_text()[-2000:]}")
            streams = StreamClient(client, queue)
            quiet = QUIET[: tenants - 1] if tenants > 1 else QUIET[:1]
            sids = {p: await streams.open(p, "tiny-mamba2", worker_timeout_s=120) for p in quiet}
            seqs = {p: [0] for p in quiet}
            # alone: the quiet tenants only
            stop = asyncio.Event()
            alone: list[tuple[float, float]] = []
            tasks = [asyncio.create_task(_quiet(streams, p, stop, alone, sids[p], seqs[p])) for p in quiet]
            await asyncio.sleep(alone_s)
            stop.set()
            await asyncio.gather(*tasks)
            run.quiet_alone = [lat for _, lat in alone[2 * len(quiet):]]  # the first chunks warm the path

            # the flood, the quiet tenants going on beside it
            stop = asyncio.Event()
            during: list[tuple[float, float]] = []
            tasks = [asyncio.create_task(_quiet(streams, p, stop, during, sids[p], seqs[p])) for p in quiet]

            t_flood = time.time()
            peak = 0.0

            async def watch() -> None:
                nonlocal peak
                while not stop.is_set():
                    peak = max(peak, _rss_mb(proc.pid))
                    await asyncio.sleep(0.5)

            watcher = asyncio.create_task(watch())
            # the flooding tenant is a client process of its own, as it would be: its coroutines do
            # not share the quiet tenants' event loop
            flood = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--flood", address, queue, str(ring_path), str(n_streams), str(n_chunks),
                stdout=asyncio.subprocess.PIPE)
            out, _ = await flood.communicate()
            if flood.returncode != 0:
                raise RuntimeError(f"the flood failed (status {flood.returncode})")
            opened_at, run.flood_s = (float(x) for x in out.decode().split()[-2:])
            stop.set()
            await asyncio.gather(*tasks, watcher)
            run.quiet_flood = [lat for _, lat in during]
            run.quiet_opening = [lat for sent, lat in during if sent < opened_at]
            run.quiet_feeding = [lat for sent, lat in during if sent >= opened_at]
            run.flood_chunks = n_streams * n_chunks
            run.rss_mb = peak
            run.where = await _where(client, sids[quiet[0]], t_flood)
        except BaseException:
            print((Path(tmp) / "worker.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if env_server is not None:
                await env_server.shutdown()
    return run


async def _where(client, sid: str, since: float) -> dict[str, float]:
    """Where a quiet tenant's chunks waited during the flood, from its workflow's history: ms from
    a workflow task scheduled to started (the server's queue and the worker's polling) and from
    started to completed (the worker: the workflow code, the local chunk activity, its wait in the
    worker's local-activity slots and in the engine), at the median and p95."""
    from temporalio.api.enums.v1 import EventType

    queued: list[float] = []
    ran: list[float] = []
    sched = started = None
    async for ev in client.get_workflow_handle(sid).fetch_history_events():
        t = ev.event_time.ToDatetime().timestamp()
        if ev.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            sched = t
        elif ev.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and sched is not None:
            started = t
            if t >= since:
                queued.append(t - sched)
        elif ev.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and started is not None:
            if t >= since:
                ran.append(t - started)
            sched = started = None
    return {"queued": _p(queued, 0.5), "ran": _p(ran, 0.5), "queued95": _p(queued, 0.95), "ran95": _p(ran, 0.95)}


async def _flood(address: str, queue: str, ring_path: str, n_streams: int, n_chunks: int) -> float:
    """Alice's flood, in a process of its own: `n_streams` opened at once, each fed `n_chunks`
    chunks of FLOOD_BYTES. Returns when the last stream was open (epoch seconds) and the seconds
    the whole flood took."""
    from temporalio.client import Client

    from mamba_stream.plugin import MambaStreamPlugin
    from mamba_stream.state_codec.keyring import Keyring
    from mamba_stream.workflows import StreamClient

    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=Keyring.from_file(ring_path))])
    streams = StreamClient(client, queue)

    opened: list[float] = []

    async def one(i: int) -> None:
        sid = await streams.open("alice", "tiny-mamba2", worker_timeout_s=300)
        opened.append(time.time())
        for c in range(n_chunks):
            await streams.advance(sid, "alice", text=_text(FLOOD_BYTES, i * n_chunks + c), chunk_seq=c + 1)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n_streams)))
    return max(opened), time.perf_counter() - t0


def _p(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` (seconds) in ms, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] * 1e3 if s else float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=300, help="streams the flooding tenant opens at once")
    ap.add_argument("--chunks", type=int, default=4, help="200-byte chunks per flooding stream")
    ap.add_argument("--tenants", default="1,4", help="tenants beside the flood: 1 (bob) and/or 4 (bob, carol, dave)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--alone-s", type=float, default=8.0, help="seconds the quiet tenants run alone first")
    args = ap.parse_args(argv)
    if args.streams < 1 or args.chunks < 1 or args.alone_s <= 0:
        ap.error("--streams and --chunks must be 1 or more, --alone-s above 0")
    for p in args.policies.split(","):
        if p not in POLICIES:
            ap.error(f"--policies: {p!r} is not one of {', '.join(POLICIES)}")
    return args


def _ms(xs: list[float], q: float) -> str:
    return f"{_p(xs, q):.0f}" if xs else "-"


def run(args: argparse.Namespace) -> str:
    rows = ["## Fair tenants: a quiet tenant's chunks while another floods", "",
            f"One worker (`python worker.py`, tiny-mamba2) and a Temporal dev server on {os.cpu_count()} CPU cores; "
            f"quiet tenants feed a {QUIET_BYTES}-byte chunk every {CADENCE_S} s; the flood (a client process of its "
            f"own): {args.streams} streams opened at once, {args.chunks} chunks of {FLOOD_BYTES} bytes each. "
            "Latency: a quiet chunk's update, sent to answered, at its client: alone, during the whole flood, while "
            "the flood's streams were opening, and after (their chunks). Where: the quiet stream's workflow tasks "
            "during the flood, ms from scheduled to started (the server's queue and the worker's polling) and "
            "started to completed (the worker), median and p95. Flood chunks/s: against the first policy run on "
            "the same stack (the external server's, or the embedded one's).", "",
            "| tenants | policy | alone p50 / p95 ms | flood p50 / p95 ms | x alone p50 / p95 | opening p50 / p95 ms "
            "| feeding p50 / p95 ms | task queued / ran ms | flood chunks/s | flood s | worker peak RSS MB |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for tenants in [int(t) for t in args.tenants.split(",")]:
        rates: dict[str, float] = {}
        external: float | None = None  # the first external policy's rate
        for policy in args.policies.split(","):
            r = asyncio.run(_scenario(policy, tenants, args.streams, args.chunks, args.alone_s))
            rate = rates[policy] = r.flood_chunks / r.flood_s
            if policy.startswith("embedded"):
                base_rate = rates.get("embedded-temporal") or external or rate
            else:
                external = base_rate = external or rate
            a50, a95 = _p(r.quiet_alone, 0.5), _p(r.quiet_alone, 0.95)
            f50, f95 = _p(r.quiet_flood, 0.5), _p(r.quiet_flood, 0.95)
            rows.append(f"| {tenants} | {policy} | {a50:.0f} / {a95:.0f} | {f50:.0f} / {f95:.0f} | "
                        f"{f50 / a50:.1f}x / {f95 / a95:.1f}x | {_ms(r.quiet_opening, 0.5)} / "
                        f"{_ms(r.quiet_opening, 0.95)} | {_ms(r.quiet_feeding, 0.5)} / {_ms(r.quiet_feeding, 0.95)} | "
                        f"{r.where['queued']:.0f} / {r.where['ran']:.0f}, p95 {r.where['queued95']:.0f} / "
                        f"{r.where['ran95']:.0f} | {rate:.1f} ({rate / base_rate:.2f}x) | "
                        f"{r.flood_s:.1f} | {r.rss_mb:.0f} |")
            log.info("%s", rows[-1])
    return "\n".join(rows)


def main() -> None:
    if sys.argv[1:2] == ["--flood"]:  # the flooding tenant's process (`_scenario`)
        address, queue, ring, n, c = sys.argv[2:7]
        print(*asyncio.run(_flood(address, queue, ring, int(n), int(c))), flush=True)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("temporalio", "mamba_stream"):
        logging.getLogger(name).setLevel(logging.WARNING)
    print(run(parse_args()))


if __name__ == "__main__":
    main()
