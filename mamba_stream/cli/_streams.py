"""Stream commands of `mamba-stream`: open, feed, generate, tokens, receipt, reset, rewind, cancel, list,
checkpoint, resume, sweep, rekey-store, codec-server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import threading
from collections import UserString
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mamba_stream.failures import Failure, InvalidRequest

__all__ = ["add_stream_commands"]

#: the stream workflow's type name (`@workflow.defn(name=...)` of workflows.MambaStreamWorkflow):
#: what `list` asks Temporal's visibility for


class Unreachable(Failure):
    """No Temporal server answers at the address the command was given or found."""


class NoSuchStream(Failure):
    """No workflow has the stream's id on this server."""


class StreamClosed(Failure):
    """The stream's workflow ended otherwise than by a cancel (failed, terminated, timed out)."""


class PrefixNotApplied(Failure):
    """A stream opened with a prefix whose receipt names none (an older worker ignored it)."""


def _unreachable(target: str, exc: BaseException) -> Failure:
    why = "connection refused" if "refused" in str(exc).lower() else "it does not answer"
    return Unreachable(
        f"no Temporal server at {target} ({why}): start the worker (`python worker.py` runs the embedded "
        f"server on 127.0.0.1:$MAMBA_STREAM_TEMPORAL_PORT, default 7233), or set TEMPORAL_ADDRESS to your "
        f"Temporal frontend, or MAMBA_STREAM_TEMPORAL_PORT to the port of the worker's embedded server")


async def _connect(args: argparse.Namespace) -> Any:
    """A client of the configured server, with the plugin and the found keyring (the plugin also
    closes it before the interpreter exits: plugin.close_native_clients). Kept on `args` for `_explain`."""
    from temporalio.client import Client

    from mamba_stream.plugin import MambaStreamPlugin
    from mamba_stream.workflows import ClientConfig

    cfg = ClientConfig()
    plugin = MambaStreamPlugin(keyring=cfg.load_keyring())  # found, never made: KeyringNotFound says where it looked
    target = args.address or cfg.target
    try:
        client = await Client.connect(target, **cfg.connect_args(), plugins=[plugin])
    except RuntimeError as exc:  # the SDK's "Failed client connect: ... transport error"
        raise _unreachable(target, exc) from exc
    args.client = client
    return client


async def _streams(args: argparse.Namespace) -> Any:
    from mamba_stream.workflows import ClientConfig, StreamClient

    cfg = ClientConfig()
    client = await _connect(args)
    signer = None
    if cfg.signing_key:
        from mamba_stream.state_codec.signing import RequestSigner

        signer = RequestSigner.from_spec(cfg.signing_key)
    return StreamClient(client, args.task_queue or cfg.task_queue, signer=signer)


def _emit(args: argparse.Namespace, obj: Any, human: str) -> None:
    if args.json:
        data = obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj
        print(json.dumps(data, indent=2))
    else:
        print(human)


#: the largest token id a request carries (`workflows._models._Token`: 0 <= id < 2**31); which ids a
#: model reads is the workers' to say (TokenOutOfRange)
_TOKEN_LIMIT = 2**31

# --- the flags' values, checked as argparse reads them ---------------------------------------------------
# Each raises argparse.ArgumentTypeError: the parser (cli._main._Parser) says it in the CLI's one line,
# `error: InvalidRequest: <flag>: <why>`, exit 2, before the command runs, so before any server is asked.


def _said(text: str) -> str:
    """A value as typed, for a message: verbatim where that reads unambiguously, else quoted and escaped
    (an empty one, one with spaces or control characters: what is typed must not reach the terminal raw)."""
    return text if text and text.isprintable() and not text.isspace() and " " not in text else repr(text)


def _num(v: float) -> str:
    """A bound for a message: the request models' large bounds as the powers of two they are written as."""
    if isinstance(v, float):
        return f"{v:g}"
    for k in range(31, 64):
        if v == 2**k:
            return f"2**{k}"
        if v == 2**k - 1:
            return f"2**{k} - 1"
    return str(v)


def _field_range(model: Any, field: str) -> tuple[Any, Any]:
    """(lowest, highest) value, inclusive (None: unbounded), that `model`'s `field` takes, from its
    constraints: the CLI refuses what the request would, as the flag is read, instead of the request's
    pydantic dump once connected (the model decides, so the two cannot drift apart)."""
    lo = hi = None
    for c in model.model_fields[field].metadata:
        if getattr(c, "ge", None) is not None:
            lo = c.ge
        if getattr(c, "gt", None) is not None:
            lo = c.gt + 1  # the integer fields only: a float field here has ge/le
        if getattr(c, "le", None) is not None:
            hi = c.le
        if getattr(c, "lt", None) is not None:
            hi = c.lt - 1
    return lo, hi


def _request_range(model: str, field: str) -> Callable[[], tuple[Any, Any]]:
    """`_field_range` of a request model of `workflows`, imported once a flag needs it: importing
    `workflows` takes most of a second, which a command's parsing (and its --help) does not pay for."""
    def bounds() -> tuple[Any, Any]:
        from mamba_stream.workflows import _models

        return _field_range(getattr(_models, model), field)
    return bounds


def _allowed(kind: str, lo: Any, hi: Any) -> str:
    return f"{kind} from {_num(lo)} to {_num(hi)}" if hi is not None else f"{kind} >= {_num(lo)}"


def _integer(bounds: Callable[[], tuple[Any, Any]]) -> Callable[[str], int]:
    """An argparse type: an integer within `bounds()`."""
    def parse(text: str) -> int:
        lo, hi = bounds()
        value = int(text) if re.fullmatch(r"\s*[+-]?[0-9]+\s*", text) else None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {_allowed('an integer', lo, hi)}, not {_said(text)}")
        return value
    return parse


