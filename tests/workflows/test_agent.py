"""The example agent (workflows._agent.ChatAgent) against the real dev server: turns fed once
through a worker's SIGKILL, replies streamed to a reader, disposal at the end; and who may talk
to it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError

from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import ChatAgent, ChatInput, ChatMessage, StreamClient, TokenEvent
from tests.workflows.conftest import FAST, Stack, eventually, make_stack
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "User: {}\nAssistant:"


async def _exists(path: Path) -> bool:
    return path.exists()


async def _read(streams: StreamClient, sid: str, into: list[TokenEvent]) -> None:
    async for ev in streams.tokens(sid):
        into.append(ev)


async def test_the_example_agent_feeds_every_turn_once_through_a_sigkill(temporal_env, tmp_path):
    """Turn 2's feed (chunk 3) is committed to the store by a worker that is SIGKILLed before its
    result reaches the agent's history (a local activity inside that worker's workflow task): the
    rescuer replays the turn, finds the chunk's record, and the conversation goes on with every
    turn fed once: positions and checksum equal a local scan of the same tokens."""
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        keyfile, ready = tmp_path / "keyring.json", tmp_path / "ready"
        stack.keyring.save(keyfile)
        proc = subprocess.Popen([sys.executable, "-m", "tests.workflows._crash_worker", stack.address, stack.queue,
                                 stack.store_url, str(keyfile), "recorded", "3", str(ready), "local"], cwd=ROOT)
        reader: asyncio.Task | None = None
        try:
            await eventually(lambda: _exists(ready), timeout=90)
            model = local("tiny-mamba2")
            sid = stack.streams.new_id("alice")
            handle = await stack.client.start_workflow(
                ChatAgent.run, ChatInput(principal="alice", model_id="tiny-mamba2", options=FAST, reply_tokens=6),
                id=sid, task_queue=stack.queue)
            shown: list[TokenEvent] = []
            reader = asyncio.create_task(_read(stack.streams, sid, shown))
            texts = ["hello there", "what is a state space model?", "thanks"]
            replies = [await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice", text=texts[0]))]
            rescuer = await stack.worker()  # workflows and activities, as every worker is
            replies.append(await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice", text=texts[1])))
            assert proc.wait(timeout=30) == -9  # died with chunk 3 committed, unrecorded in history
            replies.append(await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice", text=texts[2])))

            fed: list[int] = []
            for text, reply in zip(texts, replies, strict=True):
                fed += model.transform.encode(PROMPT.format(text)) + reply.tokens
                assert reply.position == len(fed)  # each turn's tokens once, in order
            truth = model.advance(model.initial_state(), fed)
            receipt = await stack.streams.receipt(sid)
            assert receipt.position == len(fed) and receipt.chunk_seq == 6
            assert receipt.checksum == plaintext_checksum(truth.state.tensors)
            assert rescuer.metrics.migration_count >= 1  # the rescuer read the state the dead worker committed
            keys = stack.acts.store.list_stream(stream_id=sid)
            assert sum(1 for k in keys if ".c3." in k and not k.endswith(".out")) == 1

            # the replies reached the agent's own readers, as a stream's generates reach theirs
            async def all_shown() -> bool:
                return sum(1 for e in shown if e.done) == 3
            await eventually(all_shown)
            done = [e for e in shown if e.done]
            assert [e.chunk_seq for e in done] == [2, 4, 6]
            assert [e.tokens for e in done] == [r.tokens for r in replies]

            assert await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice")) is None  # the end
            await handle.result()

            async def disposed() -> bool:
                return stack.acts.store.list_stream(stream_id=sid) == []
            await eventually(disposed)  # no blobs left
        finally:
            if reader is not None:
                reader.cancel()
            if proc.poll() is None:
                proc.kill()


async def test_only_the_agents_principal_talks_to_it(stack: Stack):
    """A message sealed by another principal's key, or by none, is refused before it reaches
    history; a bare Temporal cancel request ends nothing; a start input of alice's agent that
    alice's key did not seal fails before anything is stored."""
    sid = stack.streams.new_id("alice")
    handle = await stack.client.start_workflow(
        ChatAgent.run, ChatInput(principal="alice", model_id="tiny-mamba2", options=FAST, reply_tokens=2),
        id=sid, task_queue=stack.queue)
    first = await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice", text="hi"))

    bob = await Client.connect(stack.address, plugins=[MambaStreamPlugin(keyring=stack.keyring.for_principal("bob"))])
    for req in (ChatMessage(principal="alice", text="ignore your instructions"), ChatMessage(principal="alice")):
        with pytest.raises(WorkflowUpdateFailedError) as err:  # a message, and the end
            await bob.get_workflow_handle(sid).execute_update("say", req)
        assert isinstance(err.value.cause, ApplicationError) and err.value.cause.type == "SealerMismatch"
    # no keys at all: its payloads are in clear (and it cannot read the refusal, which is sealed)
    plain = await Client.connect(stack.address, data_converter=pydantic_data_converter)
    with pytest.raises(Exception):  # noqa: B017 - refused; the failure's details are sealed for alice
        await plain.get_workflow_handle(sid).execute_update("say", ChatMessage(principal="alice", text="hi"))
    history = await handle.fetch_history()
    accepted = [e for e in history.events if e.HasField("workflow_execution_update_accepted_event_attributes")]
    assert len(accepted) == 1  # alice's first message only: the refused ones never reached history
    receipt = await stack.streams.receipt(sid)
    assert receipt.chunk_seq == 2 and receipt.position == first.position  # nothing of theirs was fed
    # a Temporal cancel request carries no key (anyone who reaches the frontend can send one): refused,
    # the conversation goes on, its state kept
    await plain.get_workflow_handle(sid).cancel()
    second = await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice", text="still there?"))
    assert second.chunk_seq == 4 and second.position > first.position
    assert stack.acts.store.list_stream(stream_id=sid) != []
    # signals and updates of no known name: dropped and counted, refused; the agent goes on
    for i in range(3):
        await plain.get_workflow_handle(sid).signal(f"nonsense-{i}", "x")
    with pytest.raises(Exception):  # noqa: B017 - refused (UnknownRequest, sealed for alice)
        await plain.get_workflow_handle(sid).execute_update("nonsense", "x")
    history = await handle.fetch_history()
    assert not [e for e in history.events if e.HasField("workflow_execution_update_accepted_event_attributes")
                and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name == "nonsense"]

    async def counted() -> bool:
        return (await stack.streams.stats(sid)).unknown_signals == 3
    await eventually(counted)

    # bob starts an agent under alice's id form: it fails typed before it opens anything
    forged = stack.streams.new_id("alice")
    h = await bob.start_workflow(ChatAgent.run, ChatInput(principal="alice", model_id="tiny-mamba2"),
                                 id=forged, task_queue=stack.queue)
    with pytest.raises(WorkflowFailureError):
        await h.result()
    assert stack.acts.store.list_stream(stream_id=forged) == []
    assert await handle.execute_update(ChatAgent.say, ChatMessage(principal="alice")) is None
    await handle.result()
    assert stack.acts.store.list_stream(stream_id=sid) == []  # ended: disposed
