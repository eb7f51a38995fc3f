"""What history keeps in clear (Issue 16, finding 3): failure messages and stack traces travel
encrypted, like payloads; the owner's client reads them, the server and its database do not."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowUpdateFailedError

from mamba_stream.state_codec import parse_state_key
from tests.workflows.conftest import Stack, sdk_bookkeeping

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_failure_messages_reach_history_encrypted_and_the_owner_reads_them(stack: Stack):
    sid = await stack.streams.open("alice", "tiny-mamba2")
    first = await stack.streams.advance(sid, "alice", tokens=[1, 2])
    key = first.receipt.state_key
    # lost: the next chunk's activity fails, naming the key and the store
    stack.acts.store.delete(key=key, stream_id=sid, owner=stack.acts.commits.owner("alice"))
    stack.acts.release_stream(sid)
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await stack.streams.advance(sid, "alice", tokens=[3])
    assert err.value.cause.type == "CheckpointNotFound" and key in err.value.cause.message  # decrypted here
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    failed = [e for e in events if e.HasField("workflow_execution_update_completed_event_attributes")
              and e.workflow_execution_update_completed_event_attributes.outcome.HasField("failure")]
    assert failed, "the update's failure is in history"
    failure = failed[-1].workflow_execution_update_completed_event_attributes.outcome.failure
    # the clear stand-in names the type, which is in clear beside it anyway
    assert failure.message == "Encoded failure: CheckpointNotFound" and failure.HasField("encoded_attributes")
    assert failure.application_failure_info.type == "CheckpointNotFound"
    raw = b"".join(e.SerializeToString() for e in events)
    store_path = stack.store_url.removeprefix("file://").encode()
    assert key.encode() not in raw and store_path not in raw and b"Traceback" not in raw


async def _epoch(stack: Stack, sid: str, epoch: int):
    s = await stack.streams.stats(sid)
    return s if s.epoch == epoch else None


async def _resumes_at(stack: Stack, receipt) -> int | None:
    """The position a stream opened from `receipt` starts at; None when the checkpoint is gone."""
    from temporalio.client import WorkflowFailureError

    try:
        sid = await stack.streams.open("alice", "tiny-mamba2", resume=receipt)
    except WorkflowFailureError as err:
        assert err.cause.type == "CheckpointNotFound", err.cause
        return None
    return (await stack.streams.stats(sid)).position


@pytest.mark.parametrize("opened", ["fresh", "resumed"])
async def test_a_revoking_reset_deletes_every_checkpoint_of_the_earlier_epochs(stack: Stack, opened: str):
    """Every kind of checkpoint a stream holds: its open one (a resumed stream's holds the state it
    resumed, another stream's secret), chunks (handed out in results), pinned ones, and an earlier
    reset's. A reset without revoke keeps them all resumable; one with revoke leaves nothing of the
    earlier epochs in the store, and none of them resumes."""
    from tests.workflows.conftest import eventually

    resume = None
    if opened == "resumed":
        src = await stack.streams.open("alice", "tiny-mamba2")
        resume = (await stack.streams.advance(src, "alice", text="the principal's secret")).receipt
    sid = await stack.streams.open("alice", "tiny-mamba2", resume=resume)
    held = {"open": (await stack.streams.checkpoint(sid, "alice")).receipt}  # pins the open checkpoint
    assert held["open"].chunk_seq == 0 and held["open"].position == (resume.position if resume else 0)
    held["chunk"] = (await stack.streams.advance(sid, "alice", text=" one")).receipt
    held["pinned"] = (await stack.streams.checkpoint(sid, "alice")).receipt
    held["later chunk"] = (await stack.streams.advance(sid, "alice", text=" two")).receipt
    await stack.streams.reset(sid, "alice")  # epoch 1, nothing revoked
    await eventually(lambda: _epoch(stack, sid, 1))
    held["reset"] = (await stack.streams.checkpoint(sid, "alice")).receipt
    assert held["reset"].epoch == 1 and held["reset"].position == 0
    held["epoch 1 chunk"] = (await stack.streams.advance(sid, "alice", text=" three")).receipt
    keys = set(stack.acts.store.list_stream(stream_id=sid))
    assert {r.state_key for r in held.values()} <= keys
    for what in ("open", "pinned", "reset"):  # the documented default: they still resume
        assert await _resumes_at(stack, held[what]) == held[what].position, what

    await stack.streams.reset(sid, "alice", revoke=True)  # epoch 2
    await eventually(lambda: _epoch(stack, sid, 2))
    left = stack.acts.store.list_stream(stream_id=sid)
    assert left, "the new epoch's reset checkpoint is stored"
    for key in left:  # checkpoints and their result records (`<key>.out`) alike
        parsed = parse_state_key(key.removesuffix(".out"))
        assert parsed is not None and parsed.stream_id == sid and parsed.epoch == 2, key
    for what, receipt in held.items():
        assert await _resumes_at(stack, receipt) is None, what
    after = await stack.streams.advance(sid, "alice", tokens=[1])
    assert after.position == 1 and after.receipt.epoch == 2


def _payloads(events) -> list:
    """Every payload in a history: inputs, results, failures' encoded attributes, queries aside."""
    out = []

    def walk(msg) -> None:
        for field, value in msg.ListFields():
            if field.message_type is None:
                continue
            if hasattr(value, "ListFields"):
                items = [value]
            elif hasattr(value, "keys"):  # a map: its values
                items = list(value.values())
            else:
                items = list(value)
            for item in items:
                if not hasattr(item, "ListFields"):
                    continue
                if field.message_type.full_name == "temporal.api.common.v1.Payload":
                    out.append(item)
                else:
                    walk(item)

    for e in events:
        walk(e)
    return out


async def test_a_principal_keyring_reads_its_own_streams_and_no_one_elses(stack: Stack):
    """Issue 16, finding 1: every client could decrypt every tenant's history."""
    from temporalio.client import Client
    from temporalio.exceptions import ApplicationError

    from mamba_stream.plugin import MambaStreamPlugin
    from mamba_stream.state_codec.payload import UNDECRYPTABLE_ENCODING, EncryptionCodec
    from mamba_stream.workflows import StreamClient

    rings = {p: stack.keyring.for_principal(p) for p in ("alice", "bob")}
    clients = {p: StreamClient(await Client.connect(stack.address, plugins=[MambaStreamPlugin(keyring=r)]),
                               stack.queue) for p, r in rings.items()}
    sid = await clients["alice"].open("alice", "tiny-mamba2")
    tag = stack.keyring.principal_tag("alice")
    assert sid.startswith(f"ms.{tag}.") \
        and rings["alice"].principal_tag("alice") == tag != stack.keyring.principal_tag("bob")
    secret = "alice's password is hunter2; "
    res = await clients["alice"].advance(sid, "alice", text=secret)
    assert (await clients["alice"].stats(sid)).position == res.position == len(secret.encode())
    # bob's client: alice's query results are refused typed, not shown
    for query in (clients["bob"].stats, clients["bob"].receipt):
        with pytest.raises(ApplicationError) as err:
            await query(sid)
        assert err.value.type == "UnknownKeyId" and "another principal's history key" in err.value.message
    # bob writing to alice's stream: refused (his request is under his own key, which the workers
    # derive and tell from alice's), and the refusal's message and details are under alice's key:
    # bob's client gets its type, in clear anyway, and nothing else
    from temporalio.client import WorkflowUpdateFailedError

    from mamba_stream.workflows import AdvanceRequest, MambaStreamWorkflow

    with pytest.raises(WorkflowUpdateFailedError) as failed:
        await clients["bob"].handle(sid).execute_update(
            MambaStreamWorkflow.advance, AdvanceRequest(principal="bob", chunk_seq=2, text="hijack"), id="bob-1")
    cause = failed.value.cause
    assert cause.type == "SealerMismatch" and cause.message == "Encoded failure: SealerMismatch" and not cause.details
    assert (await clients["alice"].stats(sid)).chunk_seq == 1  # nothing advanced
    # the raw history, decoded with each keyring
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    metas = sdk_bookkeeping(events)  # the SDK's bookkeeping (the local chunk's, the patch's), checked there
    payloads = [p for p in _payloads(events) if p not in metas]
    assert len(payloads) >= 4
    for who, ring in (("bob", rings["bob"]), ("alice", rings["alice"]), ("workers", stack.keyring)):
        opened = await EncryptionCodec(ring).decode(payloads)
        readable = [p for p in opened if p.metadata.get("encoding") != UNDECRYPTABLE_ENCODING]
        text = b"".join(p.data for p in readable)
        if who == "bob":
            assert readable == [] and all(p.metadata["reason"] == b"UnknownKeyId" for p in opened)
        else:
            assert len(readable) == len(payloads) and b"hunter2" in text, who
    # bob's own stream works with his keyring, and alice's client cannot read it either
    mine = await clients["bob"].open("bob", "tiny-mamba2")
    assert (await clients["bob"].advance(mine, "bob", tokens=[1, 2])).position == 2
    with pytest.raises(ApplicationError):
        await clients["alice"].stats(mine)


async def test_the_codec_server_decodes_only_its_tokens_principals(stack: Stack):
    import base64
    import json
    import re
    import urllib.request

    from google.protobuf import json_format
    from temporalio.api.common.v1 import Payloads

    from mamba_stream.state_codec.codec_server import CodecServer

    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", text="alice's secret")
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    body = json_format.MessageToJson(Payloads(payloads=_payloads(events))).encode()
    server = CodecServer(stack.keyring, port=0, token="operator", principal_tokens={"t-alice": "alice", "t-bob": "bob"})
    server.start()
    try:
        def decode(token: str | None) -> tuple[int, list[dict]]:
            req = urllib.request.Request(server.url + "/decode", data=body, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {token}"} if token else {})})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, json.loads(r.read())["payloads"]
            except urllib.error.HTTPError as e:
                return e.code, []

        def opened(payloads: list[dict]) -> bytes:
            undecryptable = base64.b64encode(b"binary/undecryptable").decode()
            return b"".join(base64.b64decode(p.get("data", "")) for p in payloads
                            if p["metadata"].get("encoding") != undecryptable)

        assert decode(None)[0] == 401 and decode("t-carol")[0] == 401
        for token, reads in (("operator", True), ("t-alice", True), ("t-bob", False)):
            status, payloads = decode(token)
            assert status == 200 and (b"alice's secret" in opened(payloads)) is reads, token
        # the real Temporal CLI, through the codec endpoint of each token
        import asyncio
        import subprocess

        from mamba_stream.worker import temporal_binary

        for token, reads in (("t-alice", True), ("t-bob", False)):
            shown = await asyncio.to_thread(subprocess.run, [
                temporal_binary(), "workflow", "show", "--workflow-id", sid, "--address", stack.address,
                "--codec-endpoint", f"{server.url}/t/{token}", "--output", "json"],
                capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0, shown.stderr
            # the CLI prints payloads as protobuf JSON: their data in base64
            datas = re.findall(r'"data":\s*"([A-Za-z0-9+/=]+)"', shown.stdout)
            assert datas and (any(b"alice's secret" in base64.b64decode(d) for d in datas)) is reads, token
    finally:
        server.stop()


async def test_export_keys_writes_one_principals_keyring(stack: Stack, tmp_path):
    import asyncio
    import os
    import stat
    import subprocess
    import sys

    from mamba_stream.state_codec.keyring import Keyring

    master = tmp_path / "master.json"
    stack.keyring.rotate().save(master)  # two key ids: both exported, so rotation keeps history readable
    out = tmp_path / "alice.json"
    env = dict(os.environ, MAMBA_STREAM_KEYRING=str(master))
    run = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mamba_stream.cli", "export-keys", "alice",
                                                   "--out", str(out)],
                                  env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    ring = Keyring.from_file(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and ring.principal == "alice" and len(ring.ids) == 2
    full = Keyring.from_file(master)
    tag = full.principal_tag("alice")
    assert ring.tag == tag == stack.keyring.principal_tag("alice")  # rotation keeps the tag
    assert all(ring.key(k) == full.history_key(k, tag) != full.key(k) for k in full.ids)
    again = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mamba_stream.cli", "export-keys", "bob",
                                                     "--out", str(out)],
                                    env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1  # never overwrites
    # a principal's keyring cannot derive another's, nor serve as a worker's
    with pytest.raises(Exception):  # noqa: B017 - refused, whichever way
        ring.for_principal("bob")
    from mamba_stream.worker import WorkerConfig, load_keyring

    cfg = WorkerConfig()
    cfg.keyring = str(out)
    with pytest.raises(Exception, match="master keyring"):
        load_keyring(cfg)
