"""worker.py, the codec server and the `mamba-stream` stream commands, run for real."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from google.protobuf import json_format
from temporalio.api.common.v1 import Payload
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from mamba_stream.devserver import _running
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.state_codec import CLEAR, MASTER
from mamba_stream.state_codec.codec import Keyring
from mamba_stream.state_codec.codec_server import CodecServer
from mamba_stream.state_codec.keyring import KeyringNotFound, find_keyring
from mamba_stream.state_codec.payload import (
    ENCRYPTED_ENCODING,
    UNDECRYPTABLE_ENCODING,
    EncryptionCodec,
    StreamPayloadConverter,
    with_sealer,
)
from mamba_stream.worker import WorkerConfig, load_keyring
from mamba_stream.workflows import ClientConfig, StreamClient
from tests.workflows.conftest import Stack, eventually

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
    # decoded, each payload says who sealed it (the workers' key here; nobody's for plain JSON,
    # which passes through), over whatever it said before
    assert (await codec.decode([enc]))[0] == with_sealer(plain, MASTER)
    assert (await codec.decode([plain]))[0] == with_sealer(plain, CLEAR)
    claims = with_sealer(plain, ring.principal_tag("alice"))  # a plaintext payload claiming a key
    assert (await codec.decode([claims]))[0] == with_sealer(plain, CLEAR)
    assert (await EncryptionCodec(ring.rotate()).decode([enc]))[0] == with_sealer(plain, MASTER)
    [alices] = await EncryptionCodec(ring.for_principal("alice")).encode([claims])  # the claim is not sealed in
    assert (await codec.decode([alices]))[0] == with_sealer(plain, ring.principal_tag("alice"))
    # another keyring cannot open it: a sealed payload that refuses, typed, to become a value
    [sealed] = await EncryptionCodec(Keyring.generate()).decode([enc])
    assert sealed.metadata["encoding"] == UNDECRYPTABLE_ENCODING and b"alice" not in sealed.data
    with pytest.raises(ApplicationError) as err:
        StreamPayloadConverter().from_payloads([sealed], [dict])
    assert err.value.type == "UnknownKeyId" and err.value.non_retryable and ring.active_id in err.value.message
    tampered = Payload(metadata=enc.metadata, data=enc.data[:-1] + bytes([enc.data[-1] ^ 1]))
    [bad] = await codec.decode([tampered])
    with pytest.raises(ApplicationError) as err:
        StreamPayloadConverter().from_payloads([bad], [dict])
    assert err.value.type == "CorruptBlob"
    assert StreamPayloadConverter().from_payloads([plain], [dict]) == [{"principal": "alice"}]


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
        # the token in the path (the UI's endpoint): no header needed; another token in it is refused
        assert server.endpoint == server.url + "/t/s3cret"
        status, dec, _ = _post(server.endpoint + "/decode?preserveStorageRefs=true", enc)
        assert status == 200 and dec == body
        assert _post(server.url + "/t/s3cre/decode", enc)[0] == 401
        assert _post(server.url + "/t/s3cret", enc)[0] == 404
    finally:
        server.stop()
    # no token given: one is made, and nothing is served without it
    server = CodecServer(ring, port=0).start()
    try:
        assert len(server.token) >= 32 and _post(server.url + "/encode", body)[0] == 401
        assert _post(server.endpoint + "/encode", body)[0] == 200
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


async def test_clients_find_keyrings_and_never_make_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MAMBA_STREAM_KEYRING", raising=False)
    monkeypatch.delenv("MAMBA_STREAM_HOME", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    for cwd in (tmp_path, tmp_path / "user"):  # the default home is the user's, wherever we are
        (cwd).mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        assert WorkerConfig().home == ClientConfig().home == tmp_path / "user" / ".local" / "share" / "mamba-stream"
        with pytest.raises(KeyringNotFound) as err:
            ClientConfig().load_keyring()
        assert str(ClientConfig().home / "keyring.json") in str(err.value)
    assert not (tmp_path / "user" / ".local").exists()
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert ClientConfig().home == tmp_path / "xdg" / "mamba-stream"
    made = load_keyring(WorkerConfig())  # the worker makes it, in a 0700 directory
    assert (tmp_path / "xdg" / "mamba-stream").stat().st_mode & 0o777 == 0o700
    assert ClientConfig().load_keyring().active_id == made.active_id == find_keyring().active_id
    monkeypatch.setenv("MAMBA_STREAM_KEYRING", str(tmp_path / "missing.json"))
    with pytest.raises(Exception, match="no keyring at"):
        ClientConfig().load_keyring()
    with pytest.raises(Exception, match="no keyring at"):
        load_keyring(WorkerConfig())  # a named keyring that is not there is never made


async def test_worker_py_runs_the_embedded_stack_and_stops_cleanly(tmp_path):
    ports = {"MAMBA_STREAM_TEMPORAL_PORT": _free_port(), "MAMBA_STREAM_UI_PORT": _free_port(),
             "MAMBA_STREAM_CODEC_PORT": _free_port()}
    # no home configured: the worker's is the user's data directory, wherever it is started from
    env = {k: v for k, v in os.environ.items()
           if k not in ("TEMPORAL_ADDRESS", "MAMBA_STREAM_HOME", "MAMBA_STREAM_KEYRING", "XDG_DATA_HOME")}
    env.update({k: str(v) for k, v in ports.items()}, HOME=str(tmp_path / "user"),
               MAMBA_STREAM_MODELS="tiny-mamba1", MAMBA_STREAM_TASK_QUEUE="embedded-test",
               MAMBA_STREAM_CODEC_TOKEN="s3cr3t-token",
               MAMBA_STREAM_CODEC_PRINCIPAL_TOKENS='{"t-bob": "bob"}')
    home = tmp_path / "user" / ".local" / "share" / "mamba-stream"
    (tmp_path / "worker-dir").mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=tmp_path / "worker-dir",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while True:  # wait for "worker ... ready"
            line = proc.stdout.readline()
            assert line, "worker.py exited early:\n" + "".join(lines)
            lines.append(line)
            if " ready on " in line:
                break
        ring = Keyring.from_file(home / "keyring.json")
        client = await Client.connect(f"127.0.0.1:{ports['MAMBA_STREAM_TEMPORAL_PORT']}",
                                      plugins=[MambaStreamPlugin(keyring=ring)])
        streams = StreamClient(client, "embedded-test")
        sid = await streams.open("alice", "tiny-mamba1")
        r = await streams.advance(sid, "alice", text="embedded")
        assert r.position == 8
        assert list((home / "states" / "streams" / sid).iterdir())
        assert (home / "temporal.db").exists()
        # every stream's history is in that database: the user's alone, like the home around it
        assert stat.S_IMODE((home / "temporal.db").stat().st_mode) == 0o600
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        # the operator's token (it decodes every tenant) is in no process's command line, and the
        # UI's settings, which any browser that reaches the UI reads, name the codec server only;
        # the endpoint with the token is the operator's file, for their browser and CLI
        codec = f"http://127.0.0.1:{ports['MAMBA_STREAM_CODEC_PORT']}"
        assert _cmdlines_holding("s3cr3t-token") == []
        settings = await asyncio.to_thread(_ui_settings, ports["MAMBA_STREAM_UI_PORT"])
        assert "s3cr3t-token" not in json.dumps(settings) and settings["Codec"]["Endpoint"] == codec
        endpoint = home / "codec-endpoint"
        assert endpoint.read_text().strip() == f"{codec}/t/s3cr3t-token"
        assert stat.S_IMODE(endpoint.stat().st_mode) == 0o600
        # CORS for the UI's own port, which is not the default one here
        ui_origin = f"http://127.0.0.1:{ports['MAMBA_STREAM_UI_PORT']}"
        _, _, headers = await asyncio.to_thread(_post, codec + "/decode", {"payloads": []},
                                                {"Authorization": "Bearer s3cr3t-token", "Origin": ui_origin})
        assert headers.get("Access-Control-Allow-Origin") == ui_origin
        _, _, headers = await asyncio.to_thread(_post, codec + "/decode", {"payloads": []},
                                                {"Authorization": "Bearer s3cr3t-token",
                                                 "Origin": "http://127.0.0.1:8233"})
        assert "Access-Control-Allow-Origin" not in headers
        # the embedded codec server decodes only for its token (it used to ignore it)
        events = [e async for e in client.get_workflow_handle(sid).fetch_history_events()]
        sealed = json_format.MessageToDict(
            events[0].workflow_execution_started_event_attributes.input)  # the start input, encrypted
        assert (await asyncio.to_thread(_post, codec + "/decode", sealed))[0] == 401
        status, opened, _ = await asyncio.to_thread(_post, codec + "/decode", sealed,
                                                   {"Authorization": "Bearer s3cr3t-token"})
        assert status == 200 and b"alice" in base64.b64decode(opened["payloads"][0]["data"])
        # bob's token is valid, for bob's streams: alice's input stays closed to it
        status, closed, _ = await asyncio.to_thread(_post, codec + "/decode", sealed, {"Authorization": "Bearer t-bob"})
        assert status == 200 \
            and base64.b64decode(closed["payloads"][0]["metadata"]["encoding"]) == UNDECRYPTABLE_ENCODING
        # the real CLI, from another directory, with nothing configured but the same user: it finds
        # the worker's keyring and the stream runs (it used to make a keyring of its own there)
        cli_dir = tmp_path / "cli-dir"
        cli_dir.mkdir()
        cli_env = dict(env, TEMPORAL_ADDRESS=f"127.0.0.1:{ports['MAMBA_STREAM_TEMPORAL_PORT']}")

        async def cli(*args: str) -> dict:
            out = await asyncio.to_thread(subprocess.run, [MAMBA_STREAM, *args, "--json"], env=cli_env, cwd=cli_dir,
                                          capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        bob = (await cli("open", "--principal", "bob", "--model", "tiny-mamba1"))["stream_id"]
        assert (await cli("feed", bob, "--principal", "bob", "--text", "hi"))["position"] == 2
        assert list(cli_dir.iterdir()) == []
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        with socket.socket() as s:  # the embedded server went down with it
            assert s.connect_ex(("127.0.0.1", ports["MAMBA_STREAM_TEMPORAL_PORT"])) != 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _embedded_env(tmp_path: Path, ports: dict[str, int]) -> dict[str, str]:
    """worker.py's environment for the embedded stack on `ports`, home under tmp_path, random codec tokens."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TEMPORAL_ADDRESS", "MAMBA_STREAM_KEYRING", "MAMBA_STREAM_CODEC_TOKEN")}
    env.update({k: str(v) for k, v in ports.items()}, MAMBA_STREAM_HOME=str(tmp_path / "home"),
               MAMBA_STREAM_MODELS="tiny-mamba1", MAMBA_STREAM_TASK_QUEUE="embedded-test", MAMBA_STREAM_METRICS="off")
    return env


