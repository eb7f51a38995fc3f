"""Reset and cancel from the real Temporal CLI, checkpoint and resume, tenant isolation, history."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError

from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.state_codec.payload import ENCRYPTED_ENCODING
from mamba_stream.worker import temporal_binary
from tests.workflows.conftest import Stack, eventually, sdk_bookkeeping
from tests.workflows.test_stream_workflow import digest, local, reason

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def cli(stack: Stack, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real `temporal` CLI, in a thread so the test's worker keeps running."""
    return await asyncio.to_thread(subprocess.run, [temporal_binary(), "workflow", *args, "--address", stack.address],
                                   capture_output=True, text=True, timeout=60, env=env)


async def _stats(stack: Stack, sid: str):
    return await stack.streams.stats(sid)


async def test_reset_and_cancel_from_the_temporal_cli(stack: Stack):
    """The README's commands: the stock CLI through the codec endpoint (the operator's token, from
    the environment), so the request is sealed and the principal's name never reaches history."""
    import os

    from mamba_stream.state_codec.codec_server import CodecServer

    model = local("tiny-mamba2")
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", text="a prefix that would colour what follows")
    codec = CodecServer(stack.keyring, port=0).start()
    env = dict(os.environ, TEMPORAL_CODEC_ENDPOINT=codec.endpoint)
    try:
        # a reset naming the wrong principal: counted, and the stats say why; nothing changes
        out = await cli(stack, "signal", "--workflow-id", sid, "--name", "reset",
                        "--input", json.dumps({"principal": "bob"}), env=env)
        assert out.returncode == 0, out.stderr
        s = await eventually(lambda: _if(stack, sid, lambda st: st.rejected_resets == 1))
        assert (s.epoch, s.position, s.resets) == (0, 39, 0) and "PrincipalMismatch" in s.last_refusal
        # in clear (no codec endpoint): refused too, whatever it names
        out = await cli(stack, "signal", "--workflow-id", sid, "--name", "reset", "--input",
                        json.dumps({"principal": "alice"}))
        assert out.returncode == 0, out.stderr
        s = await eventually(lambda: _if(stack, sid, lambda st: st.rejected_resets == 2))
        assert s.epoch == 0 and "UnsealedRequest" in s.last_refusal
        out = await cli(stack, "signal", "--workflow-id", sid, "--name", "reset",
                        "--input", json.dumps({"principal": "alice"}), env=env)
        assert out.returncode == 0, out.stderr
        s = await eventually(lambda: _if(stack, sid, lambda st: st.epoch == 1))
        assert (s.position, s.resets, s.operator_resets) == (0, 1, 1)
        after = await stack.streams.advance(sid, "alice", text="B")
        fresh = model.advance(model.initial_state(), model.transform.encode("B"))
        assert after.output_digest == digest(fresh.logits) and after.receipt.epoch == 1 and after.position == 1
        assert after.receipt.checksum == plaintext_checksum(fresh.state.tensors)

        assert stack.acts.store.list_stream(stream_id=sid)
        # a bare `temporal workflow cancel` carries no key: refused, the stream goes on
        out = await cli(stack, "cancel", "--workflow-id", sid)
        assert out.returncode == 0, out.stderr
        s = await eventually(lambda: _if(stack, sid, lambda st: st.refused_cancels == 1))
        assert not s.cancelled and stack.acts.store.list_stream(stream_id=sid)
        # the sealed `cancel` signal: the stream disposes and ends cancelled (the cancel request it
        # refused before counts now)
        out = await cli(stack, "signal", "--workflow-id", sid, "--name", "cancel",
                        "--input", json.dumps({"principal": "alice"}), env=env)
        assert out.returncode == 0, out.stderr
        with pytest.raises(WorkflowFailureError):
            await stack.streams.handle(sid).result()
    finally:
        codec.stop()
    assert stack.acts.store.list_stream(stream_id=sid) == []
    assert all(eng.slots.handle(sid) is None for eng in stack.acts.engines.values())
    with pytest.raises(Exception):  # noqa: B017 - refused, whichever way
        await stack.streams.advance(sid, "alice", text="after cancel", chunk_seq=3)
    # the query still answers: cancelled, by the operator, as the receipt left it
    s = await stack.streams.stats(sid)
    assert s.cancelled and s.cancelled_by == "operator"
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    raw = b"".join(e.SerializeToString() for e in events)
    # quoted, as JSON would carry it: a bare 3-byte word turns up in this much ciphertext by chance
    assert b'"bob"' not in raw  # the sealed signals' principal is not in history in clear


