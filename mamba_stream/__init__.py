"""mamba-stream-state: Mamba language models served as durable, per-agent streams on Temporal.

One package, importable beside any project (one laid out like Temporal's samples, with its own
`workflows.py`, `activities.py` and `worker.py`, included):

    from mamba_stream import MambaStreamPlugin, StreamClient, ModelStream

The names here are the client's and the agent author's; they load nothing of the worker (no
torch). The rest lives in the subpackages, each with its own public names (`__all__`):
`mamba_stream.workflows` (the streams, their requests and failures), `mamba_stream.activities`
(the engine, stores and sweep: worker side), `mamba_stream.state_codec` (receipts, keys, the
checkpoint codec), `mamba_stream.scan` (the models), `mamba_stream.worker` (`mamba-stream-worker`),
`mamba_stream.cli` (`mamba-stream`).

The names resolve when first used (PEP 562): Temporal's workflow sandbox imports this package
again for each workflow run's modules, and it must cost nothing there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mamba_stream.plugin import MambaStreamPlugin
    from mamba_stream.workflows import (
        ChatAgent,
        ClientConfig,
        MambaStreamWorkflow,
        ModelStream,
        OpenStreamInput,
        StreamClient,
        StreamFailure,
        StreamOptions,
        StreamOwner,
        conversation_start,
    )

__all__ = ["ChatAgent", "ClientConfig", "MambaStreamPlugin", "MambaStreamWorkflow", "ModelStream", "OpenStreamInput",
           "StreamClient", "StreamFailure", "StreamOptions", "StreamOwner", "conversation_start"]

#: where each name lives
_HOME = {name: "mamba_stream.workflows" for name in __all__} | {"MambaStreamPlugin": "mamba_stream.plugin"}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'mamba_stream' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later reads do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