def _number(bounds: Callable[[], tuple[Any, Any]]) -> Callable[[str], float]:
    """An argparse type: a finite number within `bounds()` (the requests take no NaN or infinity)."""
    def parse(text: str) -> float:
        import math

        lo, hi = bounds()
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {_allowed('a number', lo, hi)}, not {_said(text)}")
        return value
    return parse


def _principal(text: str) -> str:
    """An argparse type: a principal, any name but an empty one (spaces alone are none): a stream
    opened for nobody would be sealed under a key nobody asks for."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"names no principal: {_said(text)}; give the name of the stream's owner")
    return text


def _token_ids(text: str) -> list[int]:
    """An argparse type: `--tokens`, comma-separated token ids (spaces around them allowed, an empty
    element skipped); the element that is not one is named by its position (from 0) and value."""
    ids = []
    for i, part in enumerate(text.split(",")):
        part = part.strip()
        if not part:
            continue
        if not re.fullmatch(r"[+-]?[0-9]+", part):
            raise argparse.ArgumentTypeError(f"element {i} is not a token id (an integer): {_said(part[:40])}")
        t = int(part)
        if not 0 <= t < _TOKEN_LIMIT:
            raise argparse.ArgumentTypeError(f"element {i} is not a token id (0 <= id < 2**31): {t}")
        ids.append(t)
    if not ids:
        raise argparse.ArgumentTypeError(f"no token ids in {_said(text)}: give them comma-separated, 1,2,3")
    return ids


def _chunk_limits() -> dict[str, Any]:
    """The chunk limits: the stream's options' defaults (a stream the CLI opens has them) and the most
    any stream may be opened with (StreamOptions' bounds), and the request's -n bound."""
    from mamba_stream.workflows import GenerateRequest, StreamOptions

    def default(f: str) -> int:
        return StreamOptions.model_fields[f].default

    def most(model: Any, f: str) -> int:
        return _field_range(model, f)[1]

    return {"text_bytes": default("max_text_bytes"), "text_bytes_max": most(StreamOptions, "max_text_bytes"),
            "chunk_tokens": default("max_chunk_tokens"), "chunk_tokens_max": most(StreamOptions, "max_chunk_tokens"),
            "generate_tokens": default("max_generate_tokens"), "n_max": most(GenerateRequest, "max_tokens")}


def _chunk_text(args: argparse.Namespace) -> str | None:
    """The chunk's text: `--text` (`-`: stdin) or `--text-file`'s, UTF-8, every byte as given (a final
    newline is part of it). Text that cannot be read, is not UTF-8, or is larger than any stream takes
    (its options' bound: a stream's own limit, the default or what it was opened with, is the workers'
    to apply, ChunkTooLarge) is refused here, before any server is asked. None: a chunk of tokens."""
    if args.text_file is not None:
        where = f"--text-file {args.text_file}"
        try:
            data = Path(args.text_file).read_bytes()  # bytes: no newline translation
        except OSError as exc:
            raise InvalidRequest(f"{where}: cannot read it: {exc.strerror or exc}") from exc
    elif args.text == "-":
        where = "--text - (stdin)"
        if sys.stdin is None:  # started with no stdin at all
            raise InvalidRequest(f"{where}: this command has no stdin")
        try:
            data = sys.stdin.buffer.read()
        except (OSError, ValueError) as exc:  # a closed or unreadable one
            raise InvalidRequest(f"{where}: cannot read it: {exc}") from exc
    elif args.text is not None:
        where = "--text"
        data = os.fsencode(args.text)  # the argument's bytes (undecodable ones kept as the OS gave them)
    else:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{where}: not UTF-8 text (byte {exc.start})") from exc
    limits = _chunk_limits()
    if len(data) > limits["text_bytes_max"]:
        from mamba_stream.workflows import ChunkTooLarge

        raise ChunkTooLarge(f"{where}: {len(data)} bytes of text exceed the most any stream takes, "
                            f"{limits['text_bytes_max']} (a stream opened with the default options takes "
                            f"{limits['text_bytes']})")
    return text


def _shown(text: str) -> str:
    """Model text for a terminal: each character that is not printable (a control byte, ESC and its
    sequences, a bidi override) as its escape, `\\x07` as repr writes it; newline and tab as they are.
    A model samples any byte: raw, they would move the cursor, retitle the window, ring the bell."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def _problems(exc: Any) -> str:
    """A pydantic ValidationError in a line: how many problems, the first one's field path and message
    (no input echoed, no documentation URL)."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    n = len(errors)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    path = ".".join(str(p) for p in first["loc"])
    msg = " ".join(str(first["msg"]).split())
    head = f"{n} problem{'s' if n != 1 else ''}" + (", the first" if n > 1 else "")
    return f"{head}: {path}: {msg}" if path else f"{head}: {msg}"


def _checkpoint_file(path: str, principal: str) -> Any:
    """The receipt `--checkpoint` names, read and checked here, before any server is asked: a file
    that cannot be read, is not UTF-8 JSON or not a receipt (`checkpoint --out` writes them) is
    refused InvalidRequest; a receipt of another principal PrincipalMismatch (the workers refuse
    to resume it, after a stream was started for it). Either way nothing is started."""
    from pydantic import ValidationError

    from mamba_stream.state_codec import Receipt

    def bad(why: str) -> Failure:
        return InvalidRequest(f"--checkpoint {path}: {why}")

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise bad(f"cannot read it: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"not UTF-8 text (byte {exc.start}): a receipt is the JSON `checkpoint --out` writes") from exc
    try:
        json.loads(text)  # its own message says where the JSON breaks
    except ValueError as exc:
        raise bad(f"not JSON ({exc})") from exc
    try:
        receipt = Receipt.model_validate_json(text)
    except ValidationError as exc:
        raise bad(f"not a checkpoint receipt: {_problems(exc)}") from exc
    if receipt.principal != principal:
        from mamba_stream.state_codec import PrincipalMismatch

        raise PrincipalMismatch(f"--checkpoint {path}: the checkpoint's principal is "
                                f"{receipt.principal!r}, --principal is {principal!r}: a stream resumes under its "
                                f"checkpoint's principal only")
    return receipt


def _out_file(path: str) -> None:
    """Refuse, before any server is asked, an `--out` the receipt cannot be written to: else the
    checkpoint is taken (and pinned) and then the write fails."""
    out = Path(path)
    if out.is_dir():
        raise InvalidRequest(f"--out {path}: a directory; name the file to write the receipt to")
    parent = out.parent
    if not parent.is_dir():
        raise InvalidRequest(f"--out {path}: no directory {parent}" if not parent.exists() else
                             f"--out {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InvalidRequest(f"--out {path}: cannot write in {parent}")


def _prefix_file(path: str, tokens: bool) -> str | list[int]:
    """The prefix `--prefix-file` names: its text (UTF-8, exactly as stored: a final newline is part
    of it), or with `--prefix-tokens` its JSON array of token ids. A file that cannot be read or
    parsed is the command's bad input: refused here, before any server is asked (a typed `Failure`
    InvalidRequest, exit 2). An empty file (or array) is no prefix: an ordinary open."""
    def bad(why: str) -> Failure:
        return InvalidRequest(f"--prefix-file {path}: {why}")

    try:
        data = Path(path).read_bytes()  # bytes: no newline translation, the text is the prefix
    except OSError as exc:
        raise bad(f"cannot read it: {exc.strerror or exc}") from exc
    if not tokens:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad(f"not UTF-8 text (byte {exc.start}); token ids go in a JSON array, with --prefix-tokens") \
                from exc
        return text
    try:
        ids = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"not a JSON array of token ids ({exc})") from exc
    if not isinstance(ids, list):
        raise bad(f"not a JSON array of token ids (a {type(ids).__name__})")
    for i, t in enumerate(ids):
        if type(t) is not int:  # not bool, not 1.0
            raise bad(f"element {i} is not a token id (an integer): {json.dumps(t)[:40]}")
        if not 0 <= t < _TOKEN_LIMIT:
            raise bad(f"element {i} is not a token id (0 <= id < 2**31): {t}")
    return ids


def _prefix_said(origin: Any, position: int) -> tuple[dict, str]:
    """A prefix open's origin for --json, and its line for people."""
    stored, total = origin.stored_tokens, origin.tokens
    if stored == 0:
        how = "all computed, none from the prefix store"
    else:
        how = f"{stored} from the prefix store ({origin.scope} scope)" + \
            (f", {total - stored} computed" if stored < total else "")
    data = {"digest": origin.digest, "tokens": total, "stored_tokens": stored, "scope": origin.scope}
    return data, f"opened at position {position}, after a prefix of {total} tokens ({origin.digest}): {how}"


