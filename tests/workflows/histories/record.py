"""Record the histories `tests/workflows/test_recorded_histories.py` replays: a stream through its
whole lifecycle (open, feed, generate, checkpoint, rewind, reset, cancel) and a ChatAgent
conversation, on a dev server of its own, with the keyring saved beside them (their payloads are
encrypted under it: it is a test fixture, not a secret).

    python tests/workflows/histories/record.py OUT_DIR

It runs on this checkout, or on one from before the package (top-level `workflows`, `plugin`, ...:
run it from that checkout's root with this file's path), which is how `top-level-modules/` was made
(at 3f17a4f, the last commit before `mamba_stream`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import uuid
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

try:
    from mamba_stream.activities import ModelRegistry, StreamActivities, open_store
    from mamba_stream.plugin import MambaStreamPlugin
    from mamba_stream.state_codec.codec import Keyring
    from mamba_stream.worker import start_dev_server
    from mamba_stream.workflows import ChatAgent, ChatInput, ChatMessage, StreamClient
except ImportError:  # a checkout from before the package
    sys.path.insert(0, str(Path.cwd()))
    from activities import ModelRegistry, StreamActivities, open_store  # type: ignore[no-redef]
    from plugin import MambaStreamPlugin  # type: ignore[no-redef]
    from state_codec.codec import Keyring  # type: ignore[no-redef]
    from workflows import ChatAgent, ChatInput, ChatMessage, StreamClient  # type: ignore[no-redef]

    from worker import start_dev_server  # type: ignore[no-redef]


async def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ring = Keyring.generate()
    ring.save(out / "keyring.json")
    env = await start_dev_server()
    try:
        addr = env.client.service_client.config.target_host
        queue = f"record-{uuid.uuid4().hex[:8]}"
        acts = StreamActivities(models=ModelRegistry(["tiny-mamba2"], backend="reference"),
                                store=open_store(f"file://{out / 'states'}"), keyring=ring,
                                worker_queue=f"{queue}@1")
        client = await Client.connect(addr, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
        pool = concurrent.futures.ThreadPoolExecutor(4)
        async with Worker(client, task_queue=queue, activity_executor=pool), \
                Worker(client, task_queue=acts.worker_queue, activity_executor=pool):
            s = StreamClient(client, queue)
            sid = await s.open("alice", "tiny-mamba2")
            await s.advance(sid, "alice", text="hello, ")
            await s.advance(sid, "alice", tokens=[t % 256 for t in range(300)])  # over local_max_tokens: a regular activity
            await s.generate(sid, "alice", 8, seed=7)
            await s.checkpoint(sid, "alice")
            await s.rewind(sid, 1)
            await s.advance(sid, "alice", text="again")
            await s.reset(sid, "alice")
            await s.advance(sid, "alice", tokens=[1, 2, 3])
            await s.cancel(sid)
            agent = await client.start_workflow(ChatAgent.run, ChatInput(principal="alice", model_id="tiny-mamba2",
                                                                         reply_tokens=4), id="chat-1", task_queue=queue)
            for text in ("hi", "and again", ""):
                await agent.execute_update(ChatAgent.say, ChatMessage(principal="alice", text=text))
            await agent.result()
            async for wf in client.list_workflows(f"TaskQueue = '{queue}'"):
                h = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
                (out / f"{wf.id}.{wf.run_id}.json").write_text(h.to_json())
        acts.close()
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]).resolve()))
