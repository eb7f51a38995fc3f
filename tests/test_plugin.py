"""MambaStreamPlugin builds on the converter and runner it is given, finds (never makes) a client's
keyring, and closes the activities it serves when its last worker stops."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Sequence

import pytest
from temporalio import activity
from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.converter import DataConverter, PayloadCodec
from temporalio.worker import UnsandboxedWorkflowRunner, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from mamba_stream.plugin import PASSTHROUGH, MambaStreamPlugin, _runner, data_converter
from mamba_stream.state_codec.keyring import Keyring, KeyringNotFound
from mamba_stream.state_codec.payload import ENCRYPTED_ENCODING, EncryptionCodec, StreamPayloadConverter
from mamba_stream.worker import start_dev_server


class Tagging(PayloadCodec):
    """A user's own codec (compression, say): marks what it encoded."""

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [Payload(metadata={"encoding": b"binary/tagged"}, data=b"T" + p.SerializeToString()) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [Payload.FromString(p.data[1:]) if p.metadata.get("encoding") == b"binary/tagged" else p
                for p in payloads]


async def test_the_converter_keeps_the_given_codec_and_adds_encryption_once():
    ring = Keyring.generate()
    conv = data_converter(ring, DataConverter(payload_codec=Tagging()))
    assert conv.payload_converter_class is StreamPayloadConverter
    [enc] = await conv.payload_codec.encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"secret"')])
    assert enc.metadata["encoding"] == ENCRYPTED_ENCODING and b"secret" not in enc.data  # theirs, then ours
    [inner] = await EncryptionCodec(ring).decode([enc])
    assert inner.metadata["encoding"] == b"binary/tagged"
    assert (await conv.payload_codec.decode([enc]))[0].data == b'"secret"'
    again = data_converter(ring, conv)  # a replayer or a second plugin: no second layer
    assert again.payload_codec is conv.payload_codec
    assert await conv.encode(["x"]) and await conv.decode(await conv.encode(["x"]), [str]) == ["x"]
    with pytest.raises(TypeError, match="CompositePayloadConverter"):
        data_converter(ring, dataclasses.replace(DataConverter.default, payload_converter_class=object))


def test_the_runner_keeps_the_given_sandbox_and_an_unsandboxed_runner():
    theirs = SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules("json"))
    mine = _runner(theirs)
    assert isinstance(mine, SandboxedWorkflowRunner)
    assert {"json", *PASSTHROUGH} <= set(mine.restrictions.passthrough_modules)
    plain = UnsandboxedWorkflowRunner()
    assert _runner(plain) is plain
    assert set(PASSTHROUGH) <= set(_runner(None).restrictions.passthrough_modules)


def test_a_client_plugin_finds_the_keyring_and_never_makes_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MAMBA_STREAM_KEYRING", raising=False)
    monkeypatch.setenv("MAMBA_STREAM_HOME", str(tmp_path / "home"))
    with pytest.raises(KeyringNotFound):
        MambaStreamPlugin()
    assert not (tmp_path / "home").exists()
    ring = Keyring.generate()
    monkeypatch.setenv("MAMBA_STREAM_KEYRING", ring.to_json())
    conv = MambaStreamPlugin().configure_client({"data_converter": DataConverter.default})["data_converter"]
    assert conv.payload_codec.keyring.active_id == ring.active_id


@activity.defn(name="plugin-test-noop")
async def _noop() -> None:
    return None


class _Acts:
    def __init__(self, worker_queue: str | None = None) -> None:
        self.closed = 0
        if worker_queue is not None:
            self.worker_queue = worker_queue

    def activities(self) -> list:
        return [_noop] if hasattr(self, "worker_queue") else []

    def close(self) -> None:
        self.closed += 1


async def test_the_activities_close_when_the_last_worker_stops():
    env = await start_dev_server()
    try:
        acts = _Acts()
        client = await Client.connect(env.client.service_client.config.target_host,
                                      plugins=[MambaStreamPlugin(keyring=Keyring.generate(), activities=acts)])
        queue = f"plugin-{uuid.uuid4().hex[:8]}"
        shared = Worker(client, task_queue=queue)
        own = Worker(client, task_queue=queue + "@own")
        async with shared:
            async with own:
                assert acts.closed == 0
            assert acts.closed == 0  # the shared queue's worker still serves them
        assert acts.closed == 1
    finally:
        await env.shutdown()


async def _pollers(client: Client, queue: str) -> int:
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    got = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace=client.namespace, task_queue=TaskQueue(name=queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY))
    return len(got.pollers)


async def test_the_own_queue_is_served_beside_and_a_worker_that_cannot_have_it_stops_and_says_why():
    env = await start_dev_server()
    try:
        queue = f"plugin-{uuid.uuid4().hex[:8]}"
        acts = _Acts(worker_queue=queue + "@own")
        target = env.client.service_client.config.target_host
        client = await Client.connect(target, plugins=[MambaStreamPlugin(keyring=Keyring.generate(), activities=acts)])
        async with Worker(client, task_queue=queue):  # nothing else: the plugin serves the own queue beside it
            while await _pollers(client, queue + "@own") == 0:
                await asyncio.sleep(0.05)
        assert acts.closed == 1

        # a worker of the own queue the plugin did not make (on a client without it): the plugin's
        # second worker cannot be registered; the first is shut down and the failure raised, not a hang
        bare = await Client.connect(target)
        acts = _Acts(worker_queue=queue + "@other")
        plugin = MambaStreamPlugin(keyring=Keyring.generate(), activities=acts)
        async with Worker(bare, task_queue=queue + "@other", activities=[_noop]):
            with pytest.raises(RuntimeError, match=r"(?i)failed creating worker"):
                async with asyncio.timeout(60), Worker(bare, task_queue=queue + "-b", plugins=[plugin]):
                    await asyncio.Event().wait()  # the worker's failure ends this
        assert acts.closed == 1
    finally:
        await env.shutdown()