async def _open(args: argparse.Namespace) -> int:
    from mamba_stream.workflows import OpenFailed

    # the prefix first: a file that is not one fails here, with nothing started
    if args.prefix_tokens and args.prefix_file is None:
        raise InvalidRequest("--prefix-tokens says how --prefix-file is read: give --prefix-file")
    prefix = _prefix_file(args.prefix_file, args.prefix_tokens) if args.prefix_file is not None else None
    prefix = prefix or None  # an empty prefix is an ordinary open
    if prefix is not None:  # what the stream's options refuse is refused here too, before any server is asked
        from mamba_stream.workflows import OpenStreamInput, StreamOptions, check_prefix

        opts = StreamOptions()
        check_prefix(OpenStreamInput(principal=args.principal, model_id=args.model, prefix=prefix, options=opts), opts)
    streams = await _streams(args)
    try:
        sid = await streams.open(args.principal, args.model, input_transform=args.input_transform,
                                 prefix=prefix, worker_timeout_s=args.worker_timeout)
    except OpenFailed as exc:
        # the id of the stream that was started (and terminated), to look up in the UI or `list`
        sid = exc.details().get("stream_id")
        if sid:
            _emit(args, {"stream_id": sid, "opened": False}, sid)
        raise
    if prefix is None:
        _emit(args, {"stream_id": sid}, sid)
        return 0
    receipt = await streams.receipt(sid)
    origin = receipt.origin if receipt is not None else None
    if origin is None or origin.kind != "prefix":
        _emit(args, {"stream_id": sid, "position": receipt.position if receipt else None, "prefix": None}, sid)
        raise PrefixNotApplied(f"stream {sid} opened, but its receipt names no prefix (position "
                               f"{receipt.position if receipt else '?'}): do the workers predate prefixes?")
    data, line = _prefix_said(origin, receipt.position)
    # stdout holds the id alone, as ever (`sid=$(mamba-stream open ...)`); the prefix's line is for people
    _emit(args, {"stream_id": sid, "position": receipt.position, "prefix": data}, sid)
    if not args.json:
        print(line, file=sys.stderr)
    return 0


async def _committed(streams: Any, args: argparse.Namespace) -> tuple[int, int] | None:
    """(epoch, newest committed chunk) of the stream before a chunk sent under an explicit --seq (it
    may be one sent before); None without --seq: the next chunk is new by construction."""
    if args.seq is None:
        return None
    st = await streams.stats(args.stream)
    return st.epoch, st.chunk_seq


def _marked(res: Any, before: tuple[int, int] | None) -> Any:
    """`res`, marked duplicate when the stream had committed its chunk before this command sent it:
    Temporal answers an update id it has seen with that update's first outcome, whose `duplicate`
    is false (the workflow marks only what it answers from its own records)."""
    if before is not None and not res.duplicate and res.receipt.epoch == before[0] and res.chunk_seq <= before[1]:
        return res.model_copy(update={"duplicate": True})
    return res


