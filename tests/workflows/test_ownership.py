"""Only a stream's principal (or the operator) changes it (Issue 26): a request is the principal
whose key sealed it. Each hostile case is sent to bob's stream from a client holding only alice's
exported keyring, and from a keyless client (a plain Temporal client: plaintext JSON, no codec);
each is refused, typed, with bob's stream unchanged (position, epoch, checksum, blobs) and nothing
of bob's returned; then bob's stream goes on, bit for bit."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from typing import Any

import pytest
from temporalio import workflow
from temporalio.api.common.v1 import Payload, Payloads, WorkflowExecution
from temporalio.api.enums.v1 import UpdateWorkflowExecutionLifecycleStage
from temporalio.api.update.v1 import Input, Meta, Request, WaitPolicy
from temporalio.api.workflowservice.v1 import UpdateWorkflowExecutionRequest
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec import SEALER_KEY
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import (
    AdvanceRequest,
    CheckpointRequest,
    GenerateRequest,
    MambaStreamWorkflow,
    ModelStream,
    OpenStreamInput,
    ResetRequest,
    StreamClient,
    new_stream_id,
)
from mamba_stream.workflows._models import (
    CancelRequest,
    CarrySeal,
    ModelInfo,
    RecentResult,
    ReleaseRequest,
    RewindRequest,
    StreamCarry,
    StreamStats,
)
from tests.workflows.conftest import Stack, eventually
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")

BOB_TOKENS = [[5, 6, 7], [8, 9]]


async def _principal(stack: Stack, who: str) -> StreamClient:
    ring = stack.keyring.for_principal(who)  # what `mamba-stream export-keys <who>` writes
    return StreamClient(await Client.connect(stack.address, plugins=[MambaStreamPlugin(keyring=ring)]), stack.queue)


async def _bobs_stream(stack: Stack) -> tuple[StreamClient, str]:
    bob = await _principal(stack, "bob")
    sid = await bob.open("bob", "tiny-mamba2")
    for chunk in BOB_TOKENS:
        await bob.advance(sid, "bob", tokens=chunk)
    return bob, sid


async def _state(stack: Stack, bob: StreamClient, sid: str) -> tuple:
    """What an attack must not change: position, chunk, epoch, counts, the receipt, the blobs."""
    s = await bob.stats(sid)
    return ((s.position, s.chunk_seq, s.epoch, s.chunks, s.resets, s.cancelled), await bob.receipt(sid),
            sorted(stack.acts.store.list_stream(stream_id=sid)))


async def _goes_on(stack: Stack, bob: StreamClient, sid: str, fed: list[int] | None = None) -> None:
    """Bob's next chunk continues his state bit for bit."""
    model = local("tiny-mamba2")
    fed = [t for c in BOB_TOKENS for t in c] if fed is None else fed
    after = await bob.advance(sid, "bob", tokens=[10, 11])
    truth = model.advance(model.initial_state(), [*fed, 10, 11])
    assert after.receipt.checksum == plaintext_checksum(truth.state.tensors) and after.position == len(fed) + 2


def _requests(principal: str, seq: int) -> list[tuple[str, Any]]:
    """(update name, request) of every update a client may send a stream."""
    return [("advance", AdvanceRequest(principal=principal, chunk_seq=seq, text="hijack")),
            ("generate", GenerateRequest(principal=principal, chunk_seq=seq, max_tokens=4, seed=1)),
            ("checkpoint", CheckpointRequest(principal=principal)),
            ("checkpoint", CheckpointRequest(principal=principal, at_seq=1)),  # a fork's
            ("release", ReleaseRequest(principal=principal, state_key="any")),
            ("rewind", RewindRequest(principal=principal, to_seq=0))]


async def _refusals(bob: StreamClient, sid: str, **want) -> object:
    s = await bob.stats(sid)
    return s if all(getattr(s, k) == v for k, v in want.items()) else None


