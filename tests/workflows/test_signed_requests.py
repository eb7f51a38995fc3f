"""Signed requests through a real Temporal server: workers holding the principals' public keys
refuse unsigned, tampered and cross-stream requests before they touch state, and nothing changes."""

from __future__ import annotations

import hashlib

import pytest
import torch
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError

from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.state_codec.signing import PrincipalKeys, RequestSigner
from mamba_stream.workflows import OpenStreamInput, StreamClient
from mamba_stream.workflows._models import AdvanceRequest, GenerateRequest, ResetRequest
from mamba_stream.workflows._stream import MambaStreamWorkflow
from tests.workflows.conftest import FAST, eventually, make_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

ALICE = RequestSigner.generate("alice")
MALLORY = RequestSigner.generate("mallory")


def reason(exc: BaseException) -> str | None:
    return getattr(getattr(exc, "cause", None), "type", None)


def digest(logits: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(logits.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


async def signed_stack(env, tmp_path):
    stack = await make_stack(env, tmp_path, start_worker=False)
    keys = PrincipalKeys.from_mapping({"alice": ALICE.public_key, "mallory": MALLORY.public_key})
    stack.acts = stack.new_activities(principal_keys=keys)
    await stack.worker(stack.acts)
    signing = StreamClient(stack.client, stack.queue, signer=ALICE)
    return stack, signing


async def snapshot(stack, streams: StreamClient, sid: str):
    s = await streams.stats(sid)
    return ((s.position, s.chunk_seq, s.epoch, s.chunks, s.resets), await streams.receipt(sid),
            sorted(stack.acts.store.list_stream(stream_id=sid)))


async def test_signed_requests_run_and_forged_ones_change_nothing(temporal_env, tmp_path):
    stack, signing = await signed_stack(temporal_env, tmp_path)
    async with stack.exits:
        model = load_model("tiny-mamba2", backend="reference")
        a = await signing.open("alice", "tiny-mamba2", options=FAST)
        b = await signing.open("alice", "tiny-mamba2", options=FAST)
        first = await signing.advance(a, "alice", tokens=[5, 6, 7])
        before = await snapshot(stack, signing, a)
        runs = stack.acts.metrics.migration_count

        # unsigned: a client without the key
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await stack.streams.advance(a, "alice", tokens=[8, 9])
        assert reason(err.value) == "UnsignedRequest"
        assert await snapshot(stack, signing, a) == before

        # tampered: alice's signature over [8, 9], sent with other tokens
        good = signing.sign("advance", a, AdvanceRequest(principal="alice", chunk_seq=2, tokens=[8, 9]))
        bad = good.model_copy(update={"tokens": [8, 10]})
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await signing.handle(a).execute_update(MambaStreamWorkflow.advance, bad, id="forged-1")
        assert reason(err.value) == "BadSignature"
        assert await snapshot(stack, signing, a) == before

        # replayed for another stream: a valid request for stream a, sent to stream b
        before_b = await snapshot(stack, signing, b)
        replay = signing.sign("advance", a, AdvanceRequest(principal="alice", chunk_seq=1, tokens=[1, 2]))
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await signing.handle(b).execute_update(MambaStreamWorkflow.advance, replay, id="replayed-1")
        assert reason(err.value) == "BadSignature"
        assert await snapshot(stack, signing, b) == before_b

        # another principal's key cannot sign for alice
        forged = AdvanceRequest(principal="alice", chunk_seq=2, tokens=[8, 9])
        forged = forged.model_copy(update={"signature": RequestSigner("alice", MALLORY._key).sign(
            "advance", a, forged.claims())})
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await signing.handle(a).execute_update(MambaStreamWorkflow.advance, forged, id="forged-2")
        assert reason(err.value) == "BadSignature"
        assert await snapshot(stack, signing, a) == before
        assert stack.acts.metrics.migration_count == runs

        # the genuine chunk 2 still runs, on the untouched state: outputs equal the local truth
        second = await signing.advance(a, "alice", tokens=[8, 9])
        assert second.chunk_seq == 2 and not second.duplicate
        truth = model.advance(model.initial_state(), [5, 6, 7, 8, 9])
        assert second.output_digest == digest(truth.logits[3:]) and first.output_digest == digest(truth.logits[:3])
        assert second.receipt.checksum == plaintext_checksum(truth.state.tensors)
        # re-sending it signs to the same bytes, so the same update id: the first result, once
        again = await signing.advance(a, "alice", tokens=[8, 9], chunk_seq=2)
        assert again.receipt == second.receipt
        assert signing.update_id("advance", a, good, 0) \
            == signing.update_id("advance", a, signing.sign("advance", a, good), 0)

        gen = signing.sign("generate", a, GenerateRequest(principal="alice", chunk_seq=3, max_tokens=2, seed=1))
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await signing.handle(a).execute_update(
                MambaStreamWorkflow.generate, gen.model_copy(update={"max_tokens": 3}), id="forged-3")
        assert reason(err.value) == "BadSignature"
        assert (await signing.generate(a, "alice", 2, seed=1)).chunk_seq == 3

        # checkpoint: unsigned refused, signed served
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await stack.streams.checkpoint(a, "alice")
        assert reason(err.value) == "UnsignedRequest"
        assert (await signing.checkpoint(a, "alice")).receipt.chunk_seq == 3
        for sid in (a, b):
            await signing.cancel(sid)


async def test_resets_unsigned_or_replayed_reset_nothing(temporal_env, tmp_path):
    stack, signing = await signed_stack(temporal_env, tmp_path)
    async with stack.exits:
        sid = await signing.open("alice", "tiny-mamba1", options=FAST)
        await signing.advance(sid, "alice", tokens=[1, 2, 3])
        await stack.streams.reset(sid, "alice")  # unsigned: the worker refuses, the stream counts it
        await eventually(lambda: _rejected(signing, sid, 1))
        s = await signing.stats(sid)
        assert (s.epoch, s.position, s.resets) == (0, 3, 0)

        await signing.reset(sid, "alice")  # signed, for epoch 1
        await eventually(lambda: _epoch(signing, sid, 1))
        # the same signed signal again (a replay): meant for epoch 1, the stream is past it
        replay = signing.sign("reset", sid, ResetRequest(principal="alice", epoch=1))
        await signing.handle(sid).signal(MambaStreamWorkflow.reset, replay)
        await eventually(lambda: _rejected(signing, sid, 2))
        s = await signing.stats(sid)
        assert (s.epoch, s.position, s.resets) == (1, 0, 1)
        # an unsigned cancel (and the Temporal cancel request after it): refused, the stream goes on
        await stack.streams.cancel(sid, "alice", wait=False)
        s = await eventually(lambda: _cancels_refused(signing, sid, 2))
        assert "UnsignedRequest" in s.last_refusal or "UnsealedRequest" in s.last_refusal
        assert not s.cancelled and stack.acts.store.list_stream(stream_id=sid)
        assert (await signing.advance(sid, "alice", tokens=[4])).position == 1
        with pytest.raises(WorkflowUpdateFailedError) as err:  # an unsigned rewind: refused by the worker
            await stack.streams.rewind(sid, 0)
        assert reason(err.value) == "UnsignedRequest"
        await signing.cancel(sid)  # signed: it ends
        s = await signing.stats(sid)
        assert s.cancelled and s.cancelled_by == "principal" and stack.acts.store.list_stream(stream_id=sid) == []


async def _cancels_refused(streams: StreamClient, sid: str, n: int):
    s = await streams.stats(sid)
    return s if s.refused_cancels == n else None


async def _rejected(streams: StreamClient, sid: str, n: int) -> bool:
    return (await streams.stats(sid)).rejected_resets == n


async def _epoch(streams: StreamClient, sid: str, n: int) -> bool:
    return (await streams.stats(sid)).epoch == n


async def test_an_unsigned_open_fails_with_its_reason_and_leaves_no_state(temporal_env, tmp_path):
    stack, _ = await signed_stack(temporal_env, tmp_path)
    async with stack.exits:
        with pytest.raises((WorkflowFailureError, WorkflowUpdateFailedError)) as err:
            await stack.streams.open("alice", "tiny-mamba2", options=FAST, stream_id="ms-unsigned-open")
        cause = err.value.cause
        while cause is not None and getattr(cause, "type", None) is None:
            cause = getattr(cause, "cause", None)
        assert getattr(cause, "type", None) == "UnsignedRequest"
        assert stack.acts.store.list_stream(stream_id="ms-unsigned-open") == []


async def test_a_prefix_is_signed_with_its_open_and_a_fork_with_its_checkpoint(temporal_env, tmp_path):
    stack, signing = await signed_stack(temporal_env, tmp_path)
    async with stack.exits:
        sid = await signing.open("alice", "tiny-mamba2", prefix=[5, 6, 7], options=FAST)
        assert (await signing.receipt(sid)).position == 3
        # alice's signature over one prefix, sent with another: refused, nothing stored
        other = signing.new_id("alice")
        good = signing.sign("open", other, OpenStreamInput(principal="alice", model_id="tiny-mamba2",
                                                           prefix=[5, 6, 7], options=FAST))
        handle = await stack.client.start_workflow(MambaStreamWorkflow.run,
                                                   good.model_copy(update={"prefix": [5, 6, 8]}),
                                                   id=other, task_queue=stack.queue)
        with pytest.raises(WorkflowFailureError) as err:
            await handle.result()
        assert reason(err.value) == "BadSignature" and stack.acts.store.list_stream(stream_id=other) == []
        # a fork is alice's checkpoint and open, each signed: unsigned, the checkpoint is refused
        await signing.advance(sid, "alice", tokens=[1, 2])
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await stack.streams.fork(sid, at_seq=1, principal="alice")
        assert reason(err.value) == "UnsignedRequest"
        child = await signing.fork(sid, at_seq=1)
        assert (await signing.receipt(child)).checksum == (await signing.receipt(sid)).checksum
