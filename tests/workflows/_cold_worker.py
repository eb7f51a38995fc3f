"""A cold worker process: nothing loaded, and a first model load that imports a slow module.

    python -m tests.workflows._cold_worker ADDRESS QUEUE STORE_URL KEYRING_FILE READY_FILE IMPORTS_FILE

It serves the workflows and the stream activities of tiny-mamba2 (reference backend) on QUEUE and
its own queue, wired by MambaStreamPlugin as worker.py's are, but without worker.py's warm-up: its
first chunk loads the model inside the attempt. That first load imports `_slow_first_load` (3 s, as
a large package on a loaded machine's disk: a model's first load used to import torch._dynamo and
sympy, which took seconds there), so the load takes seconds more than the local timeout's floor on
any machine, and an exception raised into the loading thread would land inside an import.
READY_FILE gets JSON: its own queue, and whether that module was imported yet (it must not be).
IMPORTS_FILE gets a line each time the module is looked for: once in a healthy process; a second
time means an exception broke the first import half-way (Python forgets a module whose import
raised).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.abc
import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

import mamba_stream.activities._registry as registry
from mamba_stream.activities import StreamActivities, open_store
from mamba_stream.activities._registry import ModelRegistry
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.codec import Keyring

#: what this worker's first model load imports
SLOW = ("tests.workflows._slow_first_load",)


class NoteImports(importlib.abc.MetaPathFinder):
    """Finds nothing itself; notes each time a module of SLOW is looked for."""

    def __init__(self, imports: Path) -> None:
        self.imports = imports

    def find_spec(self, name, path=None, target=None):  # the finder protocol
        if name in SLOW:
            with open(self.imports, "a") as f:
                f.write(name + "\n")
        return None


def _slow_first_load(load: Callable[..., Any]) -> Callable[..., Any]:
    """`load`, after importing SLOW (at once, once imported)."""
    def first_load(*args: Any, **kw: Any) -> Any:
        for name in SLOW:
            importlib.import_module(name)
        return load(*args, **kw)
    return first_load


async def main() -> None:
    address, queue, store_url, keyring_file, ready, imports = sys.argv[1:7]
    sys.meta_path.insert(0, NoteImports(Path(imports)))
    registry.load_model = _slow_first_load(registry.load_model)
    ring = Keyring.from_file(keyring_file)
    own = f"{queue}@cold-{uuid.uuid4().hex[:6]}"
    acts = StreamActivities(models=ModelRegistry(["tiny-mamba2"], backend="reference"),
                            store=open_store(store_url), keyring=ring, worker_queue=own)
    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])
    pool = concurrent.futures.ThreadPoolExecutor(4)
    async with Worker(client, task_queue=queue, activity_executor=pool):  # and `own`, beside it (the plugin)
        Path(ready).write_text(json.dumps({"queue": own, "imported": [m for m in SLOW if m in sys.modules],
                                           "loaded": list(acts.models._models)}))
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