async def test_another_principals_client_changes_nothing_and_is_told_why(stack: Stack):
    """Alice held only her exported keyring: her `advance`, `generate`, `reset` naming bob were
    applied to bob's stream, and she was told `UnknownKeyId`."""
    bob, sid = await _bobs_stream(stack)
    alice = await _principal(stack, "alice")
    before = await _state(stack, bob, sid)
    handle = alice.client.get_workflow_handle(sid)
    for principal in ("bob", "alice"):  # whatever the body says, the key says alice
        for name, req in _requests(principal, 3):
            with pytest.raises(WorkflowUpdateFailedError) as err:
                await handle.execute_update(name, req, id=f"{name}-{uuid.uuid4().hex}")
            cause = err.value.cause
            # typed: the refusal's type, which is in clear; its message and details are bob's
            assert isinstance(cause, ApplicationError) and cause.type == "SealerMismatch", (name, cause)
            assert "hijack" not in cause.message and not cause.details
    # signals have no caller to tell: counted on bob's stream, where bob sees why
    await handle.signal("reset", ResetRequest(principal="bob"))
    await handle.signal("cancel", CancelRequest(principal="bob"))
    await handle.cancel()  # a bare Temporal cancel: it carries no key
    s = await eventually(lambda: _refusals(bob, sid, rejected_resets=1, refused_cancels=2))
    assert s.last_refusal.startswith("cancel: UnsealedRequest") and s.cancelled_by == ""
    assert await _state(stack, bob, sid) == before
    await _goes_on(stack, bob, sid)


async def _raw_update(client: Client, sid: str, name: str, body: dict, metadata: dict | None = None):
    """An update sent as a keyless client would send it from any language: plaintext JSON, no codec."""
    payload = Payload(metadata={"encoding": b"json/plain", **(metadata or {})}, data=json.dumps(body).encode())
    resp = await client.workflow_service.update_workflow_execution(UpdateWorkflowExecutionRequest(
        namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=sid),
        wait_policy=WaitPolicy(lifecycle_stage=UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_COMPLETED),
        request=Request(meta=Meta(update_id=f"{name}-{uuid.uuid4().hex}"),
                        input=Input(name=name, args=Payloads(payloads=[payload])))))
    return resp.outcome


async def test_a_keyless_client_changes_nothing(stack: Stack):
    """A keyless client's plaintext JSON `advance` was applied: the workers accepted unencrypted payloads."""
    bob, sid = await _bobs_stream(stack)
    keyless = await Client.connect(stack.address)  # no plugin: no keys, no codec
    before = await _state(stack, bob, sid)
    bob_tag = sid.split(".")[1]
    for name, req in _requests("bob", 3):
        body = req.model_dump(mode="json")
        # and one that claims in its metadata to be sealed by bob: the codec's word overrides it
        for metadata in (None, {SEALER_KEY: bob_tag.encode()}):
            outcome = await _raw_update(keyless, sid, name, body, metadata)
            assert outcome.HasField("failure"), name
            assert outcome.failure.application_failure_info.type == "UnsealedRequest", (name, outcome.failure)
    handle = keyless.get_workflow_handle(sid)
    await handle.signal("reset", {"principal": "bob"})
    await handle.signal("cancel", {"principal": "bob"})
    await handle.cancel()
    s = await eventually(lambda: _refusals(bob, sid, rejected_resets=1, refused_cancels=2))
    assert "UnsealedRequest" in s.last_refusal
    assert await _state(stack, bob, sid) == before
    # no history event from any of it but the signals and the cancel request, which Temporal writes
    # for anyone who sends one (its authorizer decides who may: docs/deploying.md)
    events = [e async for e in bob.handle(sid).fetch_history_events()]
    accepted = [e for e in events if e.HasField("workflow_execution_update_accepted_event_attributes")]
    assert [e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name for e in accepted] \
        == ["ready", "advance", "advance"]
    await _goes_on(stack, bob, sid)