async def _feed(args: argparse.Namespace) -> int:
    text = _chunk_text(args)  # read and checked before any server is asked (--tokens: as argparse read it)
    limits = _chunk_limits()
    if args.tokens is not None and len(args.tokens) > limits["chunk_tokens_max"]:
        from mamba_stream.workflows import ChunkTooLarge

        raise ChunkTooLarge(f"--tokens: {len(args.tokens)} token ids exceed the most any stream takes, "
                            f"{limits['chunk_tokens_max']} (a stream opened with the default options takes "
                            f"{limits['chunk_tokens']})")
    streams = await _streams(args)
    before = await _committed(streams, args)
    res = _marked(await streams.advance(args.stream, args.principal, text=text, tokens=args.tokens,
                                        chunk_seq=args.seq, attempt=args.attempt), before)
    top = ", ".join(f"{t.token}:{t.logprob:.2f}" for t in res.top_k)
    _emit(args, res, f"chunk {res.chunk_seq}: {res.n_tokens} tokens, position {res.position}"
                     f"{' (duplicate: first result returned)' if res.duplicate else ''}\n"
                     f"  next-token top-k {top}\n  outputs {res.output_digest}\n  state {res.receipt.checksum}")
    return 0


async def _generate(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    # the chunk's sequence, known before it is sent: an interrupted command can say where its result will be
    before = await _committed(streams, args)
    seq = args.seq if args.seq is not None else await streams.next_seq(args.stream)
    kw = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed, stop=args.stop or (),
              chunk_seq=seq, attempt=args.attempt)
    shown = False
    try:
        if args.json or args.no_stream:
            res = await streams.generate(args.stream, args.principal, args.n, **kw)
        else:
            # the text as it is sampled (token ids for a model without an input transform), then the result
            gen = streams.generate_stream(args.stream, args.principal, args.n, **kw)
            async for ev in gen:
                if ev.restart:
                    sys.stdout.write("\n[the committed tokens differ from those shown; they are:]\n")
                # escaped: the model's bytes never reach the terminal raw (--json escapes them as JSON)
                sys.stdout.write(_shown(ev.text) if ev.text is not None else "".join(f"{t} " for t in ev.tokens))
                sys.stdout.flush()
                shown = True
            sys.stdout.write("\n")
            res = gen.result
        res = _marked(res, before)
    except asyncio.CancelledError:  # Ctrl-C: the update was sent, and the worker goes on with the chunk
        if shown:
            sys.stdout.write("\n")
            sys.stdout.flush()
        # the chunk is the stream's now: what becomes of it, and where its result is, in one line
        print(f"interrupted: chunk {seq} is still in flight: it commits on the worker unless the stream is "
              f"cancelled, and a feed or generate without --seq waits behind it; its result: "
              f"mamba-stream tokens {args.stream} --seq {seq}", file=sys.stderr, flush=True)
        args.interrupt_said = True
        raise
    _emit(args, res, f"chunk {res.chunk_seq}: generated {len(res.tokens)} tokens ({res.finish_reason}), "
                     f"position {res.position}{' (duplicate: first result returned)' if res.duplicate else ''}\n"
                     f"  tokens {res.tokens}\n  text {res.text!r}")  # repr: escaped, as the streamed text
    return 0


