"""Streams on a saturated machine: both cores busy with other work, a worker killed mid-run, local
and regular chunks, advances and generates. Every stream ends at its solo checksum, and no history
has a failed workflow task (a nondeterminism error would be one); the stack's replay pass at exit
replays every run recorded."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import StreamOptions
from tests.workflows.conftest import eventually, failed_tasks, histories, make_stack
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[2]
N_STREAMS = 100
#: timeouts a saturated 2-core box needs: a heartbeat every second may be late by seconds here
LOADED = StreamOptions(heartbeat_timeout_s=8.0, schedule_to_start_s=8.0, activity_timeout_s=120.0,
                       task_timeout_s=8.0, local_timeout_s=4.0, local_max_tokens=16)
#: a chunk this long takes the regular path (past LOADED.local_max_tokens)
LONG = 40


def _busy(n: int) -> list[subprocess.Popen]:
    """`n` processes that spin on a core each, at the workers' own priority."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


async def _exists(path: Path) -> bool:
    return path.exists()


async def test_streams_on_a_saturated_machine_through_a_worker_kill_end_at_their_solo_checksums(temporal_env,
                                                                                                  tmp_path):
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    hogs = _busy(os.cpu_count() or 2)
    doomed = None
    try:
        async with stack.exits:
            keyfile, ready = tmp_path / "keyring.json", tmp_path / "ready"
            stack.keyring.save(keyfile)
            # a worker process that serves workflows and activities, as worker.py's do; it never
            # kills itself (edge "none"): the test kills it
            doomed = subprocess.Popen([sys.executable, "-m", "tests.workflows._crash_worker", stack.address,
                                       stack.queue, stack.store_url, str(keyfile), "none", "0", str(ready), "local"],
                                      cwd=ROOT)
            await eventually(lambda: _exists(ready), timeout=120)
            stack.acts.models.get("tiny-mamba2")  # loaded before it serves, as worker.py's workers do
            await stack.worker(stack.acts)  # the survivor, in this process
            # a saturated box answers late: a call is sent again for longer than an interactive
            # client would wait, never given up while the stream can still move
            stack.streams.retry_s = 600.0
            model = local("tiny-mamba2")
            half = asyncio.Event()
            done = 0

            async def one(i: int) -> tuple[str, str, str]:
                nonlocal done
                rng = random.Random(i)
                principal = f"tenant-{i % 5}"
                sid = await stack.streams.open(principal, "tiny-mamba2", options=LOADED)
                fed: list[int] = []
                last = None
                for step in range(4):
                    kind = rng.choice(["short", "short", "long", "generate", "generate-long"] if step else ["short"])
                    if kind in ("short", "long"):
                        tokens = [rng.randrange(256) for _ in range(rng.randint(1, 12) if kind == "short" else LONG)]
                        last = await stack.streams.advance(sid, principal, tokens=tokens)
                        fed += tokens
                    else:
                        n = rng.randint(2, 6) if kind == "generate" else LONG
                        last = await stack.streams.generate(sid, principal, n, seed=i, temperature=0.8)
                        fed += last.tokens
                    if step == 1:
                        done += 1
                        if done == N_STREAMS // 2:
                            half.set()
                truth = model.advance(model.initial_state(), fed)
                return sid, last.receipt.checksum, plaintext_checksum(truth.state.tensors)

            async def kill_at_half() -> None:
                await half.wait()
                doomed.send_signal(signal.SIGKILL)

            killer = asyncio.ensure_future(kill_at_half())
            results = await asyncio.gather(*(one(i) for i in range(N_STREAMS)))
            await killer
            assert doomed.wait(timeout=30) == -signal.SIGKILL
            diverged = [sid for sid, got, want in results if got != want]
            assert not diverged, f"{len(diverged)} of {N_STREAMS} streams differ from their solo run"
            runs = await histories(stack.client, stack.queue)
            assert len(runs) >= N_STREAMS
            # No workflow task may fail, nondeterminism above all, with one exception that this box
            # itself makes: the SDK fails an activation that runs past 2 s of wall time
            # (`_DeadlockError`), and with both cores held by busy loops, the worker process's threads
            # and the killed worker's streams replayed at once, an activation waiting for the GIL and
            # a core can. Temporal retries such a task; the streams above still end at their solo
            # checksums. Seen in 2 of 4 full runs of the suite on a 2-core VM, one task each time.
            failed = {r.workflow_id: failed_tasks(r) for r in runs if failed_tasks(r)}
            stalled = [m for ms in failed.values() for m in ms if m.endswith("_DeadlockError")]
            other = {w: [m for m in ms if not m.endswith("_DeadlockError")] for w, ms in failed.items()}
            other = {w: ms for w, ms in other.items() if ms}
            assert not other, f"failed workflow tasks in {len(other)} histories: {list(other.items())[:3]}"
            assert len(stalled) <= 3, f"{len(stalled)} activations past the SDK's 2 s deadlock timer"
            stats = await asyncio.gather(*(stack.streams.stats(sid) for sid, _, _ in results))
            assert sum(s.local_chunks for s in stats) > 0 and sum(s.chunks - s.local_chunks for s in stats) > 0
            await asyncio.gather(*(stack.streams.cancel(sid) for sid, _, _ in results))
    finally:
        for p in hogs + ([doomed] if doomed else []):
            if p.poll() is None:
                p.kill()
                p.wait()
