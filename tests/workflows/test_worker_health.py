"""A worker is never poisoned (issue 25): a timed-out attempt leaves it healthy, timeouts have
floors, and a worker that fails every chunk for a reason not theirs stops taking work."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

from tests.workflows.conftest import FAST, Stack
from workflows import MambaStreamWorkflow, OpenStreamInput, StreamOptions, new_stream_id
from workflows._models import TIMEOUT_FLOORS

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _events(stack: Stack, sid: str) -> list:
    return [e async for e in stack.client.get_workflow_handle(sid).fetch_history_events()]


BELOW = {name: floor / 2 for name, floor in TIMEOUT_FLOORS.items()}


@pytest.mark.parametrize("field", [*sorted(BELOW), "task_timeout"])
async def test_a_timeout_under_its_floor_is_refused_typed_and_starts_nothing(stack: Stack, field):
    """A raw client (no validation of its own) asks for a timeout under its floor, in the options
    or as the start request's workflow task timeout: the workers refuse it, typed, before the
    stream opens; nothing runs and nothing is stored."""
    sid = new_stream_id(stack.keyring.principal_tag("alice"))
    if field == "task_timeout":
        opts, task_timeout = FAST, timedelta(seconds=TIMEOUT_FLOORS["task_timeout_s"] / 2)
    else:
        with pytest.raises(ValueError):  # a client refuses to build it ...
            StreamOptions(**{**FAST.model_dump(), field: BELOW[field]})
        # ... a raw one sends it all the same
        opts, task_timeout = FAST.model_copy(update={field: BELOW[field]}), timedelta(seconds=FAST.task_timeout_s)
    handle = await stack.client.start_workflow(
        MambaStreamWorkflow.run, OpenStreamInput.model_construct(principal="alice", model_id="tiny-mamba2",
                                                                 options=opts),
        id=sid, task_queue=stack.queue, task_timeout=task_timeout)
    with pytest.raises(WorkflowFailureError) as err:
        await asyncio.wait_for(handle.result(), 30)
    cause = err.value.cause
    assert cause.type == "InvalidRequest" and cause.non_retryable, cause
    named = "task_timeout" if field == "task_timeout" else field
    assert named in cause.message and (field == "task_timeout" or "greater than or equal" in cause.message)
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED
    events = await _events(stack, sid)
    assert [e for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED] == []
    assert stack.acts.store.list_stream(stream_id=sid) == []
    # the floors themselves are taken
    ok = await stack.streams.open("alice", "tiny-mamba2",
                                  options=StreamOptions(**{**FAST.model_dump(), **TIMEOUT_FLOORS}))
    assert (await stack.streams.advance(ok, "alice", tokens=[1, 2])).position == 2
