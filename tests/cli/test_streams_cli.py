"""The stream commands of `mamba-stream` as a person meets them (issue 28, item 5), each run for real:
the CLI in a subprocess, against a real Temporal dev server and a real worker."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus

from mamba_stream.activities import StreamActivities
from mamba_stream.cli._streams import add_stream_commands
from mamba_stream.worker import WorkerConfig
from mamba_stream.workflows import ClientConfig, OpenFailed, StreamClient, StreamOptions
from tests.workflows import conftest as workflow_fixtures
from tests.workflows.conftest import Stack, eventually, make_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")
# the real dev server and a worker stack per test, as tests/workflows/ has them (a conftest there only)
temporal_env = workflow_fixtures.temporal_env
stack = workflow_fixtures.stack
ROOT = Path(__file__).resolve().parents[2]
STREAM_ID = re.compile(r"ms[.-][0-9a-f.]+")
#: every subcommand add_stream_commands adds
COMMANDS = ("open", "feed", "generate", "tokens", "receipt", "reset", "rewind", "cancel", "list", "checkpoint",
            "resume", "sweep", "rekey-store", "codec-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(stack: Stack, keyfile: Path, **extra: str | None) -> dict[str, str]:
    """The CLI's environment: this test's server, queue and keyring; `extra` over it (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAMBA_STREAM_TEMPORAL_PORT", "MAMBA_STREAM_MODELS")}
    env.update(TEMPORAL_ADDRESS=stack.address, MAMBA_STREAM_KEYRING=str(keyfile), MAMBA_STREAM_TASK_QUEUE=stack.queue,
               COLUMNS="400")  # help on one line per option: no hyphen of a model id wrapped away
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


async def _run(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The real CLI in a subprocess, off the event loop the test's worker runs on; and its seconds."""
    t0 = time.monotonic()
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mamba_stream.cli", *args], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=120)
    return out, time.monotonic() - t0


async def _json(env: dict[str, str], *args: str) -> dict | list:
    out, _ = await _run(env, *args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr
    return lines[0]


def _keyfile(stack: Stack, tmp_path: Path) -> Path:
    path = tmp_path / "ring.json"
    stack.keyring.save(path)
    return path


# --- open with no worker ------------------------------------------------------------------------------


async def test_open_with_no_worker_prints_the_id_fails_fast_and_leaves_no_stream_running(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)  # nobody polls its queue
    async with stack.exits:
        env = _env(stack, _keyfile(stack, tmp_path))
        out, seconds = await _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2",
                                  "--worker-timeout", "2")
        line = _one_error_line(out)
        sid = out.stdout.strip()
        assert STREAM_ID.fullmatch(sid), out.stdout  # the id, alone on stdout
        assert line.startswith(f"error: OpenFailed: no worker took stream {sid} within 2 s: none polls task "
                               f"queue '{stack.queue}'") and "python worker.py" in line, line
        # the wait, the interpreter's start and a connect, on a loaded machine (it used to hang for good)
        assert seconds < 2 + 20, seconds
        # terminated, not left Running: no worker ever ran it, so nothing of it is stored
        desc = await stack.client.get_workflow_handle(sid).describe()
        assert desc.status == WorkflowExecutionStatus.TERMINATED
        assert not (Path(stack.store_url.removeprefix("file://")) / "streams" / sid).exists()
        # --json names the stream, not opened
        out, _ = await _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--worker-timeout", "0.5",
                            "--json")
        assert _one_error_line(out).startswith("error: OpenFailed: ")
        got = json.loads(out.stdout)
        assert got["opened"] is False and STREAM_ID.fullmatch(got["stream_id"]) and got["stream_id"] != sid
        # the default bound, for the CLI and the library: about 10 s
        assert inspect.signature(StreamClient.open).parameters["worker_timeout_s"].default == 10.0
        running = [w async for w in stack.client.list_workflows(
            f"TaskQueue = '{stack.queue}' AND ExecutionStatus = 'Running'")]
        assert running == []


async def test_open_waits_for_a_late_worker_when_told_to(temporal_env, tmp_path):
    """The library keeps the longer wait: `worker_timeout_s=None` waits for a worker however long
    it takes to come, where a bounded open has failed meanwhile (typed, the stream terminated)."""
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        patient = asyncio.ensure_future(stack.streams.open("alice", "tiny-mamba2", worker_timeout_s=None))
        with pytest.raises(OpenFailed) as err:
            await stack.streams.open("alice", "tiny-mamba2", worker_timeout_s=0.5)
        details = err.value.details()
        assert details["task_queue"] == stack.queue and details["waited_s"] >= 0.5
        assert (await stack.client.get_workflow_handle(details["stream_id"]).describe()).status == \
            WorkflowExecutionStatus.TERMINATED
        assert not patient.done()  # still waiting, past the bound the other one failed at
        await stack.worker(stack.acts)
        sid = await asyncio.wait_for(patient, 30)
        assert (await stack.streams.stats(sid)).position == 0
        assert (await stack.client.get_workflow_handle(sid).describe()).status == WorkflowExecutionStatus.RUNNING


async def test_a_bounded_open_waits_on_while_a_worker_polls_the_queue(temporal_env, tmp_path):
    """The bound is for a queue nobody polls: where a worker polled lately (a busy one, which takes
    a new stream late), a bounded open waits past it, and opens once the worker comes to it."""
    from datetime import timedelta

    from temporalio.api.enums.v1 import TaskQueueKind
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import PollWorkflowTaskQueueRequest
    from temporalio.service import RPCError

    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        # a poll that takes nothing (there is nothing yet) and gives up, as a worker whose task slots
        # are full stops polling: the server has seen a poller (3 s: a long poll's shortest)
        try:
            took = await stack.client.workflow_service.poll_workflow_task_queue(PollWorkflowTaskQueueRequest(
                namespace=stack.client.namespace, identity="busy-worker",
                task_queue=TaskQueue(name=stack.queue, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL)),
                timeout=timedelta(seconds=3))
        except RPCError:  # the server may let the poll run out instead of answering it empty
            took = None
        assert took is None or not took.task_token
        bounded = asyncio.ensure_future(stack.streams.open("alice", "tiny-mamba2", worker_timeout_s=0.5))
        await asyncio.sleep(2.0)  # four times the bound: what is checked is that nothing happened
        assert not bounded.done()
        await stack.worker(stack.acts)
        sid = await asyncio.wait_for(bounded, 30)
        assert (await stack.streams.stats(sid)).position == 0


async def test_an_open_its_caller_gives_up_on_leaves_no_stream_running(temporal_env, tmp_path):
    """Cancelled while no worker has the stream (a Ctrl-C, a wait_for): terminated, not left waiting
    Running under an id nobody was told."""
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stack.streams.open("alice", "tiny-mamba2", worker_timeout_s=None), 1.0)
        [wf] = await eventually(lambda: _on_queue(stack))
        assert (await stack.client.get_workflow_handle(wf.id).describe()).status == WorkflowExecutionStatus.TERMINATED


