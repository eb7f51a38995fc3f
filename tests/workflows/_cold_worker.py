"""A cold worker process: nothing loaded, and a slow disk under the modules a model's first load imports.

    python -m tests.workflows._cold_worker ADDRESS QUEUE STORE_URL KEYRING_FILE READY_FILE IMPORTS_FILE

It serves the workflows and the stream activities of tiny-mamba2 (reference backend) on QUEUE and
its own queue, wired by MambaStreamPlugin as worker.py's are, but without worker.py's warm-up: its
first chunk loads the model inside the attempt. Each module of sympy and torch._dynamo (what that
first load imports) takes 10 ms more to find, as on a loaded machine's disk, so the load takes
seconds more than the local timeout's floor on any machine, and an exception raised into the
loading thread would land inside an import. READY_FILE gets JSON: its own queue, and whether those
modules were imported yet (they must not be). IMPORTS_FILE gets a line each time sympy or
torch._dynamo itself is looked for: once in a healthy process; a second time means an exception
broke the first import half-way (Python forgets a module whose import raised, not its submodules).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.abc
import json
import sys
import time
import uuid
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities import open_store
from activities._registry import ModelRegistry
from activities._stream import StreamActivities
from plugin import MambaStreamPlugin
from state_codec.codec import Keyring

#: what a model's first load imports (torch.nn.init under the meta device imports torch._dynamo)
SLOW = ("sympy", "torch._dynamo")


class SlowDisk(importlib.abc.MetaPathFinder):
    """Finds nothing itself; takes 10 ms per module of SLOW before the real finders do, and notes
    each time a module of SLOW itself is looked for."""

    def __init__(self, imports: Path) -> None:
        self.imports = imports

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        if name in SLOW:
            with open(self.imports, "a") as f:
                f.write(name + "\n")
        if name.startswith(SLOW):
            time.sleep(0.01)
        return None


async def main() -> None:
    address, queue, store_url, keyring_file, ready, imports = sys.argv[1:7]
    sys.meta_path.insert(0, SlowDisk(Path(imports)))
    ring = Keyring.from_file(keyring_file)
    own = f"{queue}@cold-{uuid.uuid4().hex[:6]}"
    acts = StreamActivities(models=ModelRegistry(["tiny-mamba2"], backend="reference"),
                            store=open_store(store_url), keyring=ring, worker_queue=own)
    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    pool = concurrent.futures.ThreadPoolExecutor(4)
    async with Worker(client, task_queue=queue, activity_executor=pool), \
            Worker(client, task_queue=own, activity_executor=pool):
        Path(ready).write_text(json.dumps({"queue": own, "imported": [m for m in SLOW if m in sys.modules],
                                           "loaded": list(acts.models._models)}))
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
