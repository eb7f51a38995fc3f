"""Prefix states: many agents opening with the same long prefix, with and without the prefix store.

N agents (default 32) of one principal open streams of a 130M-shaped model (bench/make_checkpoint.py's
`130m-mamba2`, random weights) with the same P-token prefix (default 2,048 random token ids) and
generate G tokens each (default 16, greedy, streamed). Two modes, side by side in one run, on one
dev server, each with its own worker (MambaStreamPlugin in-process, the production worker's slots)
and its own store: prefix states on (`StreamActivities` defaults: the first open of the prefix
computes it and stores it sealed, later opens load it) and off (`prefix_bytes=0`: every open
computes its prefix).

In each mode: agent 1 opens alone (with the store on it computes the prefix), then agents 2..N
open at once; after them, `--solo` more agents open one at a time (no contention: the latency of
one agent). Time to first token (TTFT) per agent: from calling `StreamClient.open(prefix=...)` to
the first generated token seen by `generate_stream`. CPU seconds: this process (worker and
clients, every thread) and the dev server, over agents 1..N. Prefill tokens: tokens run through
the served model's `advance` (the open path's prefill; nothing else calls it here), beside the
library's own `prefix_tokens{how=computed}` counter.

References, measured in the same run: a no-op update round trip (bench/_noop_workflow.py) and one
decode step (raw `model.advance` of 1 token on the served model). Targets (the issue): agents
2..N each reach their first token within 3x the no-op round trip plus one decode step; total
prefill work 1x the prefix instead of N x.

On a 2-core VM the default run takes about 3.5 minutes, most of it the "off" side's 32 prefills of
2,048 tokens (docs/results/prefix-states-cpu-2026-12-04.md). The CPU table includes a column for
every other process's CPU seconds during each phase: on a shared machine, a run with other work in
it does not measure the same thing (loaded, the "off" side's opens exceed their heartbeat timeout
and retry: see the open attempts).

    python bench/prefix_states.py [--agents 32] [--prefix-tokens 2048] [--gen-tokens 16] [--solo 4]
        [--model 130m-mamba2 | tiny-mamba2] [--modes on,off]
        [--store postgresql://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _noop_workflow import NoopWorkflow
from _proc import machine_cpu, process_cpu, server_pid
from temporalio.client import Client
from temporalio.worker import Worker

from mamba_stream.activities import ModelRegistry, StreamActivities, open_store
from mamba_stream.plugin import MambaStreamPlugin, worker_slots
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.worker import start_dev_server
from mamba_stream.workflows import ACTIVITY_OPEN, StreamClient, StreamOptions

MODES = ("on", "off")
MODE_NAMES = {"on": "prefix states on", "off": "prefix states off (prefix_bytes=0)"}
#: the checkpoints bench/bench_sizes.py makes (the same directory, so `make bench` makes it once)
BENCH_DIR = Path(os.environ.get("MAMBA_STREAM_BENCH_DIR", "/tmp/mamba-stream-bench"))
PRINCIPAL = "bench-agents"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=32,
                    help="agents opening with the prefix (agent 1, then 2..N at once)")
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="tokens of the shared prefix")
    ap.add_argument("--gen-tokens", type=int, default=16, help="tokens each agent generates (streamed, greedy)")
    ap.add_argument("--solo", type=int, default=4, help="agents opened one at a time after the N (0: none)")
    ap.add_argument("--model", default="130m-mamba2",
                    help="130m-mamba2 (bench/make_checkpoint.py's shape, random weights, float32) or a preset name")
    ap.add_argument("--backend", default="exact",
                    help="scan backend of the served model (exact: the prefix store serves)")
    ap.add_argument("--store", default="", help="state store URL (default: a file store in a temporary directory; "
                    "postgresql://...: a table per mode)")
    ap.add_argument("--noop-n", type=int, default=30, help="no-op update round trips measured (after 5 warm-up)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps measured (after 2 warm-up)")
    ap.add_argument("--modes", default="on,off", help="modes to run, of on,off")
    ap.add_argument("--seed", type=int, default=1, help="seed of the prefix's token ids")
    args = ap.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.agents < 2 or args.prefix_tokens < 1 or args.gen_tokens < 1 or args.solo < 0:
        ap.error("--agents must be at least 2, --prefix-tokens and --gen-tokens positive, --solo not negative")
    if not args.modes or any(m not in MODES for m in args.modes):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODES)}")
    return args


class Tally:
    """A metric counter that also keeps its sums by attributes (the library's own counts, read back)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.sums, self._lock = inner, Counter(), threading.Lock()

    def add(self, value: int, additional_attributes: dict | None = None) -> None:
        with self._lock:
            self.sums[tuple(sorted((additional_attributes or {}).items()))] += value
        self.inner.add(value, additional_attributes)

    def total(self, **match: str) -> int:
        with self._lock:
            return sum(v for k, v in self.sums.items() if all((a, match[a]) in k for a in match))


class AdvanceCount:
    """Tokens run through one model's `advance` (wraps the instance's method; thread-safe)."""

    def __init__(self, model: Any) -> None:
        self.tokens, self.calls, self._lock, inner = 0, 0, threading.Lock(), model.advance

        def advance(state, tokens, *a, **kw):
            with self._lock:
                self.tokens += len(tokens)
                self.calls += 1
            return inner(state, tokens, *a, **kw)

        model.advance = advance


@dataclass
class Agent:
    """One agent's open + streamed generate (seconds from the call to open)."""

    sid: str = ""
    opened: float = 0.0
    first: float = float("nan")
    first_after: float = float("nan")  # from the generate call to its first token
    done: float = 0.0
    tokens: list[int] = field(default_factory=list)
    stored: int = -1  # the receipt's origin.stored_tokens
    scope: str = ""
    attempts: int = 0  # attempts of its open activity (from the stream's history)
    cpu: float = float("nan")  # CPU seconds of this process while it ran (agents one at a time only)


@dataclass
class Mode:
    agent1: Agent
    wave: list[Agent]
    solo: list[Agent]
    plain: list[Agent]  # plain opens (no prefix), one at a time: the open path's own floor
    wall: float  # agents 1..N
    cpu_self: float
    cpu_server: float
    cpu_others: float  # other processes of the machine meanwhile (a shared box)
    advance_tokens: int
    advance_calls: int
    computed: int  # prefix_tokens{how=computed}
    stored: int  # prefix_tokens{how=stored}
    hits: int
    misses: int
    solo_advance_tokens: int
    checkpoints: int  # streams' checkpoints written over agents 1..N (metric)
    checkpoint_bytes: int
    store_bytes: int
    entries: int
    scopes: int
    step: float  # one decode step, raw model.advance
    step_path: str


def served_model(args: argparse.Namespace) -> tuple[dict[str, str] | list[str], str, int]:
    """The registry's sources, a description of the model and its vocabulary size."""
    if args.model == "130m-mamba2":
        from bench.make_checkpoint import SHAPES, make

        path = make("130m-mamba2", "float32", BENCH_DIR / "130m-mamba2-float32")
        s = SHAPES["130m-mamba2"]
        return ({args.model: str(path)}, (f"130M-shaped Mamba-2 (d_model {s['hidden_size']}, {s['num_hidden_layers']} "
                f"layers, d_state {s['state_size']}, headdim {s['head_dim']}, vocab {s['vocab_size']}; "
                f"random weights, float32, bench/make_checkpoint.py)"), s["vocab_size"])
    from mamba_stream.scan import PRESETS

    if args.model not in PRESETS:
        raise SystemExit(f"--model: 130m-mamba2 or a preset ({', '.join(sorted(PRESETS))})")
    return [args.model], f"preset {args.model} (random weights)", PRESETS[args.model][0]["vocab_size"]


def _store_url(args: argparse.Namespace, tmp: Path, mode: str) -> str:
    if not args.store:
        return f"file://{tmp / f'states-{mode}'}"
    if args.store.startswith(("postgresql://", "postgres://")):
        sep = "&" if "?" in args.store else "?"
        return f"{args.store}{sep}table=bench_prefix_{mode}_{uuid.uuid4().hex[:8]}"
    return args.store.rstrip("/") + f"/{mode}-{uuid.uuid4().hex[:8]}"


async def _agent(streams: StreamClient, model_id: str, prefix: list[int] | None, gen: int,
                 opts: StreamOptions) -> Agent:
    """One agent: open with `prefix`, then a streamed generate. `prefix` None: the reference of a
    plain open (no prefix) and, after a 1-token chunk fed off the clock, the streamed generate;
    `first` is then the sum of the two timed parts."""
    a = Agent()
    t0 = time.perf_counter()
    a.sid = await streams.open(PRINCIPAL, model_id, prefix=prefix, options=opts)
    a.opened = time.perf_counter() - t0
    seq = 1
    if prefix is None:
        await streams.advance(a.sid, PRINCIPAL, tokens=[1], chunk_seq=1)
        seq, t0 = 2, time.perf_counter() - a.opened
    t1 = time.perf_counter()
    gs = streams.generate_stream(a.sid, PRINCIPAL, gen, temperature=0.0, chunk_seq=seq)
    async for ev in gs:
        if ev.tokens and a.first != a.first:  # nan: not yet
            now = time.perf_counter()
            a.first, a.first_after = now - t0, now - t1
    a.done = time.perf_counter() - t0
    a.tokens = list(gs.result.tokens)
    return a


async def _alone(streams: StreamClient, model_id: str, prefix: list[int] | None, gen: int,
                 opts: StreamOptions) -> Agent:
    """An agent on its own, with the CPU seconds this process spent while it ran."""
    c0 = process_cpu()
    a = await _agent(streams, model_id, prefix, gen, opts)
    a.cpu = process_cpu() - c0
    return a


async def _open_attempts(streams: StreamClient, sid: str) -> int:
    """Attempts of the stream's open activity: its started event's attempt (retries of an
    activity are not events of their own)."""
    names: dict[int, str] = {}
    async for ev in streams.handle(sid).fetch_history_events():
        if ev.HasField("activity_task_scheduled_event_attributes"):
            names[ev.event_id] = ev.activity_task_scheduled_event_attributes.activity_type.name
        elif ev.HasField("activity_task_started_event_attributes"):
            att = ev.activity_task_started_event_attributes
            if names.get(att.scheduled_event_id) == ACTIVITY_OPEN:
                return att.attempt
    return 0


async def _noop_rt(client: Client, n: int) -> list[float]:
    queue = f"bench-noop-{uuid.uuid4().hex[:8]}"
    out = []
    async with Worker(client, task_queue=queue, workflows=[NoopWorkflow]):
        h = await client.start_workflow(NoopWorkflow.run, id=f"noop-{queue}", task_queue=queue)
        for i in range(n + 5):
            t = time.perf_counter()
            await h.execute_update(NoopWorkflow.ping, i)
            if i >= 5:
                out.append(time.perf_counter() - t)
        await h.signal(NoopWorkflow.finish)
        await h.result()
    return out


async def _mode(mode: str, args: argparse.Namespace, env: Any, server: int | None, sources: Any, model_id: str,
                prefix: list[int], tmp: Path) -> Mode:
    ring = Keyring.generate()
    queue = f"bench-prefix-{mode}-{uuid.uuid4().hex[:8]}"
    kw = {} if mode == "on" else {"prefix_bytes": 0}
    store = open_store(_store_url(args, tmp, mode))
    acts = StreamActivities(models=ModelRegistry(sources, backend=args.backend), store=store, keyring=ring,
                            worker_queue=f"{queue}@w", **kw)
    m = acts.metrics
    for name in ("prefix_tokens", "prefix_hits", "prefix_misses", "checkpoints_written", "checkpoint_bytes"):
        setattr(m, name, Tally(getattr(m, name)))
    client = await Client.connect(env.client.service_client.config.target_host,
                                  plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    slots = [worker_slots(workflows=True), worker_slots(workflows=False)]
    opts = StreamOptions()
    try:
        async with Worker(client, task_queue=queue, **slots[0]), Worker(client, task_queue=f"{queue}@w", **slots[1]):
            streams = StreamClient(client, queue)
            # warm-up: the model loaded, the engine started, the paths run once (no prefix: nothing stored)
            sid = await streams.open(PRINCIPAL, model_id, options=opts)
            await streams.advance(sid, PRINCIPAL, tokens=prefix[:8], chunk_seq=1)
            await streams.generate(sid, PRINCIPAL, 2, temperature=0.0, chunk_seq=2)
            await streams.cancel(sid)
            model = acts.models.get(model_id)
            # one decode step, raw, on the served model
            st = model.advance(model.initial_state(), prefix[:16]).state
            steps, path = [], ""
            for i in range(args.steps + 2):
                t = time.perf_counter()
                r = model.advance(st, [prefix[i % len(prefix)]])
                steps.append(time.perf_counter() - t)
                st, path = r.state, r.path
            count = AdvanceCount(model)
            c0, s0, b0, t0 = process_cpu(), process_cpu(server) if server else 0.0, machine_cpu(), time.perf_counter()
            ck0, cb0 = m.checkpoints_written.total(), m.checkpoint_bytes.total()
            agent1 = await _agent(streams, model_id, prefix, args.gen_tokens, opts)
            wave = list(await asyncio.gather(*(_agent(streams, model_id, prefix, args.gen_tokens, opts)
                                               for _ in range(args.agents - 1))))
            wall = time.perf_counter() - t0
            cpu_self, cpu_server = process_cpu() - c0, (process_cpu(server) - s0) if server else float("nan")
            cpu_others = machine_cpu() - b0 - cpu_self - (cpu_server if server else 0.0)
            adv_tokens, adv_calls = count.tokens, count.calls
            computed, stored = m.prefix_tokens.total(how="computed"), m.prefix_tokens.total(how="stored")
            hits, misses = m.prefix_hits.total(), m.prefix_misses.total()
            ck, cb = m.checkpoints_written.total() - ck0, m.checkpoint_bytes.total() - cb0
            solo = [await _alone(streams, model_id, prefix, args.gen_tokens, opts) for _ in range(args.solo)]
            solo_tokens = count.tokens - adv_tokens
            plain = [await _alone(streams, model_id, None, args.gen_tokens, opts) for _ in range(args.solo)]
            for a in (agent1, *wave, *solo):
                origin = (await streams.receipt(a.sid)).origin
                a.stored, a.scope = (origin.stored_tokens, origin.scope) if origin is not None else (-1, "none")
                a.attempts = await _open_attempts(streams, a.sid)
            usage = acts.prefixes.usage()
            await asyncio.gather(*(streams.cancel(a.sid) for a in (agent1, *wave, *solo, *plain)))
    finally:
        acts.close()
        if hasattr(store, "drop"):  # a PostgreSQL table of this run's own
            store.drop()
        store.close()
    return Mode(agent1, wave, solo, plain, wall, cpu_self, cpu_server, cpu_others, adv_tokens, adv_calls, computed,
                stored, hits, misses, solo_tokens, ck, cb, usage.bytes, usage.entries, usage.scopes,
                statistics.median(steps[2:]), path)


async def _measure(args: argparse.Namespace, tmp: Path) -> tuple[list[float], dict[str, Mode], str, int]:
    sources, desc, vocab = served_model(args)
    model_id = args.model
    import torch

    g = torch.Generator().manual_seed(args.seed)
    prefix = torch.randint(0, vocab, (args.prefix_tokens,), generator=g).tolist()
    env = await start_dev_server()
    server = server_pid()
    try:
        noop = await _noop_rt(env.client, args.noop_n)
        modes = {mode: await _mode(mode, args, env, server, sources, model_id, prefix, tmp) for mode in args.modes}
    finally:
        await env.shutdown()
    return noop, modes, desc, vocab


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}" if x >= 0.1 else f"{x * 1e3:,.1f}"


def _med(xs: Any) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def run(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        t_all, load0 = time.perf_counter(), os.getloadavg()
        noop_xs, modes, desc, _ = asyncio.run(_measure(args, Path(tmp)))
        t_all, load1 = time.perf_counter() - t_all, os.getloadavg()
    noop = statistics.median(noop_xs)
    n, p, k = args.agents, args.prefix_tokens, args.solo
    store = "a file store" if not args.store else "store " + args.store.split("?")[0].split("@")[-1]
    lines = [(f"{n} agents of one principal open with the same {p:,}-token prefix and generate {args.gen_tokens} "
             f"tokens each (greedy, `generate_stream`); {desc}; `{args.backend}` backend; Temporal dev server and "
             f"one worker in-process (worker.worker_slots), {store}; {os.cpu_count()} CPUs. Agent 1 opens alone, "
             f"then agents 2..{n} at once. TTFT: from calling `open(prefix=...)` to the first generated token at "
             f"the caller. CPU, prefill and store bytes over agents 1..{n}. Both modes in one run "
             f"({t_all:,.0f} s in all; load average before {load0[0]:.1f}, after {load1[0]:.1f} (1 min), "
             f"{load1[2]:.1f} (15 min)). Times in ms."), ""]
    head = ["mode", "agent 1 TTFT", f"agents 2..{n} TTFT median", "max", "wall s", "CPU s: worker + clients",
            "CPU s: dev server", "CPU s: other processes", "prefill tokens computed", "x the prefix",
            "metric prefix_tokens computed / stored",
            "hits / misses", "open attempts", "streams' checkpoints (MB)", "prefix store bytes"]
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for mode, r in modes.items():
        w = [a.first for a in r.wave]
        lines.append("| " + " | ".join([
            MODE_NAMES[mode], _ms(r.agent1.first), _ms(statistics.median(w)), _ms(max(w)), f"{r.wall:.1f}",
            f"{r.cpu_self:.1f}", f"{r.cpu_server:.1f}", f"{max(r.cpu_others, 0.0):.1f}", f"{r.advance_tokens:,}",
            f"{r.advance_tokens / p:.2f}x",
            f"{r.computed:,} / {r.stored:,}", f"{r.hits} / {r.misses}",
            f"{sum(a.attempts for a in (r.agent1, *r.wave))}", f"{r.checkpoints} ({r.checkpoint_bytes / 1e6:,.1f})",
            f"{r.store_bytes:,} ({r.entries} {'entry' if r.entries == 1 else 'entries'})"]) + " |")
    if k:
        lines += ["", (f"Where the time goes (medians; agents one at a time, n={k} each, after the {n}; plain: an "
                  f"open without a prefix, then, after a 1-token chunk off the clock, the same streamed generate):"),
                  "", "| mode | agents | open | generate call to first token | TTFT | CPU s per agent |",
                  "|---|---|---:|---:|---:|---:|"]
        for mode, r in modes.items():
            for name, xs in ((f"1..{n}: agent 1", [r.agent1]), (f"1..{n}: agents 2..{n} at once", r.wave),
                             (f"one at a time, prefix ({r.solo_advance_tokens:,} tokens computed)", r.solo),
                             ("one at a time, plain open", r.plain)):
                lines.append(f"| {MODE_NAMES[mode]} | {name} | {_ms(_med(a.opened for a in xs))} | "
                             f"{_ms(_med(a.first_after for a in xs))} | {_ms(_med(a.first for a in xs))} | "
                             f"{_med(a.cpu for a in xs):.2f} |".replace("| nan |", "| - |"))
    lines += ["", f"References (medians): no-op update round trip {_ms(noop)} ms (n={len(noop_xs)}); one decode step "
              + ", ".join(f"{_ms(r.step)} ms ({mode}: {r.step_path} path)" for mode, r in modes.items()) + "."]
    lines += ["", "Targets:"]
    for mode, r in modes.items():
        bound = 3 * noop + r.step
        w = [a.first for a in r.wave]
        met = sum(x <= bound for x in w)
        lines.append(f"- {MODE_NAMES[mode]}: TTFT bound 3x no-op + one decode step = {_ms(bound)} ms. Agents 2..{n} "
                     f"at once: {met} of {len(w)} within it (median {statistics.median(w) / bound:.1f}x, max "
                     f"{max(w) / bound:.1f}x the bound: {'met' if met == len(w) else 'missed'})"
                     + (f"; one at a time: {sum(a.first <= bound for a in r.solo)} of {k} within it (median "
                        f"{_med(a.first for a in r.solo) / bound:.1f}x; a plain open's TTFT is "
                        f"{_med(a.first for a in r.plain) / bound:.1f}x)" if k else "") + ".")
        lines.append(f"  Prefill work: {r.advance_tokens:,} tokens = {r.advance_tokens / p:.2f}x the prefix over "
                     f"{n} agents (target 1x: {'met' if r.advance_tokens == p else 'not met'}).")
    if set(modes) == set(MODES):
        on, off = modes["on"], modes["off"]
        lines.append(f"- Side by side, off / on: agents 2..{n} median TTFT "
                     f"{_med(a.first for a in off.wave) / _med(a.first for a in on.wave):.1f}x; CPU (worker + "
                     f"clients + server) {(off.cpu_self + off.cpu_server) / (on.cpu_self + on.cpu_server):.1f}x; "
                     f"wall {off.wall / on.wall:.1f}x; "
                     f"prefill tokens {off.advance_tokens / max(on.advance_tokens, 1):.1f}x.")
    lines += ["", "Checks:"]
    for mode, r in modes.items():
        origins = Counter((a.stored, a.scope) for a in (r.agent1, *r.wave, *r.solo))
        lines.append(f"- {MODE_NAMES[mode]}: the receipts' origin (stored_tokens, scope): "
                     + ", ".join(f"({s}, {sc or '-'}) {c} agents" for (s, sc), c in sorted(origins.items())))
    tokens = {tuple(a.tokens) for r in modes.values() for a in (r.agent1, *r.wave, *r.solo)}
    lines.append(f"- every agent of every mode generated the same {args.gen_tokens} tokens: "
                 f"{'yes' if len(tokens) == 1 else f'NO ({len(tokens)} different sequences)'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    print(run(parse_args(argv)))


if __name__ == "__main__":
    main()