async def test_a_forged_carry_is_refused_before_anything_of_it_is_used(stack: Stack):
    """Holding a stolen receipt of bob's, alice started a stream with a forged carry whose
    digest-only result pointed at bob's state key, and `recall_result` returned bob's text; a
    forged `kept` deleted bob's checkpoint."""
    bob, sid = await _bobs_stream(stack)
    gen = await bob.generate(sid, "bob", 6, seed=3)  # the text a forged carry would read back
    stolen = gen.receipt
    before = await _state(stack, bob, sid)
    alice = await _principal(stack, "alice")
    recent = RecentResult(update_id="advance-9-e0-forged", digest="x", kind="generate", chunk_seq=3,
                          state_key=stolen.state_key)
    tag = stack.keyring.principal_tag("alice")
    for seal in (None, CarrySeal(run_id=str(uuid.uuid4()), mac="00" * 32)):
        carry = StreamCarry(receipt=stolen.model_copy(update={"principal": "alice"}),
                            info=ModelInfo(model_id="tiny-mamba2", model_revision=stolen.model_revision,
                                           architecture="mamba2", vocab_size=256, input_transform="bytes",
                                           input_transform_revision="x", schema_fingerprint=stolen.schema_fingerprint,
                                           state_bytes=1),
                            stats=StreamStats(principal="alice", chunk_seq=2), recent=[recent],
                            kept=[k for k in before[2] if not k.endswith(".out")])
        forged = new_stream_id(tag)
        handle = await alice.client.start_workflow(
            MambaStreamWorkflow.run, OpenStreamInput(principal="alice", model_id="tiny-mamba2", carry=carry,
                                                     carry_seal=seal),
            id=forged, task_queue=stack.queue, id_conflict_policy=WorkflowIDConflictPolicy.FAIL)
        with pytest.raises((WorkflowUpdateFailedError, RPCError)):  # its recent result: never answered
            await handle.execute_update("generate", GenerateRequest(principal="alice", chunk_seq=3, max_tokens=6),
                                        id="advance-9-e0-forged")
        with pytest.raises(WorkflowFailureError) as err:
            await handle.result()
        assert getattr(err.value.cause, "type", None) == "ForgedCarry"
        # the run did nothing but check its carry: no chunk, recall, drop or dispose ran
        events = [e async for e in handle.fetch_history_events()]
        ran = [e.activity_task_scheduled_event_attributes.activity_type.name for e in events
               if e.HasField("activity_task_scheduled_event_attributes")]
        markers = [e for e in events if e.HasField("marker_recorded_event_attributes")
                   and e.marker_recorded_event_attributes.marker_name == "core_local_activity"]
        assert ran == [] and len(markers) == 1  # open_carry, local
    assert await _state(stack, bob, sid) == before  # bob's checkpoints all there
    raw = b"".join(e.SerializeToString() for e in events)
    assert gen.text.encode() not in raw
    await _goes_on(stack, bob, sid, [*[t for c in BOB_TOKENS for t in c], *gen.tokens])


def _clear_strings(msg, out: list[str]) -> list[str]:
    """Every string in a history event that is not inside a payload: ids, names, identities."""
    if isinstance(msg, (Payload, Payloads)):
        return out
    for field, value in msg.ListFields():
        repeated = getattr(field, "is_repeated", None) or getattr(field, "label", None) == 3  # LABEL_REPEATED
        if field.type == field.TYPE_STRING:
            out.extend(value if repeated else [value])
        elif field.type == field.TYPE_MESSAGE:
            if repeated and field.message_type.GetOptions().map_entry:
                out.extend(str(k) for k in value)
                items = list(value.values())
            else:
                items = list(value) if repeated else [value]
            for item in items:
                if hasattr(item, "ListFields"):
                    _clear_strings(item, out)
                elif isinstance(item, str):
                    out.append(item)
    return out


async def test_ids_in_clear_history_and_store_keys_carry_no_content(stack: Stack):
    """`advance-1-e0-<16 hex>` was an unkeyed sha256 of the request: a dictionary search over
    history alone recovered "the vault code is 4711" in 0.05 s."""
    from mamba_stream.workflows import chunk_digest

    sid = await stack.streams.open("alice", "tiny-mamba2")
    secret = "the vault code is 4711"
    first = await stack.streams.advance(sid, "alice", text=secret)
    again = await stack.streams.advance(sid, "alice", text=secret, chunk_seq=1)
    assert again == first  # a resend derives the same id: the server answers it with the first result
    with pytest.raises(WorkflowUpdateFailedError) as err:  # other content at the same sequence
        await stack.streams.advance(sid, "alice", text="the vault code is 0000", chunk_seq=1)
    assert err.value.cause.type == "ConflictingChunk"
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    clear = " ".join(s for e in events for s in _clear_strings(e, []))
    keys = " ".join(stack.acts.store.list_stream(stream_id=sid))
    assert "advance-1-e0-" in clear  # the ids are there, in clear
    # the dictionary search: every code, every digest the ids and keys could have been made of
    found = []
    for code in range(10_000):
        text = f"the vault code is {code:04d}"
        d = chunk_digest("advance", AdvanceRequest(principal="alice", chunk_seq=1, text=text))
        tokens = hashlib.sha256(b"advance|5|" + b"".join(int(b).to_bytes(8, "little") for b in text.encode()))
        for needle in (d[:16], d, tokens.hexdigest()[:32], hashlib.sha256(text.encode()).hexdigest()[:16]):
            if needle in clear or needle in keys:
                found.append(text)
    assert found == []
    # the control: an unkeyed id of the real chunk would have been found
    unkeyed = chunk_digest("advance", AdvanceRequest(principal="alice", chunk_seq=1, text=secret))[:16]
    assert unkeyed not in clear and first.receipt.state_key in keys


