"""Pydantic AI on this project's streams: `MambaModel`, a `pydantic_ai.models.Model` whose
requests are turns of a conversation stream, each feeding only the messages its stream does not
hold yet, for agents made durable by `pydantic_ai.durable_exec.temporal`.

Needs the `agents` extra (`pip install 'mamba-stream-state[agents]'`). Light to import (no
engine): an agent and its model are built in the workflow's module.
"""

from mamba_stream.pydantic_ai._messages import PROVIDER_NAME, message_items
from mamba_stream.pydantic_ai._model import DEFAULT_MAX_TOKENS, EXTRA_BODY, MambaModel, sampling
from mamba_stream.workflows import conversation_start

__all__ = ["DEFAULT_MAX_TOKENS", "EXTRA_BODY", "PROVIDER_NAME", "MambaModel", "conversation_start", "message_items",
           "sampling"]
