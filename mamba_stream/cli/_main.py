"""`mamba-stream`: commands for people (this module prints; the library logs)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from mamba_stream.failures import InvalidRequest

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its errors in the CLI's one line on stderr, `error: InvalidRequest: <what>`,
    exit status 2, as every command's own refusals (argparse's: a usage block, then `<prog>: error:
    ...`). Subcommands' parsers are of this class too (`add_subparsers` makes them of the parent's)."""

    def error(self, message: str) -> NoReturn:
        # "argument -n: must be ..." -> "-n: must be ...": the flag leads, as `--prefix-file FILE: ...` does
        # (its lines joined: one line, whatever argparse says; the spaces of a value it quotes kept)
        what = " ".join(message.removeprefix("argument ").splitlines())
        self.exit(2, f"error: {InvalidRequest.reason}: {what}\n")


def _cmd_verify(args: argparse.Namespace) -> int:
    if args.markdown:
        from pathlib import Path

        from mamba_stream.cli._release import VERIFY_RUNS, render_verification

        runs = VERIFY_RUNS if args.model is None else tuple(
            (m, b) for m in args.model.split(",") for b in args.backend.split(","))
        text, ok = render_verification(runs, n_tokens=args.tokens, seed=args.seed)
        if args.out:
            Path(args.out).write_text(text)
            print(f"wrote {args.out}: {'PASS' if ok else 'FAIL'}")
        else:
            print(text)
        return 0 if ok else 1
    import torch

    from mamba_stream.scan import load_model, verify_chunking

    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    ok = True
    for backend in args.backend.split(","):
        model = load_model(args.model or "tiny-mamba2", backend=backend, dtype=dtype)
        rep = verify_chunking(model, n_tokens=args.tokens, seed=args.seed)
        ok &= rep.passed
        print(f"chunk equivalence: {rep.model_id} ({rep.architecture}, {rep.revision[:19]}...)")
        print(f"backend {rep.backend}, dtype {rep.dtype}, {rep.n_tokens} tokens, "
              f"full scan {rep.full_seconds * 1000:.1f} ms")
        print(f"  {'partition':<28} {'chunks':>6} {'logits max|diff|':>17} {'state max|diff|':>16} "
              f"{'result':>7} {'ms':>8}")
        for r in rep.rows:
            verdict = "exact" if r.exact else ("within" if r.passed else "FAIL")
            print(f"  {r.name:<28} {len(r.chunks):>6} {r.logits_max_diff:>17.3e} {r.state_max_diff:>16.3e} "
                  f"{verdict:>7} {r.seconds * 1000:>8.1f}")
        print(f"  reset control: A+B differs from B alone: {rep.reset_differs}; "
              f"reset then B equals fresh B: {rep.reset_equals_fresh}")
        print(f"  {'PASS' if rep.passed else 'FAIL'}\n")
    return 0 if ok else 1