async def _on_queue(stack: Stack) -> list:
    return [w async for w in stack.client.list_workflows(f"TaskQueue = '{stack.queue}'")]


# --- a client configured like the worker ----------------------------------------------------------------


async def test_a_client_configured_like_the_worker_finds_its_server_and_a_refused_one_says_what_to_set(
        stack: Stack, tmp_path):
    port = stack.address.rsplit(":", 1)[1]
    assert ClientConfig(address=None, temporal_port=int(port)).target == f"127.0.0.1:{port}"
    assert ClientConfig(address="elsewhere:7233", temporal_port=int(port)).target == "elsewhere:7233"
    # no TEMPORAL_ADDRESS: the embedded server's port, as worker.py reads it
    env = _env(stack, _keyfile(stack, tmp_path), TEMPORAL_ADDRESS=None, MAMBA_STREAM_TEMPORAL_PORT=port)
    sid = (await _json(env, "open", "--principal", "alice", "--model", "tiny-mamba2"))["stream_id"]
    assert (await _json(env, "feed", sid, "--principal", "alice", "--text", "hi"))["position"] == 2
    # nothing there: one line that says what to set, no transport error
    nowhere = str(_free_port())
    refused, _ = await _run(dict(env, MAMBA_STREAM_TEMPORAL_PORT=nowhere), "feed", sid, "--principal", "alice",
                            "--text", "hi")
    line = _one_error_line(refused)
    assert line.startswith(f"error: Unreachable: no Temporal server at 127.0.0.1:{nowhere} (connection refused): ")
    assert all(w in line for w in ("TEMPORAL_ADDRESS", "MAMBA_STREAM_TEMPORAL_PORT", "python worker.py")), line
    assert "tonic" not in line and "transport" not in line.lower()
    assert refused.stdout == ""
    # TEMPORAL_ADDRESS, when set, is the server, whatever the port says
    out = await _json(dict(env, MAMBA_STREAM_TEMPORAL_PORT=nowhere, TEMPORAL_ADDRESS=stack.address), "receipt", sid)
    assert out["receipt"]["position"] == 2


# --- Ctrl-C during a streamed generate ----------------------------------------------------------------


class GatedSampling(StreamActivities):
    """A generate whose decode steps stop after the first few, until the test opens the gate: the
    chunk cannot commit before the CLI has left, however loaded the machine (a 4 s chunk of 10 ms
    steps, then a 20 s one of 50 ms steps, each committed first on a saturated machine)."""

    gate = threading.Event()
    open_steps = 8

    def engine(self, model):  # the base class's engine, its decode steps held at the gate
        eng = super().engine(model)
        if not getattr(eng, "_gated", False):
            inner, steps = eng.slots.step, [0]

            def step(handles, tokens):
                steps[0] += 1
                if steps[0] > self.open_steps:
                    self.gate.wait(120)  # bounded: a test that fails never leaves the engine held
                return inner(handles, tokens)

            eng.slots.step = step
            eng._gated = True
        return eng


#: the start of a command line that a test interrupts with SIGINT: SIGINT back to its default first.
#: A test run started in the background by a shell without job control (`cmd &` in a script) ignores
#: SIGINT and passes that on, and Python leaves an ignored SIGINT ignored: the command would never see
#: the test's Ctrl-C. (Saturated runs of the suite started so failed the Ctrl-C tests: the CLI went
#: on, its SIGINT ignored.)
WITH_SIGINT = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"]


