"""One chunk's trip: the files and calls of this repository's code that one `advance` runs, from
`StreamClient.advance` through the stream workflow, its activity, the engine and the scan to the
store and back (issue 28: "count the files and calls of one advance before and after").

A real dev server and an in-process worker (tests/workflows/conftest.py's stack, `exact` backend,
tiny-mamba2); the stream is opened and advanced twice first, so that what is counted is a warm
chunk's trip. Counted: Python function calls whose code is in this repository (tests and
installed packages left out), in every thread, by file. `--owner`: the advance of a workflow that
owns its stream (`ModelStream.advance`, in bench/_agent_paths.py's agent, whose own update is not
counted) instead of a client's to a stream workflow.

    python bench/trip_count.py [--owner] [--functions]
"""

from __future__ import annotations

import asyncio
import collections
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._agent_paths import AgentInput, InWorkflowAgent, Turn  # noqa: E402 - after sys.path names the repository
from tests.workflows.conftest import _start, make_stack  # noqa: E402

_ON = [False]
_CALLS: collections.Counter[tuple[str, str]] = collections.Counter()


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if _ON[0] and event == "call":
        f = frame.f_code.co_filename
        root = str(ROOT) + "/"
        if f.startswith(root) and "/tests/" not in f and "/.venv/" not in f:
            _CALLS[(f[len(root):], frame.f_code.co_name)] += 1


async def main(owner: bool) -> None:
    # before any thread starts: the worker's threads inherit the hook, which counts only while on
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    env = await _start([])
    try:
        with tempfile.TemporaryDirectory() as d:
            stack = await make_stack(env, Path(d), backend="exact", replay_at_exit=False, owners=(InWorkflowAgent,))
            async with stack.exits:
                if owner:
                    agent = await stack.client.start_workflow(
                        InWorkflowAgent.run, AgentInput(principal="alice", model_id="tiny-mamba2"),
                        id=stack.streams.new_id("alice"), task_queue=stack.queue)

                    async def advance(tokens: list[int]) -> None:
                        await agent.execute_update(InWorkflowAgent.feed, Turn(principal="alice", tokens=tokens,
                                                                             generate=0))
                else:
                    sid = await stack.streams.open("alice", "tiny-mamba2")

                    async def advance(tokens: list[int]) -> None:
                        await stack.streams.advance(sid, "alice", tokens=tokens)
                await advance([1, 2, 3])
                await advance([7, 8, 9])
                _ON[0] = True
                await advance([4, 5, 6])
                _ON[0] = False
                if owner:
                    await agent.signal(InWorkflowAgent.finish)
                    await agent.result()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        await env.shutdown()
    by_file: collections.Counter[str] = collections.Counter()
    for (f, _), n in _CALLS.items():
        by_file[f] += n
    print(f"one advance{' through ModelStream' if owner else ''}: {len(by_file)} files, {sum(_CALLS.values())} calls, "
          f"{len(_CALLS)} distinct functions")
    for f, n in by_file.most_common():
        print(f"{n:6d}  {f}")
    if "--functions" in sys.argv[1:]:
        for (f, fn), n in _CALLS.most_common():
            print(f"{n:6d}  {f}:{fn}")


if __name__ == "__main__":
    asyncio.run(main("--owner" in sys.argv[1:]))
