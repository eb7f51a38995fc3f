"""`mamba-stream demo`: the lifecycle end to end on the embedded stack, with each claim proved.

It starts the embedded Temporal dev server (unless TEMPORAL_ADDRESS is set) and a worker process
on the default backend (`exact` on a CPU) serving `recall-mamba2`, a model trained to recall facts across
distractors (`mamba_stream/quality/`). Then: it opens a stream, feeds facts in the first chunk and distractors
in several more (an empty one too), checkpoints, asks a question and gets the right answer, and
checks the stream's state checksum against one local scan of the same tokens; resets and shows
the answer is gone (the inequality control); restarts the worker, resumes the checkpoint in a new
stream and gets the right answer again; cancels both streams and shows their state is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

__all__ = ["add_demo_command"]

# The task format of quality.tasks.recall_sample: "key value" facts, "|", distractors, "|", a key.
FACTS = "k7 m2 q3 d4|"
DISTRACTORS = ["RED FOX RED FOX ", "", "BLUE OWL ", "GREY CAT BLUE OWL"]
QUESTION, ANSWER = "|q", "3"


def _digest(logits) -> str:
    import torch

    return "sha256:" + hashlib.sha256(logits.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _spawn_worker(env: dict[str, str], log_path: Path) -> subprocess.Popen:
    logf = open(log_path, "ab")  # noqa: SIM115 - owned by the child
    return subprocess.Popen([sys.executable, "-m", "mamba_stream.worker"], env=env, stdout=logf,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _demo(args: argparse.Namespace) -> int:
    from temporalio.client import Client

    from mamba_stream.activities import open_store
    from mamba_stream.plugin import MambaStreamPlugin
    from mamba_stream.scan import load_model
    from mamba_stream.state_codec.codec import plaintext_checksum
    from mamba_stream.worker import WorkerConfig, load_keyring, private_home, start_embedded
    from mamba_stream.workflows import StreamClient

    cfg = WorkerConfig()
    private_home(cfg.home)
    keyring = load_keyring(cfg)
    server = codec = None
    if cfg.address is None:
        server, codec = start_embedded(cfg, keyring)
        cfg.address = server.address
    queue = f"mamba-stream-demo-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, TEMPORAL_ADDRESS=cfg.address, MAMBA_STREAM_HOME=str(cfg.home),
               MAMBA_STREAM_TASK_QUEUE=queue, MAMBA_STREAM_BACKEND=os.environ.get("MAMBA_STREAM_BACKEND", "auto"),
               MAMBA_STREAM_MODELS=args.model, MAMBA_STREAM_STORE=cfg.store)
    if cfg.keyring:
        env["MAMBA_STREAM_KEYRING"] = cfg.keyring
    worker_log = cfg.home / "demo-worker.log"
    worker = _spawn_worker(env, worker_log)
    proved: list[str] = []

    def ok(claim: str, holds: bool) -> None:
        print(f"  [{'ok' if holds else 'FAILED'}] {claim}", flush=True)
        proved.append(("ok " if holds else "FAILED ") + claim)
        if not holds:
            raise SystemExit(f"demo: {claim} does not hold (worker log: {worker_log})")

    try:
        client = await Client.connect(cfg.address, plugins=[MambaStreamPlugin(keyring=keyring)])
        streams = StreamClient(client, queue)
        store = open_store(cfg.store)
        model = load_model(args.model, backend=env["MAMBA_STREAM_BACKEND"])
        enc = model.transform.encode
        alice = "alice"

        probe = model.exact_probe
        print(f"1. open a stream on {args.model} for {alice} (backend {model.backend}"
              f"{f', path {probe.path}' if probe else ''})", flush=True)
        sid = await streams.open(alice, args.model)
        print(f"   stream {sid}", flush=True)

        print("2. facts in the first chunk, distractors in the next ones (one of them empty)", flush=True)
        for chunk in [FACTS, *DISTRACTORS]:
            r = await streams.advance(sid, alice, text=chunk)
            print(f"   chunk {r.chunk_seq}: {chunk!r} -> position {r.position}", flush=True)
        cp = await streams.checkpoint(sid, alice)
        print(f"   checkpoint at position {cp.receipt.position}", flush=True)

        async def ask(stream: str):
            await streams.advance(stream, alice, text=QUESTION)
            return await streams.generate(stream, alice, 1, temperature=0.0)

        print(f"3. ask {QUESTION[1:]!r} (greedy, one token)", flush=True)
        answer = await ask(sid)
        said = answer.text or ""
        ok(f"the stream answers {said!r}; the fact was {QUESTION[1:]}{ANSWER}, "
           f"{cp.receipt.position - FACTS.index(QUESTION[1:])} tokens back", said == ANSWER)
        tokens_a = enc(FACTS + "".join(DISTRACTORS) + QUESTION + said)
        one_shot = model.advance(model.initial_state(), tokens_a)
        ok(f"the stream's state checksum equals one scan of all {len(tokens_a)} tokens "
           f"({answer.receipt.checksum[:23]}...)",
           plaintext_checksum(one_shot.state.tensors) == answer.receipt.checksum)

        print("4. reset, then ask again", flush=True)
        await streams.reset(sid, alice)
        for _ in range(200):
            if (await streams.stats(sid)).epoch == 1:
                break
            await asyncio.sleep(0.05)
        b = await streams.advance(sid, alice, text=QUESTION)
        forgot = (await streams.generate(sid, alice, 1, temperature=0.0)).text or ""
        fresh_b = model.advance(model.initial_state(), enc(QUESTION))
        a_then_b = model.advance(one_shot.state, enc(QUESTION))
        ok(f"after reset the answer is gone: it says {forgot!r}", forgot != ANSWER)
        ok("the question's outputs equal a fresh stream's", b.output_digest == _digest(fresh_b.logits))
        ok("and differ from the same question without the reset (the inequality control)",
           b.output_digest != _digest(a_then_b.logits))

        print("5. restart the worker, resume the checkpoint in a new stream, ask", flush=True)
        _stop(worker)
        worker = _spawn_worker(env, worker_log)
        sid2 = await streams.open(alice, args.model, resume=cp.receipt)
        c = await streams.advance(sid2, alice, text=QUESTION)
        upto_cp = model.advance(model.initial_state(), enc(FACTS + "".join(DISTRACTORS)))
        expected_c = model.advance(upto_cp.state, enc(QUESTION))
        ok(f"the resumed stream {sid2} continues exactly (position {c.position})",
           c.output_digest == _digest(expected_c.logits)
           and c.receipt.checksum == plaintext_checksum(expected_c.state.tensors))
        again = (await streams.generate(sid2, alice, 1, temperature=0.0)).text or ""
        ok(f"and answers {again!r} again: the memory survived the restart", again == ANSWER)

        print("6. cancel both streams", flush=True)
        before = len(store.list_stream(stream_id=sid)) + len(store.list_stream(stream_id=sid2))
        await streams.cancel(sid)
        await streams.cancel(sid2)
        after = len(store.list_stream(stream_id=sid)) + len(store.list_stream(stream_id=sid2))
        ok(f"their checkpoints are gone from the store ({before} objects before, {after} after)",
           before > 0 and after == 0)
        try:
            await streams.advance(sid, alice, text="more", chunk_seq=99)
            refused = False
        except Exception:  # noqa: BLE001 - any refusal will do here
            refused = True
        ok("a cancelled stream refuses further chunks", refused)

        ui = f"http://127.0.0.1:{server.ui_port if server else 8233}/namespaces/default/workflows"
        print("\nproved:")
        for line in proved:
            print(f"  {line}")
        print(f"\nTemporal UI: {ui}/{sid} and {ui}/{sid2}")
        print("  (histories hold only encrypted payloads; the UI decrypts them through the codec server)")
        if server is not None:
            print(f"  the embedded server stops with the demo; `python worker.py` serves the same history "
                  f"from {cfg.home / 'temporal.db'}")
        return 0
    finally:
        _stop(worker)
        if server is not None:
            server.stop()
        if codec is not None:
            codec.stop()


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the stream lifecycle end to end on the embedded stack")
    p.add_argument("--model", default="recall-mamba2",
                   help="a model trained on quality.tasks' recall format (recall-mamba2)")
    p.set_defaults(func=lambda args: asyncio.run(_demo(args)))
