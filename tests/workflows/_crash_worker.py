"""A worker process that kills itself (SIGKILL) at one commit edge of one chunk.

    python -m tests.workflows._crash_worker ADDRESS QUEUE STORE_URL KEYRING_FILE EDGE CHUNK_SEQ
        READY_FILE [MODE [MODELS]]

MODE `regular` (the default): it serves activities only (the shared queue and its own queue), so
the workflow keeps running on the test's worker while this one dies mid-chunk, as a GPU worker
would. MODE `local`: it serves the workflows too, as every worker of worker.py does, so the
stream's chunks run here as local activities, inside this worker's workflow tasks; the edge
`returned` is after the local activity's result reached the workflow, before the workflow task
that records it completes. MODELS: what it serves (MAMBA_STREAM_MODELS' form; default tiny-mamba2).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import (
    Interceptor,
    StartLocalActivityInput,
    Worker,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from mamba_stream.activities import StreamActivities, open_store
from mamba_stream.activities._registry import ModelRegistry
from mamba_stream.plugin import MambaStreamPlugin, data_converter, worker_slots
from mamba_stream.state_codec.codec import Keyring

_CRASH: tuple[str, int] = ("", -1)


def _die(*_: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Crashing(StreamActivities):
    def __init__(self, edge: str, chunk_seq: int, **kw) -> None:
        super().__init__(**kw)
        self._crash = (edge, chunk_seq)

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if (name, chunk_seq) == self._crash:
            _die()


class _Outbound(WorkflowOutboundInterceptor):
    def start_local_activity(self, input: StartLocalActivityInput) -> workflow.ActivityHandle[Any]:
        handle = super().start_local_activity(input)
        request = getattr(input.args[0], "request", None) if input.args else None
        if _CRASH[0] == "returned" and getattr(request, "chunk_seq", None) == _CRASH[1]:
            # runs when the result resolves in the workflow: before this activation, and so the
            # workflow task that would record the local activity, is sent back to the server
            handle.add_done_callback(_die)
        return handle


class _Inbound(WorkflowInboundInterceptor):
    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_Outbound(outbound))


class KillAfterLocal(Interceptor):
    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        return _Inbound


async def main() -> None:
    global _CRASH
    address, queue, store_url, keyring_file, edge, seq, ready = sys.argv[1:8]
    mode = sys.argv[8] if len(sys.argv) > 8 else "regular"
    models = ModelRegistry.from_spec(sys.argv[9] if len(sys.argv) > 9 else "tiny-mamba2", backend="reference")
    _CRASH = (edge, int(seq))
    ring = Keyring.from_file(keyring_file)
    own = f"{queue}@crash-{uuid.uuid4().hex[:6]}"
    acts = Crashing(edge, int(seq), models=models,
                    store=open_store(store_url), keyring=ring, worker_queue=own)
    if mode == "local":
        client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
        # the plugin serves `own` beside it
        shared = Worker(client, task_queue=queue, interceptors=[KillAfterLocal()],
                        **worker_slots(workflows=True, activities=8, locals_=8))
        async with shared:
            Path(ready).write_text(own)
            await asyncio.Event().wait()
        return
    else:
        client = await Client.connect(address, data_converter=data_converter(ring))
        shared = Worker(client, task_queue=queue, activities=acts.activities(),
                        **worker_slots(workflows=False, activities=8))
        mine = Worker(client, task_queue=own, activities=acts.activities(),
                      **worker_slots(workflows=False, activities=8))
    async with shared, mine:
        Path(ready).write_text(own)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