def _start_worker_py(env: dict[str, str], cwd: Path) -> tuple[subprocess.Popen, list[str]]:
    """`python worker.py`, once it says it is ready (its output so far)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "worker.py")], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, "worker.py exited early:\n" + "".join(lines)
        lines.append(line)
        if " ready on " in line:
            return proc, lines


def _ui_settings(ui_port: int) -> dict:
    """What the Temporal UI hands any browser that asks (no login on the dev server's UI)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/api/v1/settings", timeout=10) as r:
        return json.loads(r.read())


def _ui_codec_endpoint(ui_port: int) -> str:
    return _ui_settings(ui_port)["Codec"]["Endpoint"]


def _cmdlines_holding(secret: str) -> list[int]:
    """Pids whose command line (world-readable in /proc) holds `secret`."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if secret.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


async def _decodes(endpoint: str, ring: Keyring) -> int:
    """The status of a decode through `endpoint` (the codec server's URL with a token in its path)."""
    [sealed] = await EncryptionCodec(ring).encode([Payload(metadata={"encoding": b"json/plain"}, data=b'"x"')])
    body = json.loads(json_format.MessageToJson(sealed))
    status, opened, _ = await asyncio.to_thread(_post, endpoint + "/decode", {"payloads": [body]})
    assert status != 200 or base64.b64decode(opened["payloads"][0]["data"]) == b'"x"'
    return status


async def _gone(pid: int) -> bool:
    return not _running(pid)


async def test_a_sigkilled_worker_py_takes_its_embedded_server_along_and_the_next_starts_a_fresh_one(tmp_path):
    """Issue 25: a SIGKILLed worker.py left its dev server running; the next worker reused it, and
    the UI kept the dead worker's codec endpoint (its token refused: 401). Now a leftover of the
    home's database is replaced, the server dies with its worker, and a second worker on the same
    home while the first lives is refused. The UI names the codec server's address only; the
    operator's endpoint, token included, is the home's `codec-endpoint` file, made anew."""
    ports = {"MAMBA_STREAM_TEMPORAL_PORT": _free_port(), "MAMBA_STREAM_UI_PORT": _free_port(),
             "MAMBA_STREAM_CODEC_PORT": _free_port()}
    env, home = _embedded_env(tmp_path, ports), tmp_path / "home"
    home.mkdir(mode=0o700)
    codec_url = f"http://127.0.0.1:{ports['MAMBA_STREAM_CODEC_PORT']}"
    # a server of this home's database left by an older worker's crash (no record of it)
    leftover = subprocess.Popen(
        [str(Path(sys.executable).parent / "temporal"), "server", "start-dev", "--ip", "127.0.0.1",
         "--port", str(ports["MAMBA_STREAM_TEMPORAL_PORT"]), "--ui-port", str(ports["MAMBA_STREAM_UI_PORT"]),
         "--db-filename", str(home / "temporal.db"), "--log-level", "error",
         "--ui-codec-endpoint", f"{codec_url}/t/a-dead-workers-token"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = second = None
    try:
        await eventually(lambda: _listening(ports["MAMBA_STREAM_UI_PORT"]), timeout=30)
        assert _ui_codec_endpoint(ports["MAMBA_STREAM_UI_PORT"]).endswith("/t/a-dead-workers-token")
        first, out = await asyncio.to_thread(_start_worker_py, env, tmp_path)
        assert leftover.wait(timeout=10) is not None  # stopped, not reused
        assert any("left by a worker that is gone" in line for line in out), "".join(out)
        ring = Keyring.from_file(home / "keyring.json")
        assert _ui_codec_endpoint(ports["MAMBA_STREAM_UI_PORT"]) == codec_url  # the address, no token
        old = (home / "codec-endpoint").read_text().strip()
        assert old.startswith(codec_url + "/t/") and "a-dead-workers-token" not in old
        assert await _decodes(old, ring) == 200 and await _decodes(codec_url, ring) == 401
        server = json.loads((home / "temporal.pid").read_text())
        assert server["worker"] == first.pid and _running(server["server"])
        # a second worker on this home while the first lives: told where the server is, not given a second one
        busy = await asyncio.to_thread(subprocess.run, [sys.executable, str(ROOT / "worker.py")],
                                       env=dict(env, MAMBA_STREAM_CODEC_PORT=str(_free_port())), cwd=tmp_path,
                                       capture_output=True, text=True, timeout=60)
        assert busy.returncode == 2 and f"worker {first.pid} runs this home's embedded Temporal server" in busy.stderr
        assert f"TEMPORAL_ADDRESS=127.0.0.1:{ports['MAMBA_STREAM_TEMPORAL_PORT']}" in busy.stderr
        first.kill()  # SIGKILL: no handler runs, no finally
        first.wait()
        await eventually(lambda: _gone(server["server"]), timeout=10)
        assert not await _listening(ports["MAMBA_STREAM_TEMPORAL_PORT"])
        # the next worker on the same home: a fresh server, whose UI takes the new token alone
        second, _ = await asyncio.to_thread(_start_worker_py, env, tmp_path)
        assert _ui_codec_endpoint(ports["MAMBA_STREAM_UI_PORT"]) == codec_url
        new = (home / "codec-endpoint").read_text().strip()
        assert new.startswith(codec_url + "/t/") and new != old
        assert await _decodes(new, ring) == 200 and await _decodes(old, ring) == 401
        restarted = json.loads((home / "temporal.pid").read_text())
        assert restarted["worker"] == second.pid and restarted["server"] != server["server"]
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=30) == 0
        assert not _running(restarted["server"]) and not (home / "temporal.pid").exists()
    finally:
        for proc in (first, second, leftover):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


async def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_worker_py_will_not_take_a_port_it_did_not_start_a_server_on(tmp_path):
    ports = {"MAMBA_STREAM_TEMPORAL_PORT": _free_port(), "MAMBA_STREAM_UI_PORT": _free_port(),
             "MAMBA_STREAM_CODEC_PORT": _free_port()}
    with socket.socket() as other:  # someone else's server on the embedded server's port
        other.bind(("127.0.0.1", ports["MAMBA_STREAM_TEMPORAL_PORT"]))
        other.listen()
        out = await asyncio.to_thread(subprocess.run, [sys.executable, str(ROOT / "worker.py")],
                                      env=_embedded_env(tmp_path, ports), cwd=tmp_path, capture_output=True,
                                      text=True, timeout=60)
        assert await _listening(ports["MAMBA_STREAM_TEMPORAL_PORT"])  # left alone
    lines = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert f"127.0.0.1:{ports['MAMBA_STREAM_TEMPORAL_PORT']} (the embedded Temporal frontend's port) is taken" \
        in lines[0] and "TEMPORAL_ADDRESS" in lines[0]
    assert not (tmp_path / "home" / "temporal.pid").exists()


async def _run(stack: Stack, keyfile: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, without blocking the event loop the test's worker runs on."""
    env = dict(os.environ, TEMPORAL_ADDRESS=stack.address, MAMBA_STREAM_KEYRING=str(keyfile),
               MAMBA_STREAM_TASK_QUEUE=stack.queue)
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mamba_stream.cli", *args], env=env,
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
    again = await _cli(stack, keyfile, "feed", sid, "--principal", "alice", "--text", "hello", "--seq", "1")
    assert again == {**first, "duplicate": True}  # the same chunk is the same update id: the first result
    other = await _run(stack, keyfile, "feed", sid, "--principal", "alice", "--text", "other", "--seq", "1")
    assert other.returncode == 2 and other.stderr.startswith("error: ConflictingChunk: "), other.stderr
    second = await _cli(stack, keyfile, "feed", sid, "--principal", "alice", "--tokens", "1,2,3")
    assert second["chunk_seq"] == 2 and second["position"] == 8
    gen = await _cli(stack, keyfile, "generate", sid, "--principal", "alice", "-n", "3", "--seed", "5")
    assert len(gen["tokens"]) == 3 and gen["position"] == 11
    # for people: the text as it is sampled, then the chunk (the same chunk again: the same answer)
    shown = await _run(stack, keyfile, "generate", sid, "--principal", "alice", "-n", "3", "--seed", "5", "--seq", "3")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(gen["text"] + "\n") and "generated 3 tokens" in shown.stdout, shown.stdout
    # the token log from the CLI: chunk 3's entry, with its offset (a reader reconnects from offset + 1)
    log = await _run(stack, keyfile, "tokens", sid, "--seq", "3", "--json")
    assert log.returncode == 0, log.stderr
    [entry] = [json.loads(line) for line in log.stdout.splitlines()]
    assert entry["tokens"] == gen["tokens"] and entry["done"] and entry["chunk_seq"] == 3
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


# --- keyrings through the real CLI, from a directory other than the worker's ----------------------

MAMBA_STREAM = str(Path(sys.executable).parent / "mamba-stream")


async def _cli_elsewhere(stack: Stack, cwd: Path, env: dict[str, str],
                         *args: str) -> tuple[subprocess.CompletedProcess, float]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("MAMBA_STREAM_KEYRING", "MAMBA_STREAM_HOME", "XDG_DATA_HOME")}
    base.update(TEMPORAL_ADDRESS=stack.address, MAMBA_STREAM_TASK_QUEUE=stack.queue, **env)
    cwd.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    out = await asyncio.to_thread(subprocess.run, [MAMBA_STREAM, *args], env=base, cwd=cwd, capture_output=True,
                                  text=True, timeout=60)
    return out, time.monotonic() - t0


async def _on_queue(stack: Stack) -> list:
    return [w async for w in stack.client.list_workflows(f"TaskQueue = '{stack.queue}'")]


async def test_the_cli_without_a_keyring_says_where_it_looked_and_starts_nothing(stack: Stack, tmp_path):
    home, user = tmp_path / "no-home", tmp_path / "user"
    for env, where in (({"MAMBA_STREAM_HOME": str(home)}, home / "keyring.json"),
                       ({"HOME": str(user)}, user / ".local" / "share" / "mamba-stream" / "keyring.json")):
        out, _ = await _cli_elsewhere(stack, tmp_path / "elsewhere", env,
                                      "open", "--principal", "alice", "--model", "tiny-mamba2")
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert lines[0].startswith("error: KeyringNotFound: ") and str(where) in lines[0]
        assert "MAMBA_STREAM_KEYRING" in lines[0] and "MAMBA_STREAM_HOME" in lines[0] and "worker.py" in lines[0]
    assert not home.exists() and not user.exists() and list((tmp_path / "elsewhere").iterdir()) == []
    await asyncio.sleep(1.0)  # visibility is eventually consistent: give a stray start time to show
    assert await _on_queue(stack) == []


async def test_the_cli_with_another_keyring_is_told_at_once_and_leaves_nothing_running(stack: Stack, tmp_path):
    other = Keyring.generate()
    keyfile = tmp_path / "other.json"
    other.save(keyfile)
    out, seconds = await _cli_elsewhere(stack, tmp_path / "elsewhere", {"MAMBA_STREAM_KEYRING": str(keyfile)},
                                        "open", "--principal", "alice", "--model", "tiny-mamba2")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("error: UnknownKeyId: ") and other.active_id in lines[0] and seconds < 10
    [wf] = await eventually(lambda: _on_queue(stack))
    handle = stack.client.get_workflow_handle(wf.id)
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED  # closed, not Running
    with pytest.raises(WorkflowFailureError) as err:
        await handle.result()
    assert err.value.cause.type == "UnknownKeyId" and other.active_id in err.value.cause.message
    assert not (Path(stack.store_url.removeprefix("file://")) / "streams" / wf.id).exists()


async def test_a_chunk_under_another_keyring_is_refused_and_the_stream_goes_on(stack: Stack, tmp_path):
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", text="kept")
    other, mine = tmp_path / "other.json", tmp_path / "mine.json"
    Keyring.generate().save(other)
    stack.keyring.save(mine)
    out, seconds = await _cli_elsewhere(stack, tmp_path / "elsewhere", {"MAMBA_STREAM_KEYRING": str(other)},
                                        "feed", sid, "--principal", "alice", "--text", "lost", "--seq", "2")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: UnknownKeyId: ") and seconds < 10
    stats = await stack.streams.stats(sid)
    assert (stats.position, stats.chunk_seq) == (4, 1)  # nothing advanced
    out, _ = await _cli_elsewhere(stack, tmp_path / "elsewhere", {"MAMBA_STREAM_KEYRING": str(mine)},
                                  "feed", sid, "--principal", "alice", "--text", "more", "--seq", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["position"] == 8
