"""worker.py, the codec server and the `mamba-stream` stream commands, run for real."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.client import Client

from plugin import MambaStreamPlugin
from state_codec.codec import Keyring
from state_codec.codec_server import CodecServer
from state_codec.payload import ENCRYPTED_ENCODING, EncryptionCodec
from tests.workflows.conftest import Stack, eventually
from worker import WorkerConfig, load_keyring
from workflows import StreamClient

pytestmark = pytest.mark.asyncio(loop_scope="session")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_payload_codec_round_trip_rotation_and_passthrough():
    ring = Keyring.generate()
    codec = EncryptionCodec(ring)
    plain = Payload(metadata={"encoding": b"json/plain"}, data=b'{"principal":"alice"}')
    [enc] = await codec.encode([plain])
    assert enc.metadata["encoding"] == ENCRYPTED_ENCODING and b"alice" not in enc.data
    assert (await codec.decode([enc]))[0] == plain
    assert (await codec.decode([plain]))[0] == plain  # plain JSON from the CLI passes through
    assert (await EncryptionCodec(ring.rotate()).decode([enc]))[0] == plain
    with pytest.raises(Exception):
        await EncryptionCodec(Keyring.generate()).decode([enc])


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, {}, dict(e.headers)


async def test_codec_server_encodes_decodes_and_requires_its_token():
    ring = Keyring.generate()
    server = CodecServer(ring, port=0, token="s3cret").start()
    try:
        body = {"payloads": [{"metadata": {"encoding": base64.b64encode(b"json/plain").decode()},
                              "data": base64.b64encode(b'"hello"').decode()}]}
        status, _, _ = _post(server.url + "/encode", body)
        assert status == 401
        auth = {"Authorization": "Bearer s3cret", "Origin": "http://localhost:8233"}
        status, enc, headers = _post(server.url + "/encode", body, auth)
        assert status == 200 and headers.get("Access-Control-Allow-Origin") == "http://localhost:8233"
        meta = enc["payloads"][0]["metadata"]
        assert base64.b64decode(meta["encoding"]) == ENCRYPTED_ENCODING
        status, dec, _ = _post(server.url + "/decode", enc, auth)
        assert status == 200 and dec == body
        status, _, headers = _post(server.url + "/decode", enc, {"Authorization": "Bearer wrong"})
        assert status == 401
    finally:
        server.stop()


async def test_keyring_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBA_STREAM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MAMBA_STREAM_KEYRING", raising=False)
    generated = load_keyring(WorkerConfig())
    assert (tmp_path / "home" / "keyring.json").stat().st_mode & 0o777 == 0o600
    assert load_keyring(WorkerConfig()).active_id == generated.active_id
    ring = Keyring.generate()
    monkeypatch.setenv("MAMBA_STREAM_KEYRING", ring.to_json())
    assert load_keyring(WorkerConfig()).active_id == ring.active_id
    path = tmp_path / "ring.json"
    ring.save(path)
    monkeypatch.setenv("MAMBA_STREAM_KEYRING", str(path))
    assert load_keyring(WorkerConfig()).active_id == ring.active_id


async def test_worker_py_runs_the_embedded_stack_and_stops_cleanly(tmp_path):
    ports = {"MAMBA_STREAM_TEMPORAL_PORT": _free_port(), "MAMBA_STREAM_UI_PORT": _free_port(),
             "MAMBA_STREAM_CODEC_PORT": _free_port()}
    env = {k: v for k, v in os.environ.items() if k != "TEMPORAL_ADDRESS"}
    env.update({k: str(v) for k, v in ports.items()}, MAMBA_STREAM_HOME=str(tmp_path / "home"),
               MAMBA_STREAM_MODELS="tiny-mamba1", MAMBA_STREAM_TASK_QUEUE="embedded-test")
    env.pop("MAMBA_STREAM_KEYRING", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while True:  # wait for "worker ... ready"
            line = proc.stdout.readline()
            assert line, "worker.py exited early:\n" + "".join(lines)
            lines.append(line)
            if " ready on " in line:
                break
        ring = Keyring.from_file(tmp_path / "home" / "keyring.json")
        client = await Client.connect(f"127.0.0.1:{ports['MAMBA_STREAM_TEMPORAL_PORT']}",
                                      plugins=[MambaStreamPlugin(keyring=ring)])
        streams = StreamClient(client, "embedded-test")
        sid = await streams.open("alice", "tiny-mamba1")
        r = await streams.advance(sid, "alice", text="embedded")
        assert r.position == 8
        assert list((tmp_path / "home" / "states" / "streams" / sid).iterdir())
        assert (tmp_path / "home" / "temporal.db").exists()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        with socket.socket() as s:  # the embedded server went down with it
            assert s.connect_ex(("127.0.0.1", ports["MAMBA_STREAM_TEMPORAL_PORT"])) != 0
    finally:
        if proc.poll() is None:
            proc.kill()


async def _run(stack: Stack, keyfile: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, without blocking the event loop the test's worker runs on."""
    env = dict(os.environ, TEMPORAL_ADDRESS=stack.address, MAMBA_STREAM_KEYRING=str(keyfile),
               MAMBA_STREAM_TASK_QUEUE=stack.queue)
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "cli", *args], env=env,
                                   capture_output=True, text=True, timeout=120, cwd=ROOT)


async def _cli(stack: Stack, keyfile: Path, *args: str) -> dict:
    out = await _run(stack, keyfile, *args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


async def test_stream_commands_of_the_cli(stack: Stack, tmp_path):
    keyfile = tmp_path / "ring.json"
    stack.keyring.save(keyfile)
    sid = (await _cli(stack, keyfile, "open", "--principal", "alice", "--model", "tiny-mamba2"))["stream_id"]
    first = await _cli(stack, keyfile, "feed", sid, "--principal", "alice", "--text", "hello")
    assert first["chunk_seq"] == 1 and first["position"] == 5
    again = await _cli(stack, keyfile, "feed", sid, "--principal", "alice", "--text", "other", "--seq", "1")
    assert again == first  # the same --seq is the same update id: the first result
    second = await _cli(stack, keyfile, "feed", sid, "--principal", "alice", "--tokens", "1,2,3")
    assert second["chunk_seq"] == 2 and second["position"] == 8
    gen = await _cli(stack, keyfile, "generate", sid, "--principal", "alice", "-n", "3", "--seed", "5")
    assert len(gen["tokens"]) == 3 and gen["position"] == 11
    rec = await _cli(stack, keyfile, "receipt", sid)
    assert rec["receipt"]["position"] == 11 and rec["stats"]["chunks"] == 3
    cp_file = tmp_path / "cp.json"
    await _cli(stack, keyfile, "checkpoint", sid, "--principal", "alice", "--out", str(cp_file))
    assert cp_file.stat().st_mode & 0o777 == 0o600
    resumed = await _cli(stack, keyfile, "resume", "--principal", "alice", "--checkpoint", str(cp_file))
    assert resumed["position"] == 11 and resumed["stream_id"] != sid
    bad = await _run(stack, keyfile, "feed", sid, "--principal", "bob", "--text", "x")
    assert bad.returncode == 2 and "PrincipalMismatch" in bad.stderr
    await eventually(lambda: _alive(stack, resumed["stream_id"]))


async def _alive(stack: Stack, sid: str) -> bool:
    return (await stack.streams.stats(sid)).position == 11