async def test_ctrl_c_during_a_streamed_generate_says_where_the_result_will_be(temporal_env, tmp_path):
    GatedSampling.gate.clear()
    stack = await make_stack(temporal_env, tmp_path, acts_cls=GatedSampling)
    async with stack.exits:
        # a command still here 10 s after Ctrl-C leaves anyway (`_leave_if_stuck`), first printing
        # the stacks of the tasks it waited on (MAMBA_STREAM_DEBUG): this test then fails with them
        env = _env(stack, _keyfile(stack, tmp_path), PYTHONFAULTHANDLER="1", MAMBA_STREAM_DEBUG="1")
        sid = await stack.streams.open("alice", "tiny-mamba2")
        await stack.streams.advance(sid, "alice", text="Once upon a time")
        proc = await asyncio.to_thread(
            subprocess.Popen, [*WITH_SIGINT, "-m", "mamba_stream.cli", "generate", sid, "--principal", "alice",
                               "-n", "40", "--seed", "3"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            first = await asyncio.to_thread(proc.stdout.read, 1)  # its first tokens are on the screen
            assert first, proc.stderr.read().decode()
            proc.send_signal(signal.SIGINT)
            # the command leaves while the chunk is held: it does not wait for the chunk it no longer
            # shows (it used to retry its update until the chunk committed)
            try:
                code = await asyncio.to_thread(proc.wait, 60)
            except subprocess.TimeoutExpired:
                # where it hangs (seen once, in a saturated CI run): every thread's stack, by faulthandler
                proc.send_signal(signal.SIGABRT)
                await asyncio.to_thread(proc.wait, 30)
                raise AssertionError(f"the CLI did not leave within 60 s of Ctrl-C:\n"
                                     f"{proc.stderr.read().decode()[-6000:]}") from None
            err = proc.stderr.read().decode()
            assert (await stack.streams.stats(sid)).chunk_seq == 1
        finally:
            GatedSampling.gate.set()
            if proc.poll() is None:
                proc.kill()
        assert code == 130, err
        # one line: which chunk is in flight, what becomes of it, what waits behind it, where its result is
        assert err.strip().splitlines() == [(
            f"interrupted: chunk 2 is still in flight: it commits on the worker unless the stream is cancelled, "
            f"and a feed or generate without --seq waits behind it; its result: "
            f"mamba-stream tokens {sid} --seq 2")], err
        # it did: the chunk commits, whole, and the command named gets its result
        await eventually(lambda: _committed(stack, sid, 2), timeout=90)
        [entry] = [json.loads(line) for line in (await _ok(env, "tokens", sid, "--seq", "2", "--json")).splitlines()]
        assert entry["done"] and entry["chunk_seq"] == 2 and len(entry["tokens"]) == 40


STUCK_COMMAND = """
import asyncio, sys
import mamba_stream.cli._streams as streams

streams.INTERRUPT_GRACE_S = 1.0


async def stuck(args):
    while True:  # a command that does not stop when cancelled
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass


async def main():
    print("ready", flush=True)
    return await stuck(None)

sys.exit(streams._run(lambda args: main())(None))
"""


def test_a_command_that_does_not_stop_after_ctrl_c_leaves_within_the_grace_and_says_so():
    proc = subprocess.Popen([*WITH_SIGINT, "-c", STUCK_COMMAND], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "MAMBA_STREAM_DEBUG": "1"})
    try:
        assert proc.stdout.readline() == b"ready\n"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    assert code == 130 and took < 20, (code, took, err)
    lines = err.strip().splitlines()
    assert lines[-1] == "interrupted: the command did not stop within 1 s of Ctrl-C; leaving", err
    assert "in stuck" in err  # the stuck task's stack, for the record (MAMBA_STREAM_DEBUG)


async def _committed(stack: Stack, sid: str, seq: int) -> bool:
    return (await stack.streams.stats(sid)).chunk_seq == seq


async def _ok(env: dict[str, str], *args: str) -> str:
    out, _ = await _run(env, *args)
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- help, list, cancel -----------------------------------------------------------------------------------


def _parsers() -> dict[str, argparse.ArgumentParser]:
    sub = argparse.ArgumentParser(prog="mamba-stream").add_subparsers()
    add_stream_commands(sub)
    return dict(sub.choices)


def _flat(text: str) -> str:
    return " ".join(text.split())


async def test_every_stream_command_describes_every_option_and_the_top_level_lists_the_models(
        stack: Stack, tmp_path, monkeypatch):
    monkeypatch.delenv("MAMBA_STREAM_MODELS", raising=False)  # the defaults, here as in the CLI's environment
    parsers = _parsers()
    assert set(parsers) == set(COMMANDS)
    env = _env(stack, _keyfile(stack, tmp_path))
    helps = await asyncio.gather(*(_run(env, cmd, "--help") for cmd in COMMANDS))
    for cmd, (out, _) in zip(COMMANDS, helps, strict=True):
        assert out.returncode == 0, out.stderr
        shown = _flat(out.stdout)
        for action in parsers[cmd]._actions:
            described = str(action.help or "").strip()
            assert described, f"{cmd}: {action.option_strings or action.dest} has no help"
            # what the real command shows: the description's first words
            assert _flat(described.split("%")[0])[:30] in shown, (cmd, action.dest, shown)
    # the top level lists the models the workers serve: the worker's default when nothing says otherwise
    top = _flat(await _ok(env, "--help"))
    default = ", ".join(ClientConfig(models=WorkerConfig().models).model_ids())
    assert "tiny-mamba2" in default and f"open a stream on a model: {default}" in top, top
    assert "a worker may serve others" in top
    assert "list the streams on the server: id, status, start time" in top
    mine = _flat(await _ok(dict(env, MAMBA_STREAM_MODELS="tiny-mamba1, mine=/models/mine#bfloat16"), "--help"))
    assert "open a stream on a model: tiny-mamba1, mine (from MAMBA_STREAM_MODELS; a worker may serve others)" in mine
    model_help = _flat(await _ok(dict(env, MAMBA_STREAM_MODELS="tiny-mamba3"), "open", "--help"))
    assert "--model MODEL the model's id: tiny-mamba3 (from MAMBA_STREAM_MODELS" in model_help


async def test_list_cancel_and_the_errors_of_a_missing_or_cancelled_stream(stack: Stack, tmp_path):
    env = _env(stack, _keyfile(stack, tmp_path))
    kept, gone = await asyncio.gather(*(_json(env, "open", "--principal", "alice", "--model", "tiny-mamba2")
                                         for _ in range(2)))
    kept, gone = kept["stream_id"], gone["stream_id"]
    assert (await _ok(env, "cancel", gone)).strip() == f"{gone} cancelled: its state is deleted"
    assert (await stack.client.get_workflow_handle(gone).describe()).status == WorkflowExecutionStatus.CANCELED
    store = Path(stack.store_url.removeprefix("file://")) / "streams" / gone
    assert not store.exists() or not any(store.rglob("*"))

    async def listed() -> list | None:  # visibility is eventually consistent
        rows = await _json(env, "list")
        return rows if {r["stream_id"]: r["status"] for r in rows} == {kept: "running", gone: "canceled"} else None

    rows = await eventually(listed, timeout=30)
    assert all(r["task_queue"] == stack.queue and r["start_time"] for r in rows)
    assert [r["stream_id"] for r in await _json(env, "list", "--running")] == [kept]
    human = (await _ok(env, "list")).splitlines()
    assert sorted(line.split()[:2] for line in human) == sorted([[kept, "running"], [gone, "canceled"]])
    # errors name what is wrong with the stream, not the RPC that found it
    nowhere = "ms-" + "0" * 32
    outs = await asyncio.gather(
        _run(env, "feed", nowhere, "--principal", "alice", "--text", "x"),
        _run(env, "receipt", nowhere),
        _run(env, "feed", gone, "--principal", "alice", "--text", "x"),
        _run(env, "generate", gone, "--principal", "alice", "-n", "2"),
        _run(env, "cancel", gone))
    lines = [_one_error_line(out) for out, _ in outs]
    assert lines[:2] == [f"error: NoSuchStream: no such stream: {nowhere}"] * 2, lines
    assert lines[2:] == [f"error: StreamCancelled: the stream was cancelled: {gone}"] * 3, lines


async def test_list_shows_the_streams_agents_own_and_no_other_workflow(stack: Stack, tmp_path):
    """An agent's stream is the agent's workflow (`ModelStream.open` marks it in its memo): `list`
    shows it beside the stream workflows, naming its type; a workflow of the queue that owns no
    stream is not listed."""
    from mamba_stream.workflows import ChatAgent, ChatInput, ChatMessage

    env = _env(stack, _keyfile(stack, tmp_path))
    sid = (await _ok(env, "open", "--principal", "alice", "--model", "tiny-mamba2")).strip()
    agent_id = stack.streams.new_id("alice")
    agent = await stack.client.start_workflow(ChatAgent.run, ChatInput(principal="alice", model_id="tiny-mamba2",
                                                                       reply_tokens=2), id=agent_id,
                                              task_queue=stack.queue)
    await agent.execute_update(ChatAgent.say, ChatMessage(principal="alice", text="hi"))
    # a workflow of the queue that owns no stream: started, never taken (no worker has its type)
    await stack.client.start_workflow("NotAStream", id=f"other-{agent_id}", task_queue=stack.queue)

    async def listed() -> list | None:  # visibility is eventually consistent
        rows = await _json(env, "list")
        return rows if {r["stream_id"] for r in rows} == {sid, agent_id} else None

    rows = {r["stream_id"]: r for r in await eventually(listed, timeout=30)}
    assert (rows[sid]["workflow_type"], rows[agent_id]["workflow_type"]) == ("MambaStream", "ChatAgent")
    human = dict(line.split(None, 1) for line in (await _ok(env, "list")).splitlines())
    assert human[agent_id].endswith("(owned by ChatAgent)") and "owned by" not in human[sid]
    # the memo says which model, encrypted as every payload: in clear, only that a stream is there
    from temporalio.api.enums.v1 import EventType

    from mamba_stream.state_codec.payload import ENCRYPTED_ENCODING

    memos = [e.workflow_properties_modified_event_attributes.upserted_memo.fields async for e in
             agent.fetch_history_events() if e.event_type == EventType.EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED]
    assert [(list(m), m["mamba_stream"].metadata["encoding"]) for m in memos] \
        == [(["mamba_stream"], ENCRYPTED_ENCODING)]
    assert b"tiny-mamba2" not in memos[0]["mamba_stream"].data
    await agent.execute_update(ChatAgent.say, ChatMessage(principal="alice"))  # the end: disposed
    await agent.result()
    await stack.client.get_workflow_handle(f"other-{agent_id}").terminate()


async def test_list_says_why_a_refused_open_failed_its_stream(stack: Stack, tmp_path):
    """A refused open fails its run, typed: `list` says why on the stream's line."""
    env = _env(stack, _keyfile(stack, tmp_path))
    out, _ = await _run(env, "open", "--principal", "alice", "--model", "no-such-model")
    assert out.returncode == 2 and out.stderr.startswith("error: UnknownModel: "), out.stderr

    async def listed() -> list | None:  # the test's queue holds this stream alone
        rows = await _json(env, "list")
        return rows or None

    [row] = await eventually(listed, timeout=30)
    sid = row["stream_id"]
    assert row["status"] == "failed" and row["reason"].startswith("UnknownModel: model 'no-such-model' is not served")
    human = dict(line.split(None, 1) for line in (await _ok(env, "list")).splitlines())
    assert human[sid].startswith("failed") and "UnknownModel: model 'no-such-model'" in human[sid]


# --- what each command prints ------------------------------------------------------------------------------


async def test_resume_prints_the_id_receipt_prints_json_and_a_duplicate_says_so(stack: Stack, tmp_path):
    env = _env(stack, _keyfile(stack, tmp_path))
    sid = (await _ok(env, "open", "--principal", "alice", "--model", "tiny-mamba2")).strip()
    assert STREAM_ID.fullmatch(sid)
    first = await _json(env, "feed", sid, "--principal", "alice", "--text", "hello")
    assert first["duplicate"] is False and first["chunk_seq"] == 1
    gen = await _json(env, "generate", sid, "--principal", "alice", "-n", "3", "--seed", "5")
    assert gen["duplicate"] is False and gen["chunk_seq"] == 2
    # the same chunks again: the first results, said to be duplicates
    again, gen_again, human_feed, human_gen = await asyncio.gather(
        _json(env, "feed", sid, "--principal", "alice", "--text", "hello", "--seq", "1"),
        _json(env, "generate", sid, "--principal", "alice", "-n", "3", "--seed", "5", "--seq", "2"),
        _ok(env, "feed", sid, "--principal", "alice", "--text", "hello", "--seq", "1"),
        _ok(env, "generate", sid, "--principal", "alice", "-n", "3", "--seed", "5", "--seq", "2"))
    assert again == {**first, "duplicate": True} and gen_again == {**gen, "duplicate": True}
    assert human_feed.startswith("chunk 1: 5 tokens, position 5 (duplicate: first result returned)\n"), human_feed
    assert "generated 3 tokens (length), position 8 (duplicate: first result returned)" in human_gen, human_gen
    assert (await stack.streams.stats(sid)).chunks == 2  # nothing ran twice
    # receipt: JSON on stdout, --json or not, the receipt and the stats together
    rec = json.loads(await _ok(env, "receipt", sid))
    assert set(rec) == {"receipt", "stats"} and rec["receipt"]["position"] == 8 and rec["stats"]["chunks"] == 2
    assert json.loads((await _run(env, "receipt", sid, "--json"))[0].stdout) == rec
    # resume: the new id alone on stdout, as open prints it; where it came from on stderr
    cp = tmp_path / "cp.json"
    await _ok(env, "checkpoint", sid, "--principal", "alice", "--out", str(cp))
    out, _ = await _run(env, "resume", "--principal", "alice", "--checkpoint", str(cp))
    assert out.returncode == 0, out.stderr
    new = out.stdout.strip()
    assert STREAM_ID.fullmatch(new) and new != sid and out.stdout == new + "\n"
    assert out.stderr.strip() == f"resumed from {sid} at position 8"
    assert (await stack.streams.stats(new)).position == 8



# --- open at the end of a prefix (--prefix-file) -------------------------------------------------------------

#: a prefix whose tokens are not its characters: multi-byte UTF-8, and a final newline that is part of it
PREFIX_TEXT = "Système: réponds brièvement ✓\r\nUser: "


def _encoded(text: str, model_id: str = "tiny-mamba2") -> list[int]:
    """`text`'s tokens as the workers make them: the model's own input transform."""
    from mamba_stream.scan import load_model

    return list(load_model(model_id, backend="exact").transform.encode(text))


def _prefix_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


async def test_open_with_a_prefix_file_starts_at_its_end_and_a_second_open_takes_it_from_the_store(
        temporal_env, tmp_path):
    # an exact arithmetic: the only one whose prefix states are stored (the tests' default is reference)
    stack = await make_stack(temporal_env, tmp_path, backend="exact")
    async with stack.exits:
        pfx = stack.acts.prefixes

        def prefix_digest(tokens: list[int]) -> str:
            return pfx.digest(pfx.scope("alice"), tokens)

        env = _env(stack, _keyfile(stack, tmp_path))
        path = tmp_path / "prefix.txt"
        path.write_bytes(PREFIX_TEXT.encode())
        ids = _encoded(PREFIX_TEXT)
        n, digest = len(ids), prefix_digest(ids)
        assert n == len(PREFIX_TEXT.encode()) > len(PREFIX_TEXT)
        # the first open computes it: the id alone on stdout, the prefix's line on stderr
        out, _ = await _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file", str(path))
        sid = out.stdout.strip()
        assert STREAM_ID.fullmatch(sid) and out.stdout == sid + "\n", out.stdout
        assert _prefix_line(out) == (f"opened at position {n}, after a prefix of {n} tokens ({digest}): "
                                     f"all computed, none from the prefix store")
        first = await stack.streams.receipt(sid)
        assert first.position == n and (await stack.streams.stats(sid)).position == n
        assert first.origin.kind == "prefix" and first.origin.digest == digest
        assert (first.origin.tokens, first.origin.stored_tokens, first.origin.scope) == (n, 0, "")
        # the state of a stream fed the same text from position 0, bit for bit
        fed = await stack.streams.open("alice", "tiny-mamba2")
        res = await stack.streams.advance(fed, "alice", text=PREFIX_TEXT)
        assert res.position == n and res.receipt.checksum == first.checksum
        # the second open of the file takes all of it from the store: the same state
        again = await _json(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file", str(path))
        assert again["position"] == n and again["stream_id"] != sid
        assert again["prefix"] == {"digest": digest, "tokens": n, "stored_tokens": n, "scope": "principal"}
        hit = await stack.streams.receipt(again["stream_id"])
        assert hit.checksum == first.checksum and hit.origin.stored_tokens == n
        # the same tokens as ids: the same prefix, stored
        ids_path = tmp_path / "prefix.json"
        ids_path.write_text(json.dumps(ids))
        out, _ = await _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file",
                            str(ids_path), "--prefix-tokens")
        assert _prefix_line(out) == (f"opened at position {n}, after a prefix of {n} tokens ({digest}): "
                                     f"{n} from the prefix store (principal scope)")
        by_ids = out.stdout.strip()
        assert (await stack.streams.receipt(by_ids)).checksum == first.checksum
        # a longer prefix: the stored part from the store, the rest computed; the state of the whole fed
        tail = _encoded("bonjour")
        longer = tmp_path / "longer.json"
        longer.write_text(" ".join(f"{t}," for t in ids + tail).rstrip(",").join("[]"))
        got = await _json(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file", str(longer),
                          "--prefix-tokens")
        assert got["prefix"] == {"digest": prefix_digest(ids + tail), "tokens": n + len(tail), "stored_tokens": n,
                                 "scope": "principal"} and got["position"] == n + len(tail)
        after = await stack.streams.advance(fed, "alice", tokens=tail)
        assert (await stack.streams.receipt(got["stream_id"])).checksum == after.receipt.checksum
        # the streams go on alike: the first greedy token comes from the prefix's last logits
        runs = [await stack.streams.generate(s, "alice", 4, temperature=0.0) for s in (sid, again["stream_id"], by_ids)]
        assert runs[0].tokens == runs[1].tokens == runs[2].tokens
        assert runs[0].receipt.checksum == runs[1].receipt.checksum == runs[2].receipt.checksum
        # another principal's open computes it again: a principal's prefixes are its own
        bob = await _json(env, "open", "--principal", "bob", "--model", "tiny-mamba2", "--prefix-file", str(path))
        assert bob["prefix"]["stored_tokens"] == 0 and bob["position"] == n
        # an open without --prefix-file prints what it always did; so does one with an empty prefix
        empty_text, empty_ids = tmp_path / "empty.txt", tmp_path / "empty.json"
        empty_text.write_bytes(b"")
        empty_ids.write_bytes(b"[]")
        for extra in ([], ["--prefix-file", str(empty_text)], ["--prefix-file", str(empty_ids), "--prefix-tokens"]):
            plain, _ = await _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", *extra)
            assert plain.returncode == 0 and plain.stderr == "" and STREAM_ID.fullmatch(plain.stdout.strip())
            r = await stack.streams.receipt(plain.stdout.strip())
            assert r.position == 0 and r.origin is None
        assert set(await _json(env, "open", "--principal", "alice", "--model", "tiny-mamba2")) == {"stream_id"}



async def test_a_hybrids_prefix_file_opens_at_its_end_and_its_streams_share_the_kv_segments(temporal_env, tmp_path):
    """`MAMBA_STREAM_MODELS=granite=/dir` and `open --prefix-file` on a hybrid (a tiny GraniteMoeHybrid
    saved by transformers, segments of 16 rows): the first open computes the prefix, the second takes
    it from the store, both at the state of a stream fed the text; the store holds the prefix's two
    KV segments once."""
    from tests.scan._hybrid import save_tiny_granite
    from tests.scan._mamba_ssm import require

    require("transformers")
    d = save_tiny_granite(tmp_path / "granite")
    stack = await make_stack(temporal_env, tmp_path, backend="exact", start_worker=False)
    async with stack.exits:
        await stack.worker(stack.new_activities(backend="exact", models={"granite": str(d)}))
        env = _env(stack, _keyfile(stack, tmp_path))
        path = tmp_path / "prefix.txt"
        path.write_bytes(PREFIX_TEXT.encode())
        n = len(PREFIX_TEXT.encode())
        first = await _json(env, "open", "--principal", "alice", "--model", "granite", "--prefix-file", str(path))
        again = await _json(env, "open", "--principal", "alice", "--model", "granite", "--prefix-file", str(path))
        assert first["position"] == again["position"] == n and first["prefix"]["stored_tokens"] == 0
        assert again["prefix"]["stored_tokens"] == n and again["prefix"]["scope"] == "principal"
        fed = await stack.streams.open("alice", "granite")
        res = await stack.streams.advance(fed, "alice", text=PREFIX_TEXT)
        sums = {(await stack.streams.receipt(r["stream_id"])).checksum for r in (first, again)}
        assert sums == {res.receipt.checksum}
        from mamba_stream.activities._segments import is_segment_stream

        store = stack.acts.store
        segments = [k for ns in store.stream_ids() if is_segment_stream(ns) for k in store.list_stream(stream_id=ns)
                    if k.startswith("s-")]
        assert n // 16 == 2 and len(segments) == 2  # the prefix entry, two opens and a fed stream: one copy

async def test_a_prefix_file_that_is_not_one_is_refused_before_anything_starts(stack: Stack, tmp_path):
    env = _env(stack, _keyfile(stack, tmp_path))
    files = {"words.json": b"[104, \"i\"]", "float.json": b"[104, 1.5]", "bool.json": b"[true]",
             "object.json": b"{\"tokens\": [1]}", "spaced.txt": b"104 105", "negative.json": b"[-1]",
             "huge.json": b"[2147483648]", "latin1.txt": "café".encode("latin-1")}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    opens = {
        "words.json": ("--prefix-tokens", "element 1 is not a token id (an integer): \"i\""),
        "float.json": ("--prefix-tokens", "element 1 is not a token id (an integer): 1.5"),
        "bool.json": ("--prefix-tokens", "element 0 is not a token id (an integer): true"),
        "object.json": ("--prefix-tokens", "not a JSON array of token ids (a dict)"),
        "spaced.txt": ("--prefix-tokens", "not a JSON array of token ids (Extra data"),
        "negative.json": ("--prefix-tokens", "element 0 is not a token id (0 <= id < 2**31): -1"),
        "huge.json": ("--prefix-tokens", "element 0 is not a token id (0 <= id < 2**31): 2147483648"),
        "latin1.txt": (None, "not UTF-8 text (byte 3)"),
        "missing.txt": (None, "cannot read it: No such file or directory"),
    }
    outs = await asyncio.gather(*(
        _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file", str(tmp_path / name),
             *([flag] if flag else [])) for name, (flag, _) in opens.items()))
    for (name, (_, why)), (out, _) in zip(opens.items(), outs, strict=True):
        line = _one_error_line(out)
        assert line.startswith(f"error: InvalidRequest: --prefix-file {tmp_path / name}: {why}"), (name, line)
        assert out.stdout == "", (name, out.stdout)
    # --prefix-tokens says how the file is read: alone it is a mistake too
    out, _ = await _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-tokens")
    assert _one_error_line(out) == "error: InvalidRequest: --prefix-tokens says how --prefix-file is read: " \
                                   "give --prefix-file"
    # refused before the server was asked: no stream was started on the queue, not even one closed since
    assert await _on_queue(stack) == []
    # and not before a server is there to ask: with none, the file is still what is wrong
    nowhere = dict(env, TEMPORAL_ADDRESS=f"127.0.0.1:{_free_port()}")
    out, _ = await _run(nowhere, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file",
                        str(tmp_path / "words.json"), "--prefix-tokens")
    assert _one_error_line(out).startswith("error: InvalidRequest: --prefix-file ")