async def _cli(stack: Stack, codec_endpoint: str, *args: str):
    import os
    import subprocess

    from mamba_stream.worker import temporal_binary

    # the codec endpoint from the environment, as the README says: not on the command line
    env = dict(os.environ, TEMPORAL_CODEC_ENDPOINT=codec_endpoint)
    return await asyncio.to_thread(subprocess.run, [temporal_binary(), "workflow", *args, "--address", stack.address],
                                   capture_output=True, text=True, timeout=60, env=env)


async def test_the_operator_resets_and_cancels_any_stream_and_that_is_recorded(stack: Stack):
    """The README's commands through the codec endpoint: the principal travels encrypted, the
    operator's acts are counted as the operator's, and a refused reset is visible to whoever sent it."""
    from mamba_stream.state_codec.codec_server import CodecServer

    bob, sid = await _bobs_stream(stack)
    codec = CodecServer(stack.keyring, port=0).start()  # the operator's token, in `endpoint`
    try:
        out = await _cli(stack, codec.endpoint, "signal", "--workflow-id", sid, "--name", "reset",
                         "--input", json.dumps({"principal": "bbo"}))  # misspelled
        assert out.returncode == 0, out.stderr
        s = await eventually(lambda: _refusals(bob, sid, rejected_resets=1))
        assert s.last_refusal.startswith("reset: PrincipalMismatch") and "'bbo'" in s.last_refusal and s.epoch == 0
        out = await _cli(stack, codec.endpoint, "signal", "--workflow-id", sid, "--name", "reset",
                         "--input", json.dumps({"principal": "bob"}))
        assert out.returncode == 0, out.stderr
        s = await eventually(lambda: _refusals(bob, sid, epoch=1))
        assert (s.resets, s.operator_resets, s.position) == (1, 1, 0)
        events = [e async for e in bob.handle(sid).fetch_history_events()]
        raw = b"".join(e.SerializeToString() for e in events)
        # quoted, as JSON would carry them: a bare 3-byte word turns up in this much ciphertext by chance
        assert b'"bob"' not in raw and b'"bbo"' not in raw and b"principal" not in raw  # sealed, in history too
        # cancel: the sealed signal, then Temporal's cancel request
        out = await _cli(stack, codec.endpoint, "signal", "--workflow-id", sid, "--name", "cancel",
                         "--input", json.dumps({"principal": "bob"}))
        assert out.returncode == 0, out.stderr
        out = await _cli(stack, codec.endpoint, "cancel", "--workflow-id", sid)
        assert out.returncode == 0, out.stderr
        with pytest.raises(WorkflowFailureError):
            await bob.handle(sid).result()
        s = await bob.stats(sid)
        assert s.cancelled and s.cancelled_by == "operator"
        assert stack.acts.store.list_stream(stream_id=sid) == []
        assert (await bob.handle(sid).describe()).status.name == "CANCELED"
    finally:
        codec.stop()


async def _pending(stack: Stack, sid: str, after: set[str]) -> str | None:
    """The id of the stream's running generate activity, one not in `after`."""
    desc = await stack.streams.handle(sid).describe()
    ids = [p.activity_id for p in desc.raw_description.pending_activities
           if p.activity_type.name == "generate_tokens" and p.activity_id not in after]
    return ids[0] if ids else None


