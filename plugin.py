"""MambaStreamPlugin: everything a Temporal client or worker needs to run Mamba streams.

    client = await Client.connect(address, plugins=[MambaStreamPlugin(keyring=ring, activities=acts)])

It registers MambaStreamWorkflow and the example AgentWorkflow, the stream activities (when
given), the pydantic data converter with an AES-256-GCM payload codec from the keyring (tokens,
texts and receipts are encrypted in history; plain JSON typed into the Temporal CLI still
decodes), and a sandbox that passes the request/receipt models through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter
from temporalio.plugin import SimplePlugin
from temporalio.worker import WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities._agent import agent_feed_stream
from state_codec.codec import Keyring
from state_codec.payload import EncryptionCodec
from workflows import AgentWorkflow, MambaStreamWorkflow

__all__ = ["MambaStreamPlugin", "data_converter"]


def data_converter(keyring: Keyring) -> DataConverter:
    """Pydantic payloads, encrypted with the keyring."""
    return dataclasses.replace(pydantic_data_converter, payload_codec=EncryptionCodec(keyring))


def _runner(_: WorkflowRunner | None) -> WorkflowRunner:
    restrictions = SandboxRestrictions.default.with_passthrough_modules("pydantic", "state_codec", "workflows._models")
    return SandboxedWorkflowRunner(restrictions=restrictions)


class MambaStreamPlugin(SimplePlugin):
    """Args:
    keyring: encrypts payloads (and, through the activities, checkpoints).
    activities: a `StreamActivities` to serve; None for a client that only starts and feeds streams.
    """

    def __init__(self, *, keyring: Keyring, activities: Any = None) -> None:
        served: list[Callable[..., Any]] = [agent_feed_stream]
        if activities is not None:
            served = [*activities.activities(), *served]

        def add(existing: Sequence[Callable[..., Any]] | None) -> Sequence[Callable[..., Any]]:
            return [*(existing or []), *served]

        super().__init__(
            "mamba_stream.MambaStreamPlugin",
            data_converter=lambda _: data_converter(keyring),
            workflows=lambda existing: [*(existing or []), MambaStreamWorkflow, AgentWorkflow],
            activities=add,
            workflow_runner=_runner,
        )