async def test_a_prefix_the_workers_refuse_is_reported_typed(stack: Stack, tmp_path):
    env = _env(stack, _keyfile(stack, tmp_path))
    outside = tmp_path / "outside.json"
    outside.write_text("[104, 105, 100000]")  # tiny-mamba2 reads bytes: 256 token ids
    too_many = tmp_path / "many.json"
    too_many.write_text(json.dumps([104] * (65536 + 1)))  # StreamOptions.max_prefix_tokens, the default
    too_long = tmp_path / "long.txt"
    too_long.write_text("a" * (262144 + 1))  # StreamOptions.max_text_bytes, the default
    outs = await asyncio.gather(
        _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file", str(outside),
             "--prefix-tokens"),
        _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file", str(too_many),
             "--prefix-tokens"),
        _run(env, "open", "--principal", "alice", "--model", "tiny-mamba2", "--prefix-file", str(too_long)))
    lines = [_one_error_line(out) for out, _ in outs]
    assert lines[0].startswith("error: TokenOutOfRange: "), lines
    assert lines[1].startswith("error: ChunkTooLarge: ") and "65536" in lines[1], lines
    assert lines[2].startswith("error: ChunkTooLarge: ") and "262144" in lines[2], lines
    # no stream of them is left running
    running = [w async for w in stack.client.list_workflows(
        f"TaskQueue = '{stack.queue}' AND ExecutionStatus = 'Running'")]
    assert running == []