async def _if(stack: Stack, sid: str, pred):
    s = await stack.streams.stats(sid)
    return s if pred(s) else None


async def test_cancel_zeroes_the_hot_state(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba1")
    r = await stack.streams.advance(sid, "alice", tokens=[1, 2, 3, 4])
    engine = next(iter(stack.acts.engines.values()))
    assert engine.holds(sid, r.receipt.state_key)
    slot = engine.slots.handle(sid).slot
    assert any(bool(b[slot].abs().sum()) for b in engine.slots.buffers.values())
    await stack.streams.cancel(sid)
    assert all(not bool(b[slot].abs().sum()) for b in engine.slots.buffers.values())  # zeroed, then freed
    assert engine.slots.handle(sid) is None and not engine.holds(sid, r.receipt.state_key)


async def test_the_next_occupant_of_a_cancelled_streams_slot_starts_fresh(stack: Stack):
    model = local("tiny-mamba1")
    old = await stack.streams.open("alice", "tiny-mamba1")
    await stack.streams.advance(old, "alice", tokens=[9, 8, 7, 6, 5])
    engine = stack.acts.engines["tiny-mamba1"]
    slot = engine.slots.handle(old).slot
    await stack.streams.cancel(old)
    new = await stack.streams.open("bob", "tiny-mamba1")
    first = await stack.streams.advance(new, "bob", tokens=[1, 2, 3])
    assert engine.slots.handle(new).slot == slot  # the same buffers, reused
    then = await stack.streams.advance(new, "bob", tokens=[4])  # a decode step on the reused slot
    fresh = model.advance(model.initial_state(), [1, 2, 3, 4])
    assert first.output_digest == digest(fresh.logits[:3])
    assert then.output_digest == digest(fresh.logits[3:])
    assert then.receipt.checksum == plaintext_checksum(fresh.state.tensors)


async def test_checkpoint_and_resume_in_another_stream(stack: Stack):
    model = local("tiny-mamba3")
    sid = await stack.streams.open("alice", "tiny-mamba3", options=_opts(checkpoints_kept=1))
    await stack.streams.advance(sid, "alice", text="hello ")
    cp = await stack.streams.checkpoint(sid, "alice")
    # more chunks: retention keeps one checkpoint, but the pinned one stays
    for word in ("more ", "words ", "here"):
        await stack.streams.advance(sid, "alice", text=word)
    assert cp.receipt.state_key in stack.acts.store.list_stream(stream_id=sid)
    resumed = await stack.streams.open("alice", "tiny-mamba3", resume=cp.receipt)
    r = await stack.streams.advance(resumed, "alice", text="world")
    truth = model.advance(model.initial_state(), model.transform.encode("hello world"))
    assert r.receipt.checksum == plaintext_checksum(truth.state.tensors) and r.position == 11
    assert r.receipt.stream_id == resumed and r.receipt.chunk_seq == 1
    # resume also continues generation: the checkpoint carries the next-token distribution
    g = await stack.streams.generate(resumed, "alice", 2, seed=3)
    assert len(g.tokens) == 2


def _opts(**kw):
    from mamba_stream.workflows import StreamOptions

    return StreamOptions(**kw)


async def test_tenant_isolation(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2")
    first = await stack.streams.advance(sid, "alice", text="alice's secret context")
    before = await stack.streams.receipt(sid)
    attempts = {
        "advance": lambda: stack.streams.advance(sid, "bob", text="hijack", chunk_seq=2),
        "generate": lambda: stack.streams.generate(sid, "bob", 3, chunk_seq=2),
        "checkpoint": lambda: stack.streams.checkpoint(sid, "bob"),
    }
    for name, call in attempts.items():
        with pytest.raises(WorkflowUpdateFailedError) as exc:
            await call()
        assert reason(exc.value) == "PrincipalMismatch", name
    await stack.streams.reset(sid, "bob")
    await eventually(lambda: _if(stack, sid, lambda st: st.rejected_resets == 1))
    # resuming alice's checkpoint as bob fails with the reason, and leaves nothing behind
    with pytest.raises(WorkflowFailureError) as exc:
        await stack.streams.open("bob", "tiny-mamba2", resume=first.receipt)
    assert getattr(exc.value.cause, "type", None) == "PrincipalMismatch"
    assert await stack.streams.receipt(sid) == before
    s = await stack.streams.stats(sid)
    assert (s.position, s.epoch, s.chunk_seq, s.resets) == (first.position, 0, 1, 0)
    # and the store never hands bob alice's blob
    assert stack.acts.store.get(key=before.state_key, owner=stack.acts.commits.owner("bob")) is None


def _payloads(msg, out: list[Payload]) -> list[Payload]:
    """Every Payload inside a protobuf message, however deep."""
    if isinstance(msg, Payload):
        out.append(msg)
        return out
    for field, value in msg.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        if getattr(field, "is_repeated", None) or getattr(field, "label", None) == 3:  # LABEL_REPEATED
            items = value.values() if hasattr(value, "values") and not hasattr(value, "append") else value
            for item in items:
                _payloads(item, out)
        else:
            _payloads(value, out)
    return out


async def test_history_holds_no_plaintext(stack: Stack):
    secret = "SECRET-PHRASE-7531 about the vault"
    sid = await stack.streams.open("alice", "tiny-mamba2")
    r = await stack.streams.advance(sid, "alice", text=secret)
    await stack.streams.advance(sid, "alice", tokens=[111, 222, 111, 222])
    await stack.streams.generate(sid, "alice", 3, seed=1)
    await stack.streams.checkpoint(sid, "alice")
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    payloads = []
    for e in events:
        _payloads(e, payloads)
    metas = sdk_bookkeeping(events)  # the SDK's own bookkeeping, checked there
    # the three local chunks' markers; the first workflow task's patch markers and the search
    # attribute that lists each
    from mamba_stream.workflows._model_stream import START_MARKERS

    assert len(metas) == 3 + 2 * len(START_MARKERS)
    payloads = [p for p in payloads if p not in metas]
    assert len(payloads) >= 10
    assert [p for p in payloads if p.metadata.get("encoding") != ENCRYPTED_ENCODING] == []
    raw = b"".join(e.SerializeToString() for e in events)
    for needle in (secret.encode(), b"SECRET", r.receipt.state_key.encode(), r.receipt.checksum.encode(),
                   b"alice", b"principal", b"receipt"):
        assert needle not in raw, needle


async def _empty(stack: Stack, sid: str) -> bool:
    await asyncio.sleep(0)
    return stack.acts.store.list_stream(stream_id=sid) == []


def b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


async def test_malformed_update_from_the_cli_is_refused_before_history(stack: Stack):
    """Plain JSON typed into `temporal workflow update`: non-integer tokens never reach history."""
    from tests.workflows.test_stream_workflow import history_updates

    sid = await stack.streams.open("alice", "tiny-mamba1")
    before = await history_updates(stack, sid)
    for bad in ({"principal": "alice", "chunk_seq": 1, "tokens": [1.5]},
                {"principal": "alice", "chunk_seq": 1, "tokens": [1], "text": "both"},
                {"principal": "alice", "chunk_seq": 1}):
        out = await cli(stack, "update", "execute", "--workflow-id", sid, "--name", "advance",
                        "--input", json.dumps(bad))
        assert out.returncode != 0, bad
    assert await history_updates(stack, sid) == before
    # a good one, its encrypted result decoded for the CLI by our codec server
    from mamba_stream.state_codec.codec_server import CodecServer

    codec = CodecServer(stack.keyring, port=0).start()  # its token travels in `endpoint`
    try:
        ok = await cli(stack, "update", "execute", "--workflow-id", sid, "--name", "advance", "--update-id", "seq-1",
                       "--input", json.dumps({"principal": "alice", "chunk_seq": 1, "tokens": [1, 2]}),
                       "--codec-endpoint", codec.endpoint)
        assert ok.returncode == 0, ok.stderr
        assert "position:2" in ok.stdout and "checksum:blake3:" in ok.stdout  # decrypted for the CLI
        plain, sealed = b64(b"json/plain"), b64(b"binary/encrypted")  # payload encodings, as shown
        shown = await cli(stack, "show", "--workflow-id", sid, "--codec-endpoint", codec.endpoint, "--output", "json")
        assert shown.returncode == 0 and plain in shown.stdout and sealed not in shown.stdout
        hidden = await cli(stack, "show", "--workflow-id", sid, "--output", "json")
        assert hidden.returncode == 0 and sealed in hidden.stdout
        # in clear, only the SDK's bookkeeping: of the local chunk, and of the code's patches (a
        # marker and a search attribute; test_history_holds_no_plaintext)
        events = json.loads(hidden.stdout)["events"]
        for e in events:
            details = e.get("markerRecordedEventAttributes", {}).get("details", {})
            details.pop("data", None)
            details.pop("patch-data", None)
            e.pop("upsertWorkflowSearchAttributesEventAttributes", None)
        assert plain not in json.dumps(events)
    finally:
        codec.stop()
    assert (await stack.streams.stats(sid)).position == 2
