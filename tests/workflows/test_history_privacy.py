"""What history keeps in clear (Issue 16, finding 3): failure messages and stack traces travel
encrypted, like payloads; the owner's client reads them, the server and its database do not."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowUpdateFailedError

from tests.workflows.conftest import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_failure_messages_reach_history_encrypted_and_the_owner_reads_them(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2")
    first = await stack.streams.advance(sid, "alice", tokens=[1, 2])
    key = first.receipt.state_key
    stack.acts.store.delete(key=key)  # lost: the next chunk's activity fails, naming the key and the store
    stack.acts.release_stream(sid)
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await stack.streams.advance(sid, "alice", tokens=[3])
    assert err.value.cause.type == "CheckpointNotFound" and key in err.value.cause.message  # decrypted here
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    failed = [e for e in events if e.HasField("workflow_execution_update_completed_event_attributes")
              and e.workflow_execution_update_completed_event_attributes.outcome.HasField("failure")]
    assert failed, "the update's failure is in history"
    failure = failed[-1].workflow_execution_update_completed_event_attributes.outcome.failure
    assert failure.message == "Encoded failure" and failure.HasField("encoded_attributes")
    raw = b"".join(e.SerializeToString() for e in events)
    store_path = stack.store_url.removeprefix("file://").encode()
    assert key.encode() not in raw and store_path not in raw and b"Traceback" not in raw


async def _epoch(stack: Stack, sid: str, epoch: int):
    s = await stack.streams.stats(sid)
    return s if s.epoch == epoch else None


@pytest.mark.parametrize("revoke", [False, True])
async def test_a_reset_with_revoke_leaves_no_resumable_checkpoint_of_the_old_epoch(stack: Stack, revoke: bool):
    from temporalio.client import WorkflowFailureError

    from tests.workflows.conftest import eventually

    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", text="before the reset")
    pinned = (await stack.streams.checkpoint(sid, "alice")).receipt
    handed = (await stack.streams.advance(sid, "alice", text=" and more")).receipt  # a result's receipt
    await stack.streams.reset(sid, "alice", revoke=revoke)
    await eventually(lambda: _epoch(stack, sid, 1))
    keys = stack.acts.store.list_stream(stream_id=sid)
    assert (pinned.state_key in keys, handed.state_key in keys) == (not revoke, not revoke)
    for receipt in (pinned, handed):
        if revoke:
            with pytest.raises(WorkflowFailureError) as err:
                await stack.streams.open("alice", "tiny-mamba2", resume=receipt)
            assert err.value.cause.type == "CheckpointNotFound"
        else:  # the documented default: what was handed out before the reset still resumes
            resumed = await stack.streams.open("alice", "tiny-mamba2", resume=receipt)
            assert (await stack.streams.stats(resumed)).position == receipt.position
    after = await stack.streams.advance(sid, "alice", tokens=[1])
    assert after.position == 1 and after.receipt.epoch == 1