# --- input typed by hand, refused before any server is asked ----------------------------------------------


async def _run_in(env: dict[str, str], data: bytes, *args: str) -> subprocess.CompletedProcess:
    """`_run` with `data` on the command's stdin (bytes: as a pipe gives them)."""
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mamba_stream.cli", *args], env=env, cwd=ROOT,
                                  input=data, capture_output=True, timeout=120)
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(), out.stderr.decode())


async def _refused_alike(env: dict[str, str], cases: dict[tuple[str, ...], str]) -> None:
    """Each command refused in exactly its one line, exit 2, nothing on stdout: against the test's
    server, and the same line where no server listens (it was refused before connecting)."""
    nowhere = dict(env, TEMPORAL_ADDRESS=f"127.0.0.1:{_free_port()}")
    outs = await asyncio.gather(*(_run(e, *args) for e in (env, nowhere) for args in cases))
    for (args, line), (out, _) in zip([*cases.items(), *cases.items()], outs, strict=True):
        assert _one_error_line(out) == line, (args, out.stderr)
        assert out.stdout == "", (args, out.stdout)


async def _only_these_streams(stack: Stack, *sids: str) -> None:
    """The queue holds `sids` and nothing else, none failed or closed: a marker stream opened last is
    visible first (visibility is eventually consistent), so one a refused command started would be too."""
    marker = await stack.streams.open("alice", "tiny-mamba2")

    async def listed() -> list | None:
        rows = await _on_queue(stack)
        return rows if marker in {w.id for w in rows} else None

    rows = await eventually(listed, timeout=30)
    assert sorted(w.id for w in rows) == sorted([*sids, marker]), [(w.id, w.status) for w in rows]
    assert all(w.status == WorkflowExecutionStatus.RUNNING for w in rows), [(w.id, w.status) for w in rows]


