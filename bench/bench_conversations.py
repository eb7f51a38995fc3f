"""A long agent conversation two ways, side by side in one run (issue 48, item 10): an OpenAI
Agents SDK agent on Temporal whose model is a stream (`MambaModelProvider`), each turn a forced
call of a function tool and then a free answer (two model calls), for --turns turns.

- ours: each turn chains the previous response id, so each model call feeds the stream only its
  new items (the user's message, the tool's output);
- stateless: the same model, provider and settings with the handles ignored: each turn sends the
  whole conversation and no previous response id, so each model call opens a new stream from the
  stored prefix state (instructions and tool schemas) and feeds everything after it, as a server
  that keeps nothing does (one with a prefix cache of the system part).

Per turn: tokens fed to the model (the model calls' input tokens), wall time of the turn (the
update that runs it, client side) and bytes the turn added to the agent workflow's history. The
two agents' turns are interleaved (turn i of each, which goes first alternating), on one worker with
both plugins, on a dev server started here.

    python bench/bench_conversations.py [--turns 50] [--model kjv-mamba2] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _conversation_agent import BenchConversation, TurnInput, TurnOutput
from agents import set_tracing_disabled
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin
from temporalio.worker import Worker

from mamba_stream.activities import ModelRegistry, StreamActivities, open_store
from mamba_stream.openai_agents import MambaModelProvider
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.worker import DEV_SERVER_DYNAMIC_CONFIG, start_dev_server
from mamba_stream.workflows import conversation_start

MODES = ("ours", "stateless")
#: the turns the summary table shows (and the last one)
SHOWN = (1, 10, 25, 50)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=50, help="turns of each conversation")
    ap.add_argument("--model", default="kjv-mamba2", help="a preset (or MAMBA_STREAM_MODELS source) to serve")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each model call")
    ap.add_argument("--backend", default="auto", help="scan backend of the served model")
    args = ap.parse_args(argv)
    if args.turns < 1 or args.max_tokens < 96:
        ap.error("--turns must be positive and --max-tokens at least 96 (a forced tool call, wrapper included)")
    return args


async def _history_bytes(handle: WorkflowHandle) -> int:
    return sum([e.ByteSize() async for e in handle.fetch_history_events()])


async def _measure(args: argparse.Namespace, tmp: Path) -> dict[str, list[tuple[TurnOutput, float, int]]]:
    env = await start_dev_server(DEV_SERVER_DYNAMIC_CONFIG)
    ring = Keyring.generate()
    queue = f"bench-conv-{uuid.uuid4().hex[:8]}"
    acts = StreamActivities(models=ModelRegistry({args.model: args.model}, backend=args.backend),
                            store=open_store(f"file://{tmp / 'states'}"), keyring=ring, worker_queue=f"{queue}@w")
    provider = MambaModelProvider(task_queue=queue)
    plugins = [OpenAIAgentsPlugin(model_provider=provider,
                                  model_params=ModelActivityParameters(start_to_close_timeout=timedelta(minutes=10))),
               MambaStreamPlugin(keyring=ring, activities=acts)]
    address = env.client.service_client.config.target_host
    client = await Client.connect(address, plugins=plugins)
    rows: dict[str, list[tuple[TurnOutput, float, int]]] = {m: [] for m in MODES}
    try:
        async with Worker(client, task_queue=queue, workflows=[BenchConversation]):
            agents = {m: await client.start_workflow(BenchConversation.run, m == "stateless", task_queue=queue,
                                                     **conversation_start(client, "bench"))
                      for m in MODES}
            # one turn first on a conversation of its own: the process's first turn loads what every
            # later one finds loaded (neither measured conversation bears it)
            warm = await client.start_workflow(BenchConversation.run, False, task_queue=queue,
                                               **conversation_start(client, "bench"))
            await warm.execute_update(BenchConversation.turn, TurnInput(question="Warm up.", model=args.model,
                                                                        max_tokens=args.max_tokens, seed=0))
            await warm.signal(BenchConversation.end)
            size = {m: await _history_bytes(h) for m, h in agents.items()}
            for i in range(1, args.turns + 1):
                # the two in turn, the first of a turn alternating: neither always follows the other
                for mode in (MODES if i % 2 else MODES[::-1]):
                    handle = agents[mode]
                    inp = TurnInput(question=f"Turn {i}: what does word {i} mean?", model=args.model,
                                    max_tokens=args.max_tokens, seed=i)
                    t0 = time.perf_counter()
                    out = await handle.execute_update(BenchConversation.turn, inp)
                    dt = time.perf_counter() - t0
                    now = await _history_bytes(handle)
                    rows[mode].append((out, dt, now - size[mode]))
                    size[mode] = now
                logging.getLogger(__name__).info("turn %d: %s", i, {m: (r[-1][0].fed_tokens, round(r[-1][1], 2))
                                                                    for m, r in rows.items()})
            for handle in agents.values():
                await handle.signal(BenchConversation.end)
                await handle.result()
    finally:
        await env.shutdown()
    return rows


def run(args: argparse.Namespace) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="bench-conversations-"))
    rows = asyncio.run(_measure(args, tmp))
    shown = sorted({t for t in SHOWN if t <= args.turns} | {args.turns})
    lines = [f"A {args.turns}-turn OpenAI Agents SDK conversation on Temporal, model `{args.model}` "
             f"(`{args.backend}` backend, CPU), each turn a forced tool call then a free answer (max_tokens "
             f"{args.max_tokens} a call); ours (previous_response_id: only new items fed) against stateless (the "
             f"whole conversation each turn, a new stream from the stored prefix each call); turns interleaved; "
             f"one worker with both plugins, dev server.", "",
             "| turn | tokens fed: ours | stateless | ratio | time per turn (s): ours | stateless | ratio "
             "| history bytes added: ours | stateless | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in shown:
        (o, ot, oh), (s, st, sh) = rows["ours"][t - 1], rows["stateless"][t - 1]
        lines.append(f"| {t} | {o.fed_tokens} | {s.fed_tokens} | {s.fed_tokens / max(o.fed_tokens, 1):.1f}x "
                     f"| {ot:.2f} | {st:.2f} | {st / ot:.1f}x | {oh} | {sh} | {sh / max(oh, 1):.1f}x |")
    total = {m: (sum(r[0].fed_tokens for r in rs), sum(r[1] for r in rs), sum(r[2] for r in rs))
             for m, rs in rows.items()}
    med = {m: statistics.median(r[1] for r in rs) for m, rs in rows.items()}
    calls = {m: (sum(r[0].model_calls for r in rs), sum(r[0].tool_calls for r in rs)) for m, rs in rows.items()}
    lines += ["", "| conversation | tokens fed | time (s) | median time per turn (s) | history bytes | model calls "
              "| tool calls |", "|---|---:|---:|---:|---:|---:|---:|"]
    for m in MODES:
        lines.append(f"| {m} | {total[m][0]} | {total[m][1]:.1f} | {med[m]:.2f} | {total[m][2]} | {calls[m][0]} "
                     f"| {calls[m][1]} |")
    ours, stateless = total["ours"], total["stateless"]
    lines += ["", f"stateless / ours over the conversation: tokens fed {stateless[0] / ours[0]:.1f}x, "
              f"time {stateless[1] / ours[1]:.2f}x, history bytes {stateless[2] / ours[2]:.1f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    # the SDK's trace export has nowhere to go here (no OpenAI key), and its exporter thread, started
    # from the first workflow task that ends a span, blocked this process's event loop
    set_tracing_disabled(True)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("openai", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    print(run(parse_args(argv)))


if __name__ == "__main__":
    main()