async def test_an_activity_completed_by_its_id_from_outside_is_run_again(temporal_env, tmp_path):
    """Anyone who reaches the frontend can complete or fail a running activity by its id: a
    keyless client's completion of a running generate, in clear JSON, was committed as the chunk
    (and one that did not convert would have failed the stream's workflow task on every retry)."""
    from tests.workflows.conftest import FAST, make_stack
    from tests.workflows.test_token_stream import SlowSampling

    stack = await make_stack(temporal_env, tmp_path, acts_cls=SlowSampling)
    async with stack.exits:
        stack.acts.step_s = 0.05
        regular = FAST.model_copy(update={"local_chunks": False})
        sid = await stack.streams.open("alice", "tiny-mamba2", options=regular)
        twin = await stack.streams.open("alice", "tiny-mamba2", options=regular)
        for s in (sid, twin):
            await stack.streams.advance(s, "alice", text="forge me: ")
        keyless = await Client.connect(stack.address)
        shape = (await stack.streams.generate(twin, "alice", 4, seed=1)).model_dump(mode="json")
        await stack.streams.generate(sid, "alice", 4, seed=1)  # the twin's chunk 2 too
        forgeries = [{"result": "forged"},  # does not even convert
                     {"result": {**shape, "stream_id": sid, "tokens": [70, 79, 82, 71, 69], "text": "FORGE"},
                      "worker_queue": None},  # converts, in clear
                     None]  # a failure of its own, permanent, of a reason the chunk could have
        seen: set[str] = set()
        seq = 2
        for forge in forgeries:
            # each chunk a generate of its own, forged once while it runs. On a saturated box the
            # generate can finish before the forgery reaches the server (NotFound): that chunk is
            # a plain one (still checked against the twin) and the forgery tries the next chunk.
            for _ in range(6):
                seq += 1
                real = await stack.streams.generate(twin, "alice", 40, seed=seq)
                gen = asyncio.ensure_future(stack.streams.generate(sid, "alice", 40, seed=seq))
                aid = await eventually(lambda: _pending(stack, sid, seen), timeout=60, interval=0.02)
                seen.add(aid)
                handle = keyless.get_async_activity_handle(workflow_id=sid, run_id=None, activity_id=aid)
                try:
                    if forge is None:
                        await handle.fail(ApplicationError("forged", type="CheckpointNotFound", non_retryable=True))
                    else:
                        await handle.complete(forge)
                    landed = True
                except RPCError as err:
                    if "already" not in str(err) and "invalid activityID" not in str(err):
                        raise
                    landed = False  # the real result got there first
                result = await asyncio.wait_for(gen, 120)
                assert result.tokens == real.tokens and result.text == real.text
                assert "FORGE" not in (result.text or "")
                assert result.receipt.checksum == real.receipt.checksum
                if landed:
                    break
            else:
                pytest.fail("every generate finished before its forgery reached the server")
        stats = await stack.streams.stats(sid)
        assert stats.forged_results == 3 and stats.chunk_seq == seq


async def _moved(streams: StreamClient, sid: str, n: int):
    try:
        s = await streams.stats(sid)
    except Exception:  # noqa: BLE001 - between runs
        return None
    return s if s.continued_as_new >= n else None


async def test_a_carry_from_a_version_that_did_not_seal_carries_is_taken_on_the_servers_word(can_env, tmp_path,
                                                                                             monkeypatch):
    """A versioned rollout continues running streams as new onto the new version: the old
    version's carry has no seal. The new run takes it because the server's history says the run it
    continues continued as new into it (only the workflow's own code can); a client's start, whose
    run continues nothing, is refused (the forged-carry test above)."""
    import mamba_stream.workflows._model_stream as model_stream
    from tests.workflows.conftest import make_stack

    sealing, marking = ModelStream.seal_carry, model_stream.mark_patches

    async def unsealed(self, carry):
        # the first run is the old version's: it continues as new without a seal (and without
        # marking history: the real code replays it as such); the runs after it are this version's
        return None if workflow.info().continued_run_id is None else await sealing(self, carry)

    def unmarked() -> None:  # nor did that version mark its patches
        if workflow.info().continued_run_id is not None:
            marking()

    monkeypatch.setattr(ModelStream, "seal_carry", unsealed)
    monkeypatch.setattr(model_stream, "mark_patches", unmarked)
    stack = await make_stack(can_env, tmp_path)
    async with stack.exits:
        model = local("tiny-mamba2")
        sid = await stack.streams.open("alice", "tiny-mamba2")
        fed: list[int] = []
        for i in range(14):  # the server suggests continue-as-new after 24 events: two moves
            chunk = [i + 1, i + 2]
            await stack.streams.advance(sid, "alice", tokens=chunk)
            fed += chunk
        s = await eventually(lambda: _moved(stack.streams, sid, 2))
        assert s.chunk_seq == 14 and s.position == len(fed)
        monkeypatch.undo()  # the stack's replay at exit runs the real code over what was recorded
        after = await stack.streams.advance(sid, "alice", tokens=[50])
        truth = model.advance(model.initial_state(), [*fed, 50])
        assert after.receipt.checksum == plaintext_checksum(truth.state.tensors)