async def test_bad_flag_values_are_refused_in_one_line_naming_the_flag_before_anything_is_asked(
        stack: Stack, tmp_path):
    env = _env(stack, _keyfile(stack, tmp_path))
    sid = await stack.streams.open("alice", "tiny-mamba2")
    fed = await stack.streams.advance(sid, "alice", text="Once upon a time")
    feed, gen = ("feed", sid, "--principal", "alice"), ("generate", sid, "--principal", "alice")
    nodir = tmp_path / "no-such-dir"
    cases = {
        ("open", "--principal", "", "--model", "tiny-mamba2"):
            "error: InvalidRequest: --principal: names no principal: ''; give the name of the stream's owner",
        ("open", "--principal", "   ", "--model", "tiny-mamba2"):
            "error: InvalidRequest: --principal: names no principal: '   '; give the name of the stream's owner",
        ("feed", sid, "--principal", " ", "--text", "x"):
            "error: InvalidRequest: --principal: names no principal: ' '; give the name of the stream's owner",
        (*feed, "--tokens", "1,x"): "error: InvalidRequest: --tokens: element 1 is not a token id (an integer): x",
        (*feed, "--tokens", ""):
            "error: InvalidRequest: --tokens: no token ids in '': give them comma-separated, 1,2,3",
        (*feed, "--tokens", "104, 105,-3"):
            "error: InvalidRequest: --tokens: element 2 is not a token id (0 <= id < 2**31): -3",
        (*feed, "--tokens", "7,2147483648"):
            "error: InvalidRequest: --tokens: element 1 is not a token id (0 <= id < 2**31): 2147483648",
        (*feed, "--tokens", "1 2"): "error: InvalidRequest: --tokens: element 0 is not a token id (an integer): '1 2'",
        (*feed, "--text", "x", "--seq", "0"): "error: InvalidRequest: --seq: must be an integer from 1 to 2**53, not 0",
        (*feed, "--text", "x", "--seq", "-1"):
            "error: InvalidRequest: --seq: must be an integer from 1 to 2**53, not -1",
        (*feed, "--text", "x", "--attempt", "-1"): "error: InvalidRequest: --attempt: must be an integer >= 0, not -1",
        (*gen, "-n", "-5"): f"error: InvalidRequest: -n: must be an integer from 1 to {2**20}, not -5",
        (*gen, "-n", "0"): f"error: InvalidRequest: -n: must be an integer from 1 to {2**20}, not 0",
        (*gen, "-n", "many"): f"error: InvalidRequest: -n: must be an integer from 1 to {2**20}, not many",
        (*gen, "-n", "2", "--temperature", "-1"):
            "error: InvalidRequest: --temperature: must be a number from 0 to 1000, not -1",
        (*gen, "-n", "2", "--temperature", "nan"):
            "error: InvalidRequest: --temperature: must be a number from 0 to 1000, not nan",
        (*gen, "-n", "2", "--top-k", "-1"):
            "error: InvalidRequest: --top-k: must be an integer from 0 to 2**31, not -1",
        (*gen, "-n", "2", "--seed", "-1"):
            "error: InvalidRequest: --seed: must be an integer from 0 to 2**63 - 1, not -1",
        (*gen, "-n", "2", "--seq", "0"): "error: InvalidRequest: --seq: must be an integer from 1 to 2**53, not 0",
        (*gen, "-n", "2", "--attempt", "-1"): "error: InvalidRequest: --attempt: must be an integer >= 0, not -1",
        ("list", "--limit", "0"): "error: InvalidRequest: --limit: must be an integer >= 1, not 0",
        ("rewind", sid, "--to-seq", "-1"):
            "error: InvalidRequest: --to-seq: must be an integer from 0 to 2**53, not -1",
        ("tokens", sid, "--from-offset", "-1"):
            "error: InvalidRequest: --from-offset: must be an integer from 0 to 2**53, not -1",
        ("tokens", sid, "--seq", "0"): "error: InvalidRequest: --seq: must be an integer from 1 to 2**53, not 0",
        ("checkpoint", sid, "--principal", "alice", "--out", str(nodir / "cp.json")):
            f"error: InvalidRequest: --out {nodir / 'cp.json'}: no directory {nodir}",
        ("checkpoint", sid, "--principal", "alice", "--out", str(tmp_path)):
            f"error: InvalidRequest: --out {tmp_path}: a directory; name the file to write the receipt to",
        ("feed", sid, "--text", "x"): "error: InvalidRequest: the following arguments are required: --principal",
    }
    await _refused_alike(env, cases)
    # what only the request's model refuses, once the stream is asked for its next chunk: one line too
    out, _ = await _run(env, *gen, "-n", "2", *[a for i in range(65) for a in ("--stop", f"s{i}")])
    assert _one_error_line(out) == "error: InvalidRequest: invalid GenerateRequest: stop: List should have at " \
                                   "most 64 items after validation, not 65"
    # nothing was sent: the stream is where it was, and no stream was started
    stats = await stack.streams.stats(sid)
    assert (stats.chunk_seq, stats.chunks, stats.position) == (1, 1, fed.position)
    assert not nodir.exists()
    await _only_these_streams(stack, sid)


