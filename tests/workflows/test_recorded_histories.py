"""Histories recorded by earlier versions replay on this code (issue 44: workflow and activity type
names, payload formats and recorded histories stay valid across the move into `mamba_stream`).

`histories/top-level-modules/`: recorded by `histories/record.py` at 3f17a4f, when the code was
the top-level `workflows`, `activities`, `plugin`...: a stream through its lifecycle (open, a local
and a regular chunk, generate, checkpoint, rewind into a second run, reset, cancel) and a ChatAgent
conversation, with the keyring their payloads are encrypted under."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from mamba_stream.state_codec.codec import Keyring
from mamba_stream.workflows import ChatAgent, MambaStreamWorkflow, ModelStream
from tests.workflows.conftest import _aiter, _runner, data_converter

pytestmark = pytest.mark.asyncio(loop_scope="session")

HERE = Path(__file__).resolve().parent / "histories"
RECORDED = sorted(p.parent for p in HERE.glob("*/keyring.json"))  # a recording is a folder with its keyring


def _load(where: Path) -> tuple[Keyring, list[WorkflowHistory]]:
    runs = []
    for p in sorted(where.glob("*.json")):
        if p.name == "keyring.json":
            continue
        workflow_id = "chat-1" if p.name.startswith("chat") else json.loads(p.read_text())["events"][0][
            "workflowExecutionStartedEventAttributes"]["workflowId"]
        runs.append(WorkflowHistory.from_json(workflow_id, p.read_text()))
    # from_json, not from_file: git keeps no 0600 mode, and this keyring is a test fixture, not a secret
    return Keyring.from_json((where / "keyring.json").read_text()), runs


async def _replay(ring: Keyring, runs: list[WorkflowHistory]) -> list[str]:
    """Each run's replay failure (empty: all replayed)."""
    replayer = Replayer(workflows=[MambaStreamWorkflow, ChatAgent], data_converter=data_converter(ring),
                        workflow_runner=_runner(None))
    failures = []
    async with replayer.workflow_replay_iterator(_aiter(runs)) as results:
        async for result in results:
            if result.replay_failure is not None:
                failures.append(f"{result.history.workflow_id}: {result.replay_failure!r}")
    return failures


@pytest.mark.parametrize("where", RECORDED, ids=[p.name for p in RECORDED])
async def test_histories_recorded_by_earlier_versions_replay(where: Path, monkeypatch):
    ring, runs = _load(where)
    kinds = sorted(h.events[0].workflow_execution_started_event_attributes.workflow_type.name for h in runs)
    assert kinds == ["ChatAgent", "MambaStream", "MambaStream"]  # the type names are the recorded ones
    assert await _replay(ring, runs) == []

    # the replay can fail: code that sends the recorded local chunks the regular way does not replay them
    original = ModelStream._run_chunk

    async def regular(self, name, arg, result_type, size, chunk_seq, *, local=True):
        return await original(self, name, arg, result_type, size, chunk_seq, local=False)

    monkeypatch.setattr(ModelStream, "_run_chunk", regular)
    failed = await _replay(ring, runs)
    assert failed and all("ondetermin" in f for f in failed), failed
