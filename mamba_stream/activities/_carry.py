"""The continue-as-new carry, sealed by the workers: what a stream carries to its next run is sealed
for its stream and the run that continues (`seal`), and verified by the run that receives it
before that run trusts any of it (`open`). A carry's seal is an HMAC under a workers' key, over
the stream, the sealing run and the carry's digest (`workflows.contract.carry_digest`).
"""

from __future__ import annotations

import hashlib
import hmac

from temporalio import activity
from temporalio.client import WorkflowHistoryEventFilterType

from mamba_stream.state_codec import ForgedCarry
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.workflows import CarrySeal, CarrySealRequest, InvalidRequest

__all__ = ["CarrySeals"]


class CarrySeals:
    """Seals and verifies carries under the keyring's carry key."""

    def __init__(self, keyring: Keyring) -> None:
        self._key = keyring.subkey("mamba-stream/carry/v1")

    def _mac(self, stream_id: str, run_id: str, digest: str) -> str:
        return hmac.new(self._key, f"{stream_id}|{run_id}|{digest}".encode(), hashlib.sha256).hexdigest()

    def seal(self, req: CarrySealRequest) -> CarrySeal:
        """Seal what the stream carries to its next run, for its stream and this run (the run
        that schedules the activity, as the server says)."""
        run_id = activity.info().workflow_run_id if activity.in_activity() else None
        if not run_id:
            raise InvalidRequest("a carry is sealed by the run that continues as new")
        return CarrySeal(run_id=run_id, mac=self._mac(req.stream_id, run_id, req.digest))

    async def open(self, req: CarrySealRequest) -> CarrySeal:
        """Verify a carry before the run that received it trusts any of it: sealed by the workers,
        for this stream, by the run this one continues. Raises ForgedCarry otherwise.

        A carry with no seal at all is one a version that did not seal carries made (a versioned
        rollout continues its streams as new onto this one): it is taken when the server's
        history says the run this one continues ended by continuing as new into this very run,
        which only the workflow's own code can do."""
        seal = req.seal
        if seal is None and req.continued_run_id and await _continued_into_this_run(req):
            return CarrySeal(run_id=req.continued_run_id, mac="")
        if seal is None or not req.continued_run_id or seal.run_id != req.continued_run_id:
            raise ForgedCarry("the start input carries a carry, but this run does not continue the run that "
                              "sealed it", field="run_id", expected=req.continued_run_id,
                              actual=seal.run_id if seal else None)
        if not hmac.compare_digest(seal.mac, self._mac(req.stream_id, seal.run_id, req.digest)):
            raise ForgedCarry("the carry's seal does not verify: not the workers' carry of this stream",
                              field="mac")
        return seal


async def _continued_into_this_run(req: CarrySealRequest) -> bool:
    """Whether run `continued_run_id` of the stream ended by continuing as new into the run
    that scheduled this activity (the server's history: its close event)."""
    try:
        client = activity.client()
    except RuntimeError:  # not in a worker: nothing to ask
        return False
    handle = client.get_workflow_handle(req.stream_id, run_id=req.continued_run_id)
    async for event in handle.fetch_history_events(event_filter_type=WorkflowHistoryEventFilterType.CLOSE_EVENT):
        if event.HasField("workflow_execution_continued_as_new_event_attributes"):
            moved = event.workflow_execution_continued_as_new_event_attributes
            return moved.new_execution_run_id == activity.info().workflow_run_id
        return False
    return False