async def test_a_checkpoint_file_that_is_not_a_receipt_of_the_principal_is_refused_before_anything_starts(
        stack: Stack, tmp_path):
    env = _env(stack, _keyfile(stack, tmp_path))
    sid = await stack.streams.open("bob", "tiny-mamba2")
    await stack.streams.advance(sid, "bob", text="hello")
    bobs = tmp_path / "bob.json"
    bobs.write_text((await stack.streams.checkpoint(sid, "bob")).receipt.model_dump_json(indent=2))
    files = {"garbage.bin": b"\x00\x9f\x92\x96 not text", "notes.txt": b"my checkpoint",
             "partial.json": b'{"stream_id": "ms-1"}', "array.json": b"[1, 2]"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "a-dir.json").mkdir()

    def line(name: str, why: str) -> str:
        return f"error: InvalidRequest: --checkpoint {tmp_path / name}: {why}"

    resume = ("resume", "--principal", "alice", "--checkpoint")
    cases = {
        (*resume, str(tmp_path / "missing.json")): line("missing.json", "cannot read it: No such file or directory"),
        (*resume, str(tmp_path / "a-dir.json")): line("a-dir.json", "cannot read it: Is a directory"),
        (*resume, str(tmp_path / "garbage.bin")):
            line("garbage.bin", "not UTF-8 text (byte 1): a receipt is the JSON `checkpoint --out` writes"),
        (*resume, str(tmp_path / "notes.txt")):
            line("notes.txt", "not JSON (Expecting value: line 1 column 1 (char 0))"),
        # a receipt's 21 fields bar the one given and the one with a default: 19 problems, the first one's path
        (*resume, str(tmp_path / "partial.json")):
            line("partial.json", "not a checkpoint receipt: 19 problems, the first: principal: Field required"),
        (*resume, str(tmp_path / "array.json")):
            line("array.json", "not a checkpoint receipt: 1 problem: Input should be an object"),
        # which principal is whose: the file's and the flag's (the workers would refuse it after starting a stream)
        (*resume, str(bobs)): f"error: PrincipalMismatch: --checkpoint {bobs}: the checkpoint's principal is 'bob', "
                              f"--principal is 'alice': a stream resumes under its checkpoint's principal only",
    }
    await _refused_alike(env, cases)
    for out, _ in await asyncio.gather(*(_run(env, *args) for args in cases)):
        assert "http" not in out.stderr and "pydantic" not in out.stderr, out.stderr
    await _only_these_streams(stack, sid)  # no stream started, none failed


async def test_feed_takes_its_text_from_stdin_or_a_file_byte_for_byte_and_refuses_one_it_cannot_take(
        stack: Stack, tmp_path):
    env = _env(stack, _keyfile(stack, tmp_path))
    text = "Système: réponds ✓\r\n\tthen a final newline\n"
    data = text.encode()
    sids = [await stack.streams.open("alice", "tiny-mamba2") for _ in range(3)]
    path = tmp_path / "chunk.txt"
    path.write_bytes(data)
    by_file = await _json(env, "feed", sids[0], "--principal", "alice", "--text-file", str(path))
    piped = await _run_in(env, data, "feed", sids[1], "--principal", "alice", "--text", "-", "--json")
    assert piped.returncode == 0, piped.stderr
    by_stdin = json.loads(piped.stdout)
    fed = await stack.streams.advance(sids[2], "alice", text=text)
    # every byte, the final newline included (tiny-mamba2 reads bytes: a token each), the same state
    assert by_file["position"] == by_stdin["position"] == fed.position == len(data)
    assert by_file["receipt"]["checksum"] == by_stdin["receipt"]["checksum"] == fed.receipt.checksum
    # what cannot be read, or is not UTF-8, or is larger than any stream takes: one line, nothing sent
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    huge = tmp_path / "huge.txt"
    most = StreamOptions.model_fields["max_text_bytes"].metadata[-1].le
    huge.write_bytes(b"a" * (most + 1))
    feed = ("feed", sids[0], "--principal", "alice")
    await _refused_alike(env, {
        (*feed, "--text-file", str(tmp_path / "missing.txt")):
            f"error: InvalidRequest: --text-file {tmp_path / 'missing.txt'}: cannot read it: No such file or directory",
        (*feed, "--text-file", str(tmp_path)): f"error: InvalidRequest: --text-file {tmp_path}: cannot read it: "
                                               f"Is a directory",
        (*feed, "--text-file", str(latin)): f"error: InvalidRequest: --text-file {latin}: not UTF-8 text (byte 3)",
        (*feed, "--text-file", str(huge)):
            f"error: ChunkTooLarge: --text-file {huge}: {most + 1} bytes of text exceed the most any stream takes, "
            f"{most} (a stream opened with the default options takes {StreamOptions().max_text_bytes})",
        (*feed, "--text-file", str(path), "--tokens", "1"):
            "error: InvalidRequest: --tokens: not allowed with argument --text-file",
    })
    out = await _run_in(env, "café".encode("latin-1"), *feed, "--text", "-")
    assert _one_error_line(out) == "error: InvalidRequest: --text - (stdin): not UTF-8 text (byte 3)"
    # over this stream's limit (the default options') but not every stream's: the stream refuses it, typed
    over = tmp_path / "over.txt"
    over.write_bytes(b"a" * (StreamOptions().max_text_bytes + 1))
    out, _ = await _run(env, *feed, "--text-file", str(over))
    assert _one_error_line(out) == f"error: ChunkTooLarge: text exceeds {StreamOptions().max_text_bytes} bytes"
    assert [(await stack.streams.stats(s)).chunks for s in sids] == [1, 1, 1]