async def _tokens_cmd(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    async for ev in streams.tokens(args.stream, from_offset=args.from_offset, chunk_seq=args.seq):
        if args.json:
            print(json.dumps(ev.model_dump(mode="json")), flush=True)
        else:
            # escaped, as generate shows it: the model's bytes never reach the terminal raw
            piece = _shown(ev.text) if ev.text is not None else "".join(f"{t} " for t in ev.tokens)
            sys.stdout.write(("\n" if ev.restart else "") + piece + ("\n" if ev.done else ""))
            sys.stdout.flush()
        if args.seq is not None and ev.done:
            break
    return 0


async def _receipt(args: argparse.Namespace) -> int:
    streams = await _streams(args)
    rec = await streams.receipt(args.stream)
    stats = await streams.stats(args.stream)
    # JSON whether or not --json: the receipt is a record to keep or pipe, not a sentence
    print(json.dumps({"receipt": rec.model_dump(mode="json") if rec else None,
                      "stats": stats.model_dump(mode="json")}, indent=2))
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
    _emit(args, {"stream_id": args.stream, "cancelled": True},
          f"{args.stream} cancelled" + ("" if args.no_wait else ": its state is deleted"))
    return 0


async def _list(args: argparse.Namespace) -> int:
    from mamba_stream.workflows import STREAM_MEMO, STREAM_WORKFLOW_TYPE, ClientConfig

    # every workflow of the queue: a stream workflow, or one that owns a stream (an agent's: its memo
    # says so; the field's name is in clear, its value encrypted)
    terms = []
    if not args.all_queues:
        queue = args.task_queue or ClientConfig().task_queue
        if "'" in queue:  # refused before connecting: the name alone says it
            raise InvalidRequest(f"a task queue name with a quote cannot be listed: {queue!r}")
        terms.append(f"TaskQueue = '{queue}'")
    client = await _connect(args)
    if args.running:
        terms.append("ExecutionStatus = 'Running'")
    # one line per stream: a stream's runs (continue-as-new, rewinds) share its id; the newest is its state
    newest: dict[str, Any] = {}
    async for wf in client.list_workflows(" AND ".join(terms) or None):
        if wf.workflow_type != STREAM_WORKFLOW_TYPE and STREAM_MEMO not in wf.raw_info.memo.fields:
            continue
        seen = newest.get(wf.id)
        if seen is None and len(newest) >= args.limit:
            break
        if seen is None or wf.start_time > seen.start_time:
            newest[wf.id] = wf
    rows = [{"stream_id": wf.id, "status": wf.status.name.lower() if wf.status else "unknown",
             "start_time": wf.start_time.isoformat(),
             "close_time": wf.close_time.isoformat() if wf.close_time else None,
             "run_id": wf.run_id, "task_queue": wf.task_queue, "workflow_type": wf.workflow_type,
             "reason": await _why_closed(client, wf)}
            for wf in sorted(newest.values(), key=lambda w: w.start_time, reverse=True)]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            owner = "" if r["workflow_type"] == STREAM_WORKFLOW_TYPE else f"  (owned by {r['workflow_type']})"
            why = f"  {_shown(r['reason']).replace(chr(10), ' ')}" if r["reason"] else ""
            print(f"{r['stream_id']}  {r['status']:<10}  {r['start_time']}{owner}{why}")
    return 0


async def _why_closed(client: Any, wf: Any) -> str | None:
    """Why a stream's run ended otherwise than by a cancel or completion (`<Reason>: <message>`:
    a refused open or resume fails its run, typed), from its last event alone; None for the rest."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import EventType
    from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest
    from temporalio.client import WorkflowExecutionStatus

    if wf.status not in (WorkflowExecutionStatus.FAILED, WorkflowExecutionStatus.TERMINATED,
                         WorkflowExecutionStatus.TIMED_OUT):
        return None
    got = await client.workflow_service.get_workflow_execution_history_reverse(
        GetWorkflowExecutionHistoryReverseRequest(namespace=client.namespace, maximum_page_size=1,
                                                  execution=WorkflowExecution(workflow_id=wf.id, run_id=wf.run_id)))
    last = got.history.events[0] if got.history.events else None
    if last is None:
        return None
    if last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED:
        return f"terminated: {last.workflow_execution_terminated_event_attributes.reason or 'no reason given'}"
    if last.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TIMED_OUT:
        return "timed out"
    if last.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED:
        return None
    from mamba_stream.state_codec.payload import ENCODED_FAILURE

    err = await client.data_converter.decode_failure(last.workflow_execution_failed_event_attributes.failure)
    # the run's failure wraps the refusal (an activity's, a child's): the innermost typed one says why
    while getattr(err, "cause", None) is not None and not getattr(err, "type", None):
        err = err.cause
    reason = getattr(err, "type", None) or type(err).__name__
    message = getattr(err, "message", None) or str(err)
    if message.startswith(ENCODED_FAILURE):
        message = _undecodable(reason)
    return f"{reason}: {message}"


async def _checkpoint(args: argparse.Namespace) -> int:
    if args.out:
        _out_file(args.out)  # before the checkpoint is taken (and pinned) that could not be written
    streams = await _streams(args)
    res = await streams.checkpoint(args.stream, args.principal)
    if args.out:
        Path(args.out).write_text(res.receipt.model_dump_json(indent=2))
        os.chmod(args.out, 0o600)
    _emit(args, res, f"checkpoint of {res.stream_id} at position {res.receipt.position}: "
                     f"{res.receipt.state_key}" + (f"\n  receipt written to {args.out}" if args.out else ""))
    return 0


async def _resume(args: argparse.Namespace) -> int:
    from mamba_stream.workflows import OpenFailed

    receipt = _checkpoint_file(args.checkpoint, args.principal)  # before anything is started for it
    streams = await _streams(args)
    try:
        sid = await streams.open(args.principal, receipt.model_id, resume=receipt,
                                 worker_timeout_s=args.worker_timeout)
    except OpenFailed as exc:
        if exc.details().get("stream_id"):
            _emit(args, {"stream_id": exc.details()["stream_id"], "opened": False}, exc.details()["stream_id"])
        raise
    # stdout holds the id alone, as `open`'s does (`sid=$(mamba-stream resume ...)`); the rest is for people
    _emit(args, {"stream_id": sid, "resumed_from": receipt.stream_id, "position": receipt.position}, sid)
    if not args.json:
        print(f"resumed from {receipt.stream_id} at position {receipt.position}", file=sys.stderr)
    return 0


async def _sweep(args: argparse.Namespace) -> int:
    import time

    from mamba_stream.activities import StoreOwnedElsewhere, open_store, sweep_orphans
    from mamba_stream.worker import WorkerConfig

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


def _rekey_store(args: argparse.Namespace) -> int:
    from mamba_stream.activities import StoreError, open_store, rekey_store
    from mamba_stream.state_codec.keyring import KeyringError, find_keyring
    from mamba_stream.worker import WorkerConfig

    cfg = WorkerConfig()
    url = args.store or cfg.store
    if url.startswith("file:"):  # a mistyped path names no store: make none there
        root = Path(url[len("file://"):] if url.startswith("file://") else url[len("file:"):])
        if not (root / "objects").is_dir():
            print(f"error: no state store at {root} (--store, or $MAMBA_STREAM_STORE)", file=sys.stderr)
            return 2
    try:
        keyring = find_keyring(cfg.keyring, cfg.home)  # the workers' (never made here: a new one opens nothing)
        if keyring.principal is not None:
            raise KeyringError(f"rekeying needs the workers' master keyring, not principal {keyring.principal!r}'s "
                               f"(MAMBA_STREAM_KEYRING)")
        with open_store(url) as store:
            rep = rekey_store(store, keyring)
    except (KeyringError, StoreError, ValueError) as exc:
        # one line: a driver's message spans several
        print(f"error: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"store": url, **dataclasses.asdict(rep)}))
    else:
        print(f"{url}: {rep.objects} objects rewritten owned by their principal's tag ({rep.resealed} checkpoints "
              f"resealed), {rep.records} prefix records sealed")
    if rep.unreadable:
        print(f"{rep.unreadable} checkpoints do not authenticate under this keyring (MAMBA_STREAM_KEYRING) and were "
              f"left as they are", file=sys.stderr)
        return 1
    return 0


def _codec_server(args: argparse.Namespace) -> int:
    from mamba_stream.state_codec.codec_server import CodecServer, principal_tokens_from_env
    from mamba_stream.state_codec.keyring import KeyringError, default_home
    from mamba_stream.workflows import ClientConfig

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
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


def _undecodable(reason: str) -> str:
    """What to say of a failure whose message the workers encrypted under a key we lack."""
    from mamba_stream.state_codec import UnknownKeyId
    from mamba_stream.workflows import ClientConfig

    try:
        kid = ClientConfig().load_keyring().active_id
    except Exception:  # noqa: BLE001 - a hint only
        kid = "?"
    if reason == UnknownKeyId.reason:
        return (f"the workers do not hold this client's key {kid}: the client and the workers use different "
                f"keyrings (the failure's own message is encrypted under the workers' key)")
    return f"the failure's message is encrypted under a key this client's keyring (active key {kid}) lacks"


#: an update the stream took, ended because the stream's run closed first (cancelled, terminated)
_UPDATE_OUTLIVED = "AcceptedUpdateCompletedWorkflow"


async def _stream_gone(args: argparse.Namespace, exc: BaseException) -> Failure | None:
    """"no such stream" / "the stream was cancelled" for a call that failed because the stream is
    missing or closed (an RPC error, an update its closing run ended), from the stream's own
    description; None for any other failure."""
    from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
    from temporalio.service import RPCError, RPCStatusCode

    sid, client = getattr(args, "stream", None), getattr(args, "client", None)
    if not isinstance(sid, str) or client is None:
        return None
    # the server says a closed or missing stream in many words (NOT_FOUND "workflow not found", "workflow
    # execution already completed", a query's "closed before WorkflowTaskStarted"): the stream's
    # description decides, and a running stream's RPC error stays what it is
    if not isinstance(exc, RPCError) and not (
            isinstance(exc, WorkflowUpdateFailedError) and getattr(exc.cause, "type", None) == _UPDATE_OUTLIVED):
        return None
    try:
        desc = await client.get_workflow_handle(sid).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return NoSuchStream(f"no such stream: {sid}")
        return None
    status = desc.status
    if status in (WorkflowExecutionStatus.CANCELED, WorkflowExecutionStatus.COMPLETED):
        # a stream's run completes only when its principal or the operator cancels it
        from mamba_stream.workflows import StreamCancelled

        return StreamCancelled(f"the stream was cancelled: {sid}")
    if status is not None and status != WorkflowExecutionStatus.RUNNING:
        return StreamClosed(f"the stream is closed ({status.name.lower()}): {sid}")
    return None


async def _explain(args: argparse.Namespace, exc: BaseException) -> tuple[str, str]:
    """(reason, message) of a command's failure, for its one line on stderr: every stream command's
    errors are mapped here."""
    if isinstance(exc, Failure):  # typed here, or by StreamClient before any server was asked
        return exc.reason, str(exc)
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):  # a request this side would not build from what it was given
        return InvalidRequest.reason, f"{exc.title}: {_problems(exc)}"
    gone = await _stream_gone(args, exc)
    if gone is not None:
        return gone.reason, str(gone)
    # an ApplicationError raised here (a payload refused on this side) is typed itself; a typed
    # failure of the client (workflows.StreamFailure) names its reason; a failed update or workflow
    # carries its typed cause
    typed = exc if getattr(exc, "type", None) else getattr(exc, "cause", None)
    own = getattr(exc, "reason", None)
    reason = getattr(typed, "type", None) or (own if isinstance(own, str) else None) or type(exc).__name__
    message = getattr(typed, "message", None) or str(exc)
    from mamba_stream.state_codec.payload import ENCODED_FAILURE

    if message.startswith(ENCODED_FAILURE):  # Temporal's stand-in: the message is encrypted, not for us
        message = _undecodable(reason)
    return reason, message


#: how long a command may take to stop after Ctrl-C before it leaves at once (`_leave_if_stuck`)
INTERRUPT_GRACE_S = 10.0


def _leave_if_stuck() -> None:
    """After the first Ctrl-C, the command stops (asyncio.run cancels it, and what it was doing
    says what goes on); should it still be here `INTERRUPT_GRACE_S` later (an await that does not
    end when cancelled: a bug), it says so in one line and leaves (exit 130) instead of leaving the
    user waiting. With MAMBA_STREAM_DEBUG set, where each task waits comes first. A command
    started with SIGINT ignored (in the background of a shell without job control) keeps it
    ignored, as Python does."""
    runner_sigint = signal.getsignal(signal.SIGINT)
    if not callable(runner_sigint):
        return
    loop = asyncio.get_running_loop()
    armed: list[threading.Timer] = []

    def leave() -> None:
        if os.environ.get("MAMBA_STREAM_DEBUG"):
            for task in list(asyncio.all_tasks(loop)):  # a snapshot for the record: the loop is stuck
                print(f"--- {task!r}", *_awaiting(task.get_coro()), sep="\n", file=sys.stderr)
        print(f"interrupted: the command did not stop within {INTERRUPT_GRACE_S:.0f} s of Ctrl-C; leaving",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)

    def on_sigint(signum: int, frame: Any) -> None:
        if not armed:
            timer = threading.Timer(INTERRUPT_GRACE_S, leave)
            timer.daemon = True
            timer.start()
            armed.append(timer)
        runner_sigint(signum, frame)

    signal.signal(signal.SIGINT, on_sigint)


def _awaiting(coro: Any) -> list[str]:
    """Where a task waits: its coroutine and each one it awaits, outermost first (a task's own
    stack shows only the outermost)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


async def _guarded(fn: Callable[[argparse.Namespace], Awaitable[int]], args: argparse.Namespace) -> int:
    _leave_if_stuck()
    try:
        return await fn(args)
    except Exception as exc:  # noqa: BLE001 - the CLI reports, with the typed reason
        reason, message = await _explain(args, exc)
        print(f"error: {reason}: {message}", file=sys.stderr)
        return 2


#: the exit status of a command interrupted by Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130


def _run(fn: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], int]:
    def call(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(_guarded(fn, args))
        except (KeyboardInterrupt, asyncio.CancelledError):
            # asyncio.run cancels the command on Ctrl-C: what it was doing said what goes on
            # (a generate's chunk); no traceback
            if not getattr(args, "interrupt_said", False):
                print("interrupted", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
    return call


class _LazyHelp(UserString):
    """Help text filled in when the help is shown: what fills it in (the models served, the limits)
    means importing `workflows` (most of a second), which no other use of the parser needs."""

    def __init__(self, template: str) -> None:  # `template` names what `fill` gives, {name}
        self.template = template

    def fill(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def data(self) -> str:  # type: ignore[override]
        # % escaped: argparse fills help in with %-formatting
        return self.template.format(**self.fill()).replace("%", "%%")

    def __mod__(self, params: Any) -> str:  # argparse's last step: a plain str from here on
        return self.data % params


class _ServedModels(_LazyHelp):
    """Help text naming the models the workers serve: `template` has one {models}."""

    def fill(self) -> dict[str, Any]:
        from mamba_stream.workflows import ClientConfig

        ids = ", ".join(ClientConfig().model_ids())
        where = "from MAMBA_STREAM_MODELS" if os.environ.get("MAMBA_STREAM_MODELS") else \
            "the worker's default, without MAMBA_STREAM_MODELS"
        return {"models": f"{ids} ({where}; a worker may serve others)"}


class _Limits(_LazyHelp):
    """Help text naming a chunk's limits, from the code's own (`_chunk_limits`): never a number
    written twice."""

    def fill(self) -> dict[str, Any]:
        return {k: _num(v) for k, v in _chunk_limits().items()}


def add_stream_commands(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--address", default=None, help="Temporal frontend (default $TEMPORAL_ADDRESS, else the "
                       "worker's embedded server, 127.0.0.1:$MAMBA_STREAM_TEMPORAL_PORT, port 7233 by default)")
        p.add_argument("--task-queue", default=None, help="the streams' task queue (default "
                       "$MAMBA_STREAM_TASK_QUEUE or mamba-stream)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    # the flags' types refuse, as argparse reads them, what the requests would (`_field_range`)
    seq = _integer(_request_range("AdvanceRequest", "chunk_seq"))  # a generate's chunk_seq is the same field's
    attempt = _integer(lambda: (0, None))  # the update id's attempt: 0 is the first

    def stream(p: argparse.ArgumentParser) -> None:
        p.add_argument("stream", help="the stream's id (ms-... or ms.<tag>.<hex>, as `open` printed it)")

    def worker_timeout(p: argparse.ArgumentParser) -> None:
        p.add_argument("--worker-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="fail, terminating the stream it started, when no worker takes it within this "
                       "many seconds (default 10: none polls the task queue)")

    p = common(sub.add_parser("open", help=_ServedModels("open a stream on a model: {models}"),
                              description="Open a stream and print its id on stdout (--model's help lists the "
                                          "models served)."))
    p.add_argument("--principal", required=True, type=_principal,
                   help="who owns the stream (its key seals its payloads)")
    p.add_argument("--model", required=True, help=_ServedModels("the model's id: {models}"))
    p.add_argument("--input-transform", default=None,
                   help="the input transform's id: the tokenizer that turns --text into tokens (default: the "
                   "model's own)")
    p.add_argument("--prefix-file", default=None, metavar="FILE",
                   help="open the stream at the end of this prefix (from the workers' prefix store when it holds "
                   "it, else computed and stored): FILE's text, UTF-8, all of it (a final newline included), which "
                   "the input transform makes tokens; with --prefix-tokens, token ids. Its tokens and how many came "
                   "from the store go to stderr (--json: \"prefix\")")
    p.add_argument("--prefix-tokens", action="store_true",
                   help="--prefix-file holds token ids, as a JSON array of integers: [1, 2, 3]")
    worker_timeout(p)
    p.set_defaults(func=_run(_open))

    p = common(sub.add_parser("feed", help="advance a stream by a chunk of text or tokens"))
    stream(p)
    p.add_argument("--principal", required=True, type=_principal, help="the stream's principal")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help=_Limits(
        "the chunk as text (the stream's input transform makes it tokens); - reads it from stdin, all of it (a "
        "final newline included). The largest chunk a stream opened with the default options takes: "
        "{text_bytes} bytes of UTF-8 (StreamOptions.max_text_bytes; no stream takes more than {text_bytes_max})"))
    g.add_argument("--text-file", default=None, metavar="FILE",
                   help="the chunk as the text of FILE: UTF-8, all of it (a final newline included), as for --text")
    g.add_argument("--tokens", type=_token_ids, help=_Limits(
        "the chunk as comma-separated token ids (0 <= id < 2**31); the largest chunk a stream opened with the "
        "default options takes: {chunk_tokens} tokens (StreamOptions.max_chunk_tokens; no stream takes more than "
        "{chunk_tokens_max})"))
    p.add_argument("--seq", type=seq, default=None, help="chunk sequence (default: the next); part of the update "
                   "id: a chunk sent again under its sequence returns the first result, marked duplicate")
    p.add_argument("--attempt", type=attempt, default=0, help="send a chunk again whose update failed for a reason "
                   "that was not its own (a store fault, a rewind past the window): 1, 2, ...")
    p.set_defaults(func=_run(_feed))

    p = common(sub.add_parser("generate", help="sample tokens (seeded) that advance the stream"))
    stream(p)
    p.add_argument("--principal", required=True, type=_principal, help="the stream's principal")
    p.add_argument("-n", type=_integer(_request_range("GenerateRequest", "max_tokens")), required=True,
                   help=_Limits("the most tokens to sample: at most {generate_tokens} on a stream opened with the "
                                "default options (StreamOptions.max_generate_tokens; no stream takes more than "
                                "{n_max})"))
    p.add_argument("--seed", type=_integer(_request_range("GenerateRequest", "seed")), default=None,
                   help="sampling seed (default: derived from the stream and the chunk sequence)")
    p.add_argument("--temperature", type=_number(_request_range("GenerateRequest", "temperature")), default=1.0,
                   help="sampling temperature (0: greedy; default 1)")
    p.add_argument("--top-k", type=_integer(_request_range("GenerateRequest", "top_k")), default=0,
                   help="sample among the k most likely tokens (default 0: all)")
    p.add_argument("--stop", action="append", help="stop once the text ends with this (repeatable)")
    p.add_argument("--seq", type=seq, default=None, help="chunk sequence (default: the next), as for feed")
    p.add_argument("--attempt", type=attempt, default=0, help="as for feed")
    p.add_argument("--no-stream", action="store_true", help="print the result only, not the text as it is "
                   "sampled (--json never streams)")
    p.set_defaults(func=_run(_generate))

    p = common(sub.add_parser("tokens", help="follow the stream's token log: its generates' text as it is "
                              "sampled, from an offset (each entry's offset is in --json)"))
    stream(p)
    p.add_argument("--from-offset", type=_integer(_request_range("ReadTokensRequest", "from_offset")), default=0,
                   help="reconnect: the last entry's offset + 1")
    p.add_argument("--seq", type=_integer(_request_range("ReadTokensRequest", "chunk_seq")), default=None,
                   help="only this chunk's entries; stop at its last")
    p.set_defaults(func=_run(_tokens_cmd))

    p = common(sub.add_parser("receipt", help="the stream's current receipt and counters, as JSON "
                              "({\"receipt\": ..., \"stats\": ...}, with or without --json)"))
    stream(p)
    p.set_defaults(func=_run(_receipt))

    p = common(sub.add_parser("reset", help="start a new epoch at position 0 (a signal)"))
    stream(p)
    p.add_argument("--principal", required=True, type=_principal, help="the stream's principal")
    p.add_argument("--revoke", action="store_true",
                   help="also delete every checkpoint of the earlier epochs, pinned ones included (default: kept)")
    p.set_defaults(func=_run(_reset))

    p = common(sub.add_parser("rewind", help="undo the chunks after --to-seq (the stream continues, in a new run, "
                                             "from that chunk's checkpoint)"))
    stream(p)
    p.add_argument("--to-seq", type=_integer(_request_range("RewindRequest", "to_seq")), required=True,
                   help="the last chunk to keep (0: back to the opened state)")
    p.add_argument("--principal", default=None, type=_principal,
                   help="the stream's principal (default: read from the stream)")
    p.set_defaults(func=_run(_rewind))

    p = common(sub.add_parser("cancel", help="end the stream and destroy its state (the sealed cancel signal, "
                                             "then Temporal's cancel request)"))
    stream(p)
    p.add_argument("--principal", default=None, type=_principal,
                   help="the stream's principal (default: read from the stream)")
    p.add_argument("--no-wait", action="store_true", help="return once the cancel is sent")
    p.set_defaults(func=_run(_cancel))

    p = common(sub.add_parser("list", help="the streams on the server: id, status, start time (newest first); a "
                              "stream a workflow of yours owns names its workflow type"))
    p.add_argument("--running", action="store_true", help="only the running streams")
    p.add_argument("--all-queues", action="store_true",
                   help="the streams of every task queue (default: those of --task-queue)")
    p.add_argument("--limit", type=_integer(lambda: (1, None)), default=100,
                   help="the most streams to list (default 100)")
    p.set_defaults(func=_run(_list))

    p = common(sub.add_parser("checkpoint", help="a portable receipt of the stream's state"))
    stream(p)
    p.add_argument("--principal", required=True, type=_principal, help="the stream's principal")
    p.add_argument("--out", help="write the receipt JSON here (mode 0600)")
    p.set_defaults(func=_run(_checkpoint))

    p = common(sub.add_parser("resume", help="open a new stream from a checkpoint receipt; print its id"))
    p.add_argument("--principal", required=True, type=_principal,
                   help="the principal of the new stream (the checkpoint's own)")
    p.add_argument("--checkpoint", required=True, help="receipt JSON file (from `checkpoint --out`)")
    worker_timeout(p)
    p.set_defaults(func=_run(_resume))

    p = common(sub.add_parser("sweep", help="find and delete states whose stream's workflow is gone",
                              description="Find and delete states whose stream's workflow is gone. Refuses, "
                                          "deleting nothing and exiting 3, when the store belongs to another "
                                          "Temporal cluster or namespace, or has no owner record yet."))
    p.add_argument("--grace", type=float, default=3600.0, help="seconds since the workflow closed (default 3600)")
    p.add_argument("--dry-run", action="store_true", help="list the orphans, delete nothing")
    p.add_argument("--claim", action="store_true",
                   help="record this server's cluster and namespace as the owner of a store that has none")
    p.set_defaults(func=_run(_sweep))

    p = sub.add_parser("rekey-store", help="rewrite what an earlier version left in clear in the state store keyed",
                       description="Rewrite a state store written before owners were tagged (principal names, "
                                   "checksums and prefix records in clear) so that it holds ciphertext and keyed tags "
                                   "only, nothing lost; every worker's sweep does the same. Safe beside running "
                                   "workers, and again: a second run finds nothing. Run it once every worker is "
                                   "upgraded (an older worker cannot read what this writes). Exits 1 when a "
                                   "checkpoint does not authenticate under the keyring (left as it is).")
    p.add_argument("--store", default=None, help="the store's URL (default the workers': $MAMBA_STREAM_STORE, else "
                   "file://$MAMBA_STREAM_HOME/states)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_rekey_store)

    p = sub.add_parser("codec-server", help="serve /encode and /decode for the Temporal UI and CLI")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8081, help="the port to listen on (default 8081)")
    p.add_argument("--origins", default="http://localhost:8233,http://127.0.0.1:8233",
                   help="comma-separated browser origins allowed (CORS), the Temporal UI's (default "
                   "http://localhost:8233,http://127.0.0.1:8233)")
    p.add_argument("--token-file", default=None, help="a file holding the token every request must carry "
                   "(default $MAMBA_STREAM_CODEC_TOKEN, else a random one); never a token on the command line")
    p.add_argument("--endpoint-file", default=None, help="where a random token's endpoint is written (0600; "
                   "default $MAMBA_STREAM_HOME/codec-endpoint)")
    p.set_defaults(func=_codec_server)
