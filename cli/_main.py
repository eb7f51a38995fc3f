"""`mamba-stream`: commands for people (this module prints; the library logs)."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from scan import load_model
    from scan._verify import verify_chunking

    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    ok = True
    for backend in args.backend.split(","):
        model = load_model(args.model, backend=backend, dtype=dtype)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mamba-stream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="print the chunk-equivalence report of a model")
    v.add_argument("--model", default="tiny-mamba2", help="preset name or checkpoint directory")
    v.add_argument("--backend", default="reference,chunked", help="comma-separated backends")
    v.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    v.add_argument("--tokens", type=int, default=97)
    v.add_argument("--seed", type=int, default=0)
    v.set_defaults(func=_cmd_verify)

    from cli._demo import add_demo_command
    from cli._streams import add_stream_commands

    add_stream_commands(sub)
    add_demo_command(sub)
    args = parser.parse_args(argv)
    code = int(args.func(args))
    if getattr(args, "hard_exit", False):
        # The Temporal client's native runtime threads can race interpreter shutdown and abort
        # the process after the work is done ("PyGILState_Release ... finalizing"): leave
        # without finalizing once everything is flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
