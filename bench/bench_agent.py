"""One agent turn (feed 32 tokens, generate 32), three ways, side by side in one run: the agent
owning its stream (`ModelStream`, the chunks activities of the agent's own workflow), the
child-workflow path agents had before it (the turn an activity of the agent that sends a
`MambaStreamWorkflow` child its `advance` and `generate` updates), and the stream workflow's own
`advance` + `generate` sent by a client. Medians over N sequential turns after warm-up, rounds
interleaved (a turn of each in turn); one worker with MambaStreamPlugin in-process, on a dev
server with our stacks' settings. Targets (issue 28): in-workflow <= 0.6x the child path, and
within 1.5x of the stream workflow's own advance + generate.

    python bench/bench_agent.py [--n 30] [--feed 32] [--generate 32] [--backend exact]
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

from _agent_paths import AgentInput, ChildPathAgent, InWorkflowAgent, Turn, child_turn
from temporalio.client import Client
from temporalio.worker import Worker

from mamba_stream.activities import ModelRegistry, StreamActivities, open_store
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.scan import ModelConfig, init_model, save_checkpoint
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.worker import DEV_SERVER_DYNAMIC_CONFIG, start_dev_server
from mamba_stream.workflows import StreamClient, StreamOptions

ROWS = ("in-workflow (ModelStream)", "child workflow + activity + updates", "stream workflow: advance + generate",
        "raw: model.advance of the feed, then one per generated token")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=30, help="turns per row, after warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--feed", type=int, default=32, help="tokens fed per turn")
    ap.add_argument("--generate", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--backend", default="exact", help="scan backend of the served model")
    args = ap.parse_args(argv)
    if args.n < 1 or args.feed < 1 or args.generate < 1 or args.warmup < 0:
        ap.error("--n, --feed and --generate must be positive")
    return args


async def _measure(args: argparse.Namespace, tmp: Path) -> dict[str, list[float]]:
    env = await start_dev_server(DEV_SERVER_DYNAMIC_CONFIG)
    ring = Keyring.generate()
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    acts = StreamActivities(models=ModelRegistry({"bench-mamba2": str(tmp / "model")}, backend=args.backend),
                            store=open_store(f"file://{tmp / 'states'}"), keyring=ring, worker_queue=f"{queue}@w")
    address = env.client.service_client.config.target_host
    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    pool = concurrent.futures.ThreadPoolExecutor(8)
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    opts = StreamOptions()  # the defaults: short chunks local
    try:
        async with Worker(client, task_queue=queue, activity_executor=pool, activities=[child_turn],
                          workflows=[InWorkflowAgent, ChildPathAgent]), \
                Worker(client, task_queue=f"{queue}@w", activity_executor=pool):
            streams = StreamClient(client, queue)
            inp = AgentInput(principal="bench", model_id="bench-mamba2", options=opts)
            owner = await client.start_workflow(InWorkflowAgent.run, inp, id=streams.new_id("bench"), task_queue=queue)
            child = await client.start_workflow(ChildPathAgent.run, inp, id=f"agent-{queue}", task_queue=queue)
            sid = await streams.open("bench", "bench-mamba2", options=opts)
            model = acts.models.get("bench-mamba2")
            state = model.advance(model.initial_state(), list(range(16))).state
            seq = 0
            for i in range(args.n + args.warmup):
                tokens = [(i * 7 + j) % 1024 for j in range(args.feed)]
                turn = Turn(principal="bench", tokens=tokens, generate=args.generate)
                t0 = time.perf_counter()
                await owner.execute_update(InWorkflowAgent.turn, turn)
                t1 = time.perf_counter()
                await child.execute_update(ChildPathAgent.turn, turn)
                t2 = time.perf_counter()
                await streams.advance(sid, "bench", tokens=tokens, chunk_seq=seq + 1)
                await streams.generate(sid, "bench", args.generate, temperature=0.0, chunk_seq=seq + 2)
                t3 = time.perf_counter()
                out = model.advance(state, tokens)  # the turn's compute alone, on the same engine's model
                for _ in range(args.generate):
                    out = model.advance(out.state, [int(out.logits[-1].argmax())])
                t4 = time.perf_counter()
                seq += 2
                if i >= args.warmup:
                    for row, dt in zip(ROWS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                        times[row].append(dt)
            for h in (owner, child):
                await h.signal("finish")
                await h.result()
            await streams.cancel(sid)
    finally:
        await env.shutdown()
        pool.shutdown()
    return times


def run(args: argparse.Namespace) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    cfg = ModelConfig.create(architecture="mamba2", d_model=256, n_layer=4, vocab_size=1024, d_state=64, headdim=64)
    save_checkpoint(init_model(cfg, seed=0, backend=args.backend), tmp / "model")
    times = asyncio.run(_measure(args, tmp))
    med = {row: statistics.median(xs) for row, xs in times.items()}
    lines = [f"One agent turn: feed {args.feed} tokens, generate {args.generate} (greedy); Temporal dev server, one "
             f"worker in-process, `{args.backend}` backend on CPU, model d_model 256, 4 layers, vocab 1024; "
             f"{args.n} turns per row after {args.warmup} warm-up, rows interleaved. Times in ms.", "",
             "| path | median | p90 | ratio to in-workflow |", "|---|---:|---:|---:|"]
    base = med[ROWS[0]]
    for row in ROWS:
        xs = sorted(times[row])
        p90 = xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]
        lines.append(f"| {row} | {med[row] * 1e3:.2f} | {p90 * 1e3:.2f} | {med[row] / base:.2f}x |")
    child, own, raw = med[ROWS[1]], med[ROWS[2]], med[ROWS[3]]
    lines += ["", f"Beyond the raw compute (medians): in-workflow {(base - raw) * 1e3:.2f} ms, child path "
              f"{(child - raw) * 1e3:.2f} ms ({(base - raw) / (child - raw):.2f}x), stream workflow "
              f"{(own - raw) * 1e3:.2f} ms.", "", "Targets (medians):",
              f"- in-workflow / child path: {base / child:.2f}x (target <= 0.6x: "
              f"{'met' if base <= 0.6 * child else 'missed'})",
              f"- in-workflow / stream workflow's own advance + generate: {base / own:.2f}x (target <= 1.5x: "
              f"{'met' if base <= 1.5 * own else 'missed'})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    print(run(parse_args(argv)))


if __name__ == "__main__":
    main()
