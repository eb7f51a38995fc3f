"""Stream commands of `mamba-stream`: open, feed, generate, receipt, checkpoint, resume, sweep, codec-server."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_stream_commands"]


async def _streams(args: argparse.Namespace):
    from temporalio.client import Client

    from plugin import MambaStreamPlugin
    from workflows import ClientConfig, StreamClient

    cfg = ClientConfig()
    keyring = cfg.load_keyring()  # found, never made: KeyringNotFound says where it looked
    client = await Client.connect(args.address or cfg.target, **cfg.connect_args(),
                                  plugins=[MambaStreamPlugin(keyring=keyring)])
    signer = None
    if cfg.signing_key:
        from state_codec.signing import RequestSigner

        signer = RequestSigner.from_spec(cfg.signing_key)
    return StreamClient(client, args.task_queue or cfg.task_queue, signer=signer)


def _emit(args: argparse.Namespace, obj: Any, human: str) -> None:
    if args.json:
        data = obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj
        print(json.dumps(data, indent=2))
    else:
        print(human)


def _tokens(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


async def _open(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    sid = await streams.open(args.principal, args.model, input_transform=args.input_transform)
    _emit(args, {"stream_id": sid}, sid)
    return 0


async def _feed(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    res = await streams.advance(args.stream, args.principal, text=args.text,
                                tokens=_tokens(args.tokens) if args.tokens is not None else None, chunk_seq=args.seq,
                                attempt=args.attempt)
    top = ", ".join(f"{t.token}:{t.logprob:.2f}" for t in res.top_k)
    _emit(args, res, f"chunk {res.chunk_seq}: {res.n_tokens} tokens, position {res.position}"
                     f"{' (duplicate: first result returned)' if res.duplicate else ''}\n"
                     f"  next-token top-k {top}\n  outputs {res.output_digest}\n  state {res.receipt.checksum}")
    return 0


async def _generate(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    kw = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed, stop=args.stop or (),
              chunk_seq=args.seq, attempt=args.attempt)
    if args.json or args.no_stream:
        res = await streams.generate(args.stream, args.principal, args.n, **kw)
    else:
        # the text as it is sampled (token ids for a model without an input transform), then the result
        gen = streams.generate_stream(args.stream, args.principal, args.n, **kw)
        async for ev in gen:
            if ev.restart:
                sys.stdout.write("\n[the committed tokens differ from those shown; they are:]\n")
            sys.stdout.write(ev.text if ev.text is not None else "".join(f"{t} " for t in ev.tokens))
            sys.stdout.flush()
        sys.stdout.write("\n")
        res = gen.result
    _emit(args, res, f"chunk {res.chunk_seq}: generated {len(res.tokens)} tokens ({res.finish_reason}), "
                     f"position {res.position}\n  tokens {res.tokens}\n  text {res.text!r}")
    return 0


async def _tokens_cmd(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    async for ev in streams.tokens(args.stream, from_offset=args.from_offset, chunk_seq=args.seq):
        if args.json:
            print(json.dumps(ev.model_dump(mode="json")), flush=True)
        else:
            piece = ev.text if ev.text is not None else "".join(f"{t} " for t in ev.tokens)
            sys.stdout.write(("\n" if ev.restart else "") + piece + ("\n" if ev.done else ""))
            sys.stdout.flush()
        if args.seq is not None and ev.done:
            break
    return 0


async def _receipt(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    rec = await streams.receipt(args.stream)
    stats = await streams.stats(args.stream)
    if args.json:
        print(json.dumps({"receipt": rec.model_dump(mode="json") if rec else None,
                          "stats": stats.model_dump(mode="json")}, indent=2))
    else:
        print(json.dumps(rec.model_dump(mode="json"), indent=2) if rec else "no receipt yet")
        print(f"stats: {stats.model_dump()}")
    return 0


async def _reset(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    await streams.reset(args.stream, args.principal, revoke=args.revoke)
    _emit(args, {"stream_id": args.stream, "revoke": args.revoke},
          f"reset sent to {args.stream}: a new epoch at position 0; " +
          ("every checkpoint of the earlier epochs is deleted, pinned ones included" if args.revoke else
           "pinned checkpoints of the earlier epochs still resume (--revoke deletes them)"))
    return 0


async def _rewind(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    run_id = await streams.rewind(args.stream, args.to_seq, principal=args.principal)
    stats = await streams.stats(args.stream)
    _emit(args, {"stream_id": args.stream, "run_id": run_id, "chunk_seq": stats.chunk_seq, "position": stats.position},
          f"{args.stream} rewound to chunk {stats.chunk_seq} (position {stats.position}), run {run_id}")
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    await streams.cancel(args.stream, args.principal, wait=not args.no_wait)
    _emit(args, {"stream_id": args.stream, "cancelled": True}, f"{args.stream} cancelled")
    return 0


async def _checkpoint(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    res = await streams.checkpoint(args.stream, args.principal)
    if args.out:
        Path(args.out).write_text(res.receipt.model_dump_json(indent=2))
        os.chmod(args.out, 0o600)
    _emit(args, res, f"checkpoint of {res.stream_id} at position {res.receipt.position}: "
                     f"{res.receipt.state_key}" + (f"\n  receipt written to {args.out}" if args.out else ""))
    return 0


async def _resume(args: argparse.Namespace) -> int:
    from state_codec import Receipt

    streams = await _streams(args)
    receipt = Receipt.model_validate_json(Path(args.checkpoint).read_text())
    sid = await streams.open(args.principal, receipt.model_id, resume=receipt)
    _emit(args, {"stream_id": sid, "resumed_from": receipt.stream_id, "position": receipt.position},
          f"{sid} (resumed from {receipt.stream_id} at position {receipt.position})")
    return 0


async def _sweep(args: argparse.Namespace) -> int:
    import time

    from activities import StoreOwnedElsewhere, open_store, sweep_orphans
    from worker import WorkerConfig

    streams = await _streams(args)
    cfg = WorkerConfig()
    with open_store(cfg.store) as store:
        try:
            rep = await sweep_orphans(streams.client, store, grace_s=args.grace, dry_run=args.dry_run,
                                      claim=args.claim)
        except StoreOwnedElsewhere as exc:
            print(f"refused: {exc.reason}: {exc}\nnothing was deleted", file=sys.stderr)
            return 3
    if rep.refused is not None:
        print(f"refused: {rep.refused}\nnothing was deleted (--claim records this server as the owner)",
              file=sys.stderr)
        return 3
    for sid, why in rep.orphans.items():
        print(f"{sid}: {why}")
    for sid, since in rep.missing.items():
        print(f"{sid}: workflow not found for {time.time() - since:.0f} s (kept until --grace has passed)")
    verb = "found" if args.dry_run else f"deleted ({rep.blobs_deleted} blobs)"
    print(f"{len(rep.orphans)} of {rep.checked} streams in {cfg.store} orphaned: {verb}")
    return 0


def _codec_server(args: argparse.Namespace) -> int:
    from state_codec.codec_server import CodecServer, principal_tokens_from_env
    from state_codec.keyring import KeyringError, default_home
    from workflows import ClientConfig

    origins = tuple(o for o in args.origins.split(",") if o)
    try:
        # never from the command line, which every user of the machine can read (/proc/<pid>/cmdline)
        token = (Path(args.token_file).read_text().strip() if args.token_file else None) or \
            os.environ.get("MAMBA_STREAM_CODEC_TOKEN") or None
        keyring = ClientConfig().load_keyring()
    except (KeyringError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    server = CodecServer(keyring, host=args.host, port=args.port, origins=origins, token=token,
                         principal_tokens=principal_tokens_from_env())
    where = "the token given"
    if not token:
        # made here: kept where only this user reads it, not in the output (which logs keep)
        out = Path(args.endpoint_file) if args.endpoint_file else default_home() / "codec-endpoint"
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(server.endpoint + "\n")
        where = f"the token in the endpoint written to {out}"
    print(f"codec server on {server.url} (origins {', '.join(origins)}); every request needs {where}: "
          f"'Authorization: Bearer <token>' (the Temporal CLI's TEMPORAL_CODEC_AUTH), or the endpoint "
          f"{server.url}/t/<token> (the UI's Codec Server setting in the browser, TEMPORAL_CODEC_ENDPOINT)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _undecodable(reason: str) -> str:
    """What to say of a failure whose message the workers encrypted under a key we lack."""
    from workflows import ClientConfig

    try:
        kid = ClientConfig().load_keyring().active_id
    except Exception:  # noqa: BLE001 - a hint only
        kid = "?"
    if reason == "UnknownKeyId":
        return (f"the workers do not hold this client's key {kid}: the client and the workers use different "
                f"keyrings (the failure's own message is encrypted under the workers' key)")
    return f"the failure's message is encrypted under a key this client's keyring (active key {kid}) lacks"


def _run(fn):
    def call(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(fn(args))
        except Exception as exc:  # noqa: BLE001 - the CLI reports, with the typed reason
            # an ApplicationError raised here (a payload refused on this side) is typed itself; a
            # failed update or workflow carries its typed cause
            typed = exc if getattr(exc, "type", None) else getattr(exc, "cause", None)
            reason = getattr(typed, "type", None) or type(exc).__name__
            message = getattr(typed, "message", None) or str(exc)
            from state_codec.payload import ENCODED_FAILURE

            if message.startswith(ENCODED_FAILURE):  # Temporal's stand-in: the message is encrypted, not for us
                message = _undecodable(reason)
            print(f"error: {reason}: {message}", file=sys.stderr)
            return 2
    return call


def add_stream_commands(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--address", default=None, help="Temporal frontend (default $TEMPORAL_ADDRESS or 127.0.0.1:7233)")
        p.add_argument("--task-queue", default=None, help="default $MAMBA_STREAM_TASK_QUEUE or mamba-stream")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    p = common(sub.add_parser("open", help="open a stream"))
    p.add_argument("--principal", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--input-transform", default=None)
    p.set_defaults(func=_run(_open), hard_exit=True)

    p = common(sub.add_parser("feed", help="advance a stream by a chunk of text or tokens"))
    p.add_argument("stream")
    p.add_argument("--principal", required=True)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text")
    g.add_argument("--tokens", help="comma-separated ids")
    p.add_argument("--seq", type=int, default=None, help="chunk sequence (default: the next); part of the update id")
    p.add_argument("--attempt", type=int, default=0, help="send a chunk again whose update failed for a reason "
                   "that was not its own (a store fault, a rewind past the window): 1, 2, ...")
    p.set_defaults(func=_run(_feed), hard_exit=True)

    p = common(sub.add_parser("generate", help="sample tokens (seeded) that advance the stream"))
    p.add_argument("stream")
    p.add_argument("--principal", required=True)
    p.add_argument("-n", type=int, required=True)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--attempt", type=int, default=0, help="as for feed")
    p.add_argument("--no-stream", action="store_true", help="print the result only, not the text as it is "
                   "sampled (--json never streams)")
    p.set_defaults(func=_run(_generate), hard_exit=True)

    p = common(sub.add_parser("tokens", help="follow the stream's token log: its generates' text as it is "
                              "sampled, from an offset (each entry's offset is in --json)"))
    p.add_argument("stream")
    p.add_argument("--from-offset", type=int, default=0, help="reconnect: the last entry's offset + 1")
    p.add_argument("--seq", type=int, default=None, help="only this chunk's entries; stop at its last")
    p.set_defaults(func=_run(_tokens_cmd), hard_exit=True)

    p = common(sub.add_parser("receipt", help="the stream's current receipt and counters"))
    p.add_argument("stream")
    p.set_defaults(func=_run(_receipt), hard_exit=True)

    p = common(sub.add_parser("reset", help="start a new epoch at position 0 (a signal)"))
    p.add_argument("stream")
    p.add_argument("--principal", required=True)
    p.add_argument("--revoke", action="store_true",
                   help="also delete every checkpoint of the earlier epochs, pinned ones included (default: kept)")
    p.set_defaults(func=_run(_reset), hard_exit=True)

    p = common(sub.add_parser("rewind", help="undo the chunks after --to-seq (the stream continues, in a new run, "
                                             "from that chunk's checkpoint)"))
    p.add_argument("stream")
    p.add_argument("--to-seq", type=int, required=True, help="the last chunk to keep (0: back to the opened state)")
    p.add_argument("--principal", default=None, help="the stream's principal (default: read from the stream)")
    p.set_defaults(func=_run(_rewind), hard_exit=True)

    p = common(sub.add_parser("cancel", help="end the stream and destroy its state (the sealed cancel signal, "
                                             "then Temporal's cancel request)"))
    p.add_argument("stream")
    p.add_argument("--principal", default=None, help="the stream's principal (default: read from the stream)")
    p.add_argument("--no-wait", action="store_true", help="return once the cancel is sent")
    p.set_defaults(func=_run(_cancel), hard_exit=True)

    p = common(sub.add_parser("checkpoint", help="a portable receipt of the stream's state"))
    p.add_argument("stream")
    p.add_argument("--principal", required=True)
    p.add_argument("--out", help="write the receipt JSON here (mode 0600)")
    p.set_defaults(func=_run(_checkpoint), hard_exit=True)

    p = common(sub.add_parser("resume", help="open a new stream from a checkpoint receipt"))
    p.add_argument("--principal", required=True)
    p.add_argument("--checkpoint", required=True, help="receipt JSON file (from `checkpoint --out`)")
    p.set_defaults(func=_run(_resume), hard_exit=True)

    p = common(sub.add_parser("sweep", help="find and delete states whose stream's workflow is gone",
                              description="Find and delete states whose stream's workflow is gone. Refuses, "
                                          "deleting nothing and exiting 3, when the store belongs to another "
                                          "Temporal cluster or namespace, or has no owner record yet."))
    p.add_argument("--grace", type=float, default=3600.0, help="seconds since the workflow closed (default 3600)")
    p.add_argument("--dry-run", action="store_true", help="list the orphans, delete nothing")
    p.add_argument("--claim", action="store_true",
                   help="record this server's cluster and namespace as the owner of a store that has none")
    p.set_defaults(func=_run(_sweep), hard_exit=True)

    p = sub.add_parser("codec-server", help="serve /encode and /decode for the Temporal UI and CLI")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--origins", default="http://localhost:8233,http://127.0.0.1:8233")
    p.add_argument("--token-file", default=None, help="a file holding the token every request must carry "
                   "(default $MAMBA_STREAM_CODEC_TOKEN, else a random one); never a token on the command line")
    p.add_argument("--endpoint-file", default=None, help="where a random token's endpoint is written (0600; "
                   "default $MAMBA_STREAM_HOME/codec-endpoint)")
    p.set_defaults(func=_codec_server)
