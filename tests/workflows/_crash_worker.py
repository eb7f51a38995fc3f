"""A worker process that kills itself (SIGKILL) at one commit edge of one chunk.

    python -m tests.workflows._crash_worker ADDRESS QUEUE STORE_URL KEYRING_FILE EDGE CHUNK_SEQ READY_FILE

It serves activities only (the shared queue and its own queue), so the workflow keeps running on
the test's worker while this one dies mid-chunk, as a GPU worker would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import sys
import uuid
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities import open_store
from activities._registry import ModelRegistry
from activities._stream import StreamActivities
from plugin import data_converter
from state_codec.codec import Keyring


class Crashing(StreamActivities):
    def __init__(self, edge: str, chunk_seq: int, **kw) -> None:
        super().__init__(**kw)
        self._crash = (edge, chunk_seq)

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if (name, chunk_seq) == self._crash:
            os.kill(os.getpid(), signal.SIGKILL)


async def main() -> None:
    address, queue, store_url, keyring_file, edge, seq, ready = sys.argv[1:8]
    ring = Keyring.from_file(keyring_file)
    own = f"{queue}@crash-{uuid.uuid4().hex[:6]}"
    acts = Crashing(edge, int(seq), models=ModelRegistry(["tiny-mamba2"], backend="reference"),
                    store=open_store(store_url), keyring=ring, worker_queue=own)
    client = await Client.connect(address, data_converter=data_converter(ring))
    pool = concurrent.futures.ThreadPoolExecutor(4)
    async with Worker(client, task_queue=queue, activities=acts.activities(), activity_executor=pool), \
            Worker(client, task_queue=own, activities=acts.activities(), activity_executor=pool):
        Path(ready).write_text(own)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