def _cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mamba_stream.quality.evaluate import EvalConfig, append_run, evaluate_attention, evaluate_preset, render_run

    cfg = EvalConfig(n=args.n)
    if args.max_delay is not None:
        cfg.delays = tuple(d for d in cfg.delays if d <= args.max_delay)
        cfg.chunked_delays = tuple(d for d in cfg.chunked_delays if d <= args.max_delay)
    reports = []
    from mamba_stream.scan import TRAINED_PRESETS

    # by default the presets trained on the memory tasks this suite measures (kjv-mamba2 learned
    # text: its card has its bits per byte)
    recall = sorted(n for n in TRAINED_PRESETS if n.startswith("recall-"))
    for name in (args.models.split(",") if args.models else recall):
        for fmt in (args.weights.split(",") if args.weights else [None]):
            print(f"evaluating {name}{f' ({fmt})' if fmt else ''} ...", file=sys.stderr, flush=True)
            reports.append(evaluate_preset(name, cfg) if fmt is None else
                           evaluate_preset(name, cfg, backend="exact", weights=fmt))
    if not args.no_attention:
        print("evaluating the attention baseline ...", file=sys.stderr, flush=True)
        att = evaluate_attention(cfg)
        if att is None:
            print("  (no attention baseline weights; train them with python -m quality.train --arch attention)",
                  file=sys.stderr)
        else:
            reports.append(att)
    section = render_run(reports, cfg)
    print(section)
    if args.append:
        append_run(Path(args.append), section)
        print(f"appended to {args.append}", file=sys.stderr)
    bad = [r.name for r in reports if r.chunked_identical and any(d for d, _ in r.chunked_identical.values())]
    if bad:
        print(f"chunked predictions differ from one-shot for: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mamba_stream.state_codec.signing import RequestSigner

    signer = RequestSigner.generate(args.principal)
    out = Path(args.out)
    if out.exists():
        print(f"{out} exists; not overwriting a key", file=sys.stderr)
        return 1
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(signer.spec() + "\n")
    print(f"signing key of {args.principal!r} written to {out} (0600): the client's MAMBA_STREAM_SIGNING_KEY={out}")
    print("the workers' MAMBA_STREAM_PRINCIPAL_KEYS entry:")
    print(f'  {{"{args.principal}": "{signer.public_key}"}}')
    return 0


def _cmd_export_keys(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mamba_stream.state_codec.keyring import KeyringError, find_keyring

    try:
        master = find_keyring()  # the workers' (MAMBA_STREAM_KEYRING or the home's); never made here
        ring = master.for_principal(args.principal)
    except KeyringError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists():
        print(f"{out} exists; not overwriting a keyring", file=sys.stderr)
        return 1
    ring.save(out)
    print(f"history keys of {args.principal!r} ({len(ring.ids)} key ids) written to {out} (0600): give that client "
          f"MAMBA_STREAM_KEYRING={out}; it reads {args.principal!r}'s streams only")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="mamba-stream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="print the chunk-equivalence report of a model")
    v.add_argument("--model", default=None, help="preset name or checkpoint directory (default tiny-mamba2; "
                   "with --markdown, comma-separated, default the release packet's models)")
    v.add_argument("--backend", default="exact,reference,chunked", help="comma-separated backends")
    v.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    v.add_argument("--tokens", type=int, default=97)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--markdown", action="store_true", help="the release packet's results table (no timings)")
    v.add_argument("--out", default=None, help="with --markdown: write it here (docs/release/verification.md)")
    v.set_defaults(func=_cmd_verify)

    e = sub.add_parser("eval", help="the model-quality suite of the trained presets and the attention baseline")
    e.add_argument("--models", default=None,
                   help="comma-separated trained presets or checkpoint directories (default: every shipped "
                   "preset trained on the memory tasks, recall-*)")
    e.add_argument("--n", type=int, default=200, help="held-out samples per cell")
    e.add_argument("--max-delay", type=int, default=None, help="skip recall delays above this")
    e.add_argument("--no-attention", action="store_true", help="leave out the attention baseline")
    e.add_argument("--weights", default=None, metavar="FORMATS",
                   help="comma-separated weight formats (float32,bfloat16,q8): a row per preset and format, on "
                   "the exact backend")
    e.add_argument("--append", default=None, metavar="PATH",
                   help="append the run to this markdown file (docs/results/quality.md)")
    e.set_defaults(func=_cmd_eval)

    k = sub.add_parser("keygen", help="an Ed25519 key pair for signing a principal's requests")
    k.add_argument("principal")
    k.add_argument("--out", required=True, help="where to write the private key (created 0600)")
    k.set_defaults(func=_cmd_keygen)

    x = sub.add_parser("export-keys", help="a principal's history keys, derived from the workers' keyring, "
                       "for that principal's client")
    x.add_argument("principal")
    x.add_argument("--out", required=True, help="where to write the principal's keyring (created 0600)")
    x.set_defaults(func=_cmd_export_keys)

    from mamba_stream.cli._release import add_release_commands

    add_release_commands(sub)
    from mamba_stream.cli._demo import add_demo_command
    from mamba_stream.cli._streams import add_stream_commands

    add_stream_commands(sub)
    add_demo_command(sub)
    args = parser.parse_args(argv)
    code = int(args.func(args))
    # What was said reaches its pipe before the interpreter shuts down. (The stream commands used
    # to leave here by os._exit, `hard_exit`, as the Temporal runtime's threads could abort a
    # finalizing interpreter; the plugin now shuts them down first: plugin.close_native_clients.)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