def test_a_worker_throttles_heartbeats_to_the_progress_interval():
    """A streaming generate's tokens reach readers as its heartbeats: the SDK's default throttle
    (0.8 x the heartbeat timeout, up to 60 s) would show them seconds late."""
    from datetime import timedelta

    from mamba_stream.plugin import heartbeat_throttle
    from mamba_stream.workflows import PROGRESS_INTERVAL_S

    plugin = MambaStreamPlugin(keyring=Keyring.generate())
    ours = timedelta(seconds=PROGRESS_INTERVAL_S)
    assert plugin.configure_worker({"max_heartbeat_throttle_interval": timedelta(seconds=60)})[
        "max_heartbeat_throttle_interval"] == ours == heartbeat_throttle()
    shorter = timedelta(milliseconds=20)  # a worker that asked for less keeps it
    assert plugin.configure_worker(
        {"max_heartbeat_throttle_interval": shorter})["max_heartbeat_throttle_interval"] == shorter
    assert plugin.configure_worker({})["max_heartbeat_throttle_interval"] == ours


# --- every payload kind leaves encrypted (Issue 19, mutant 5) -----------------------------------

#: in every plaintext value below, so that a payload that leaves in clear is seen in its bytes
_MARK = "issue19-plaintext-marker"


def _values() -> list[tuple[object, type | None]]:
    """A value of each kind the stream converter encodes, with the type hint that decodes it."""
    from temporalio.api.common.v1 import WorkflowExecution

    from mamba_stream.workflows._models import AdvanceRequest

    return [
        (None, type(None)),
        (f"{_MARK}-bytes".encode(), bytes),
        (f"{_MARK}-str", str),
        ({"text": f"{_MARK}-dict"}, dict),
        (AdvanceRequest(principal=f"{_MARK}-pydantic", chunk_seq=3, text="hello"), AdvanceRequest),
        (WorkflowExecution(workflow_id=f"{_MARK}-proto"), WorkflowExecution),
    ]


@pytest.mark.parametrize("stream", [None, "ms-" + "0" * 32, "ms.{tag}." + "1" * 32],
                         ids=["no-stream", "master-key-stream", "principal-stream"])
async def test_every_payload_kind_the_converter_makes_is_encrypted(stream):
    """None and bytes have converters of their own (binary/null, binary/plain) beside JSON: each
    kind must leave the codec as `binary/encrypted`, with neither its value nor its original
    encoding in clear."""
    from temporalio.converter import WorkflowSerializationContext

    ring = Keyring.generate()
    conv = data_converter(ring)
    if stream is not None:
        wid = stream.format(tag=ring.principal_tag("alice"))
        conv = conv.with_context(WorkflowSerializationContext(namespace="default", workflow_id=wid))
    values = [v for v, _ in _values()]
    plain = conv.payload_converter.to_payloads(values)
    kinds = [p.metadata["encoding"] for p in plain]
    # every converter that ever encodes is exercised: the sealed one never encodes, and protobuf
    # messages go to json/protobuf, which precedes binary/protobuf
    makes = set(conv.payload_converter_class().converters) - {b"binary/undecryptable", b"binary/protobuf"}
    assert set(kinds) == makes and len(kinds) == len(values)
    assert b"binary/null" in kinds and b"binary/plain" in kinds  # the two the JSON-only tests missed

    encoded = await conv.encode(values)
    for p, kind in zip(encoded, kinds, strict=True):
        assert p.metadata["encoding"] == ENCRYPTED_ENCODING, kind
        assert set(p.metadata) <= {"encoding", "encryption-key-id", "encryption-tag"}, kind
        assert ("encryption-tag" in p.metadata) == (stream is not None and stream.startswith("ms.")), kind
        clear = p.data + b"".join(p.metadata.values())
        assert _MARK.encode() not in clear and kind not in clear, kind
    # and nothing was lost: each decodes to the value it was
    back = await conv.decode(encoded, [hint for _, hint in _values()])
    assert back == values


def test_beside_the_openai_agents_converter_our_requests_keep_our_bytes_and_are_told_who_sealed_them():
    """Where the OpenAI Agents plugin's converter is kept (both plugins on one worker), our models
    still go through our JSON converter: the same payload bytes as without it, and a request
    decoded is told who sealed it (with theirs alone, a stream workflow on that worker read every
    request as sent in clear and refused it: the README's OpenAI agent)."""
    from temporalio.contrib.openai_agents import OpenAIPayloadConverter

    from mamba_stream.state_codec import SEALER_KEY, sealer_of
    from mamba_stream.workflows import AdvanceRequest

    ring = Keyring.generate()
    openai = DataConverter(payload_converter_class=OpenAIPayloadConverter)
    theirs = data_converter(ring, openai).payload_converter_class()
    ours = data_converter(ring).payload_converter_class()
    assert isinstance(theirs, OpenAIPayloadConverter) and not isinstance(ours, OpenAIPayloadConverter)
    req = AdvanceRequest(principal="alice", chunk_seq=3, tokens=[1, 2, 3])
    [payload] = theirs.to_payloads([req])
    assert payload.SerializeToString() == ours.to_payloads([req])[0].SerializeToString()
    payload.metadata[SEALER_KEY] = b"0123abcd"
    [back] = theirs.from_payloads([payload], [AdvanceRequest])
    assert back == req and sealer_of(back) == "0123abcd"
    # a value of theirs (any other) is still converted by their converter
    assert theirs.from_payloads(theirs.to_payloads([{"a": [1, None]}]))[0] == {"a": [1, None]}