def _escaped(text: str) -> str:
    """`text` with each character that is not printable, but newline and tab, as repr writes it."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def _raw_controls(text: str) -> set[str]:
    return {c for c in text if (ord(c) < 32 or 127 <= ord(c) < 160) and c not in "\n\t"}


async def test_generate_shows_control_characters_escaped_and_json_keeps_them(stack: Stack, tmp_path):
    """A model samples any byte (tiny-mamba2's tokens are bytes; at temperature 1000 about uniformly):
    the streamed text, the result's text and `tokens` show the unprintable ones escaped; --json
    keeps the text exact."""
    env = _env(stack, _keyfile(stack, tmp_path))
    sid = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(sid, "alice", text="Once upon a time")
    args = ("generate", sid, "--principal", "alice", "-n", "64", "--temperature", "1000", "--seed", "11")
    # bytes as written (no newline translation: a raw carriage return is one to find)
    out = await _run_in(env, b"", *args)
    assert out.returncode == 0, out.stderr
    shown = out.stdout
    exact = await _json(env, *args, "--seq", "2")  # the same chunk: its result, exact
    assert exact["duplicate"] is True and exact["chunk_seq"] == 2
    text = exact["text"]
    assert _raw_controls(text), repr(text)  # the seed samples control bytes: what is checked is there
    assert not _raw_controls(shown), repr(shown)
    assert shown.startswith(_escaped(text) + "\nchunk 2: generated 64 tokens (length)"), (repr(shown), repr(text))
    assert shown.endswith(f"\n  text {text!r}\n"), repr(shown)
    out = await _run_in(env, b"", "tokens", sid, "--seq", "2")
    assert out.returncode == 0, out.stderr
    logged = out.stdout
    assert logged == _escaped(text) + "\n", (repr(logged), repr(text))


# --- rekey-store (issue 43, item 7) ------------------------------------------------------------------------


async def test_rekey_store_rewrites_an_old_format_store_keyed_and_the_streams_go_on(temporal_env, tmp_path):
    """A store as the version before wrote it (principal names in the objects' headers, bound fields
    in the checkpoints' envelopes, prefix records in clear JSON) beside a live worker: `rekey-store`
    rewrites it so that no name is left in any file; the streams go on from where they were; run
    again it finds nothing. Bad input is one line, exit 2, and makes nothing."""
    from mamba_stream.state_codec.codec import is_clear_header
    from tests._legacy import downgrade_file_store, downgrade_meta

    stack = await make_stack(temporal_env, tmp_path, backend="auto")  # exact: the prefix store serves
    async with stack.exits:
        who = "carol-rekey-8q2w"
        root = Path(stack.store_url.removeprefix("file://"))
        s = stack.streams
        sid = await s.open(who, "tiny-mamba2", prefix=[104, 105] * 20)
        await s.advance(sid, who, tokens=[1, 2, 3])
        before = (await s.receipt(sid)).checksum

        def names() -> int:  # files that name the principal
            return sum(who.encode() in p.read_bytes() for p in root.rglob("*") if p.is_file())

        downgrade_meta(stack.acts.store, stack.keyring)
        n = downgrade_file_store(root, stack.keyring, [who])
        assert n >= 3 and names() >= n  # the objects, and the clear prefix records
        clear = sum(is_clear_header(p.read_bytes()[9 + int.from_bytes(p.read_bytes()[5:9], "little"):])
                    for p in (root / "objects").rglob("*") if p.is_file())
        assert 3 <= clear < n  # the checkpoints (of the prefix, the open, the chunk); not the logits beside them
        env = _env(stack, _keyfile(stack, tmp_path), MAMBA_STREAM_STORE=stack.store_url)
        out = await _json(env, "rekey-store")
        assert (out["objects"], out["resealed"], out["unreadable"]) == (n, clear, 0), out
        assert out["records"] == 2 and out["store"] == stack.store_url  # the scope's record and the entry's
        assert names() == 0
        again = await _json(env, "rekey-store")
        assert (again["objects"], again["records"]) == (0, 0)
        # the stream goes on from the rekeyed state; a new open is served the rekeyed prefix entry
        assert (await s.receipt(sid)).checksum == before
        after = await s.advance(sid, who, tokens=[4])
        assert after.receipt.position == 44
        other = await s.open(who, "tiny-mamba2", prefix=[104, 105] * 20)
        assert (await s.receipt(other)).origin.stored_tokens == 40
        # bad input: one line naming what is wrong, nothing made
        nowhere = tmp_path / "no-such-store"
        bad = await _run(env, "rekey-store", "--store", f"file://{nowhere}")
        assert _one_error_line(bad[0]) == f"error: no state store at {nowhere} (--store, or $MAMBA_STREAM_STORE)"
        assert not nowhere.exists()
        alices = tmp_path / "alice.json"
        stack.keyring.for_principal("alice").save(alices)
        bad = await _run(dict(env, MAMBA_STREAM_KEYRING=str(alices)), "rekey-store")
        assert _one_error_line(bad[0]).startswith("error: KeyringError: rekeying needs the workers' master keyring")
        bad = await _run(env, "rekey-store", "--store", "postgresql://nobody@127.0.0.1:1/none")
        assert _one_error_line(bad[0]).startswith("error: StoreUnavailable: ")
