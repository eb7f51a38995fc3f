"""What `mamba-stream` says of input typed by hand that the command line alone shows is bad, and the
limits its help names: the real CLI in a subprocess, no server (nothing here may reach one; the
stream commands' refusals beside a real server, and that nothing was started, are in
test_streams_cli.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from mamba_stream.workflows import GenerateRequest, StreamOptions

ROOT = Path(__file__).resolve().parents[2]


def _nowhere() -> str:
    """An address where no server listens: a command that connected would say Unreachable."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TEMPORAL_ADDRESS": _nowhere(), "COLUMNS": "400"}  # help on one line per option
    return subprocess.run([sys.executable, "-m", "mamba_stream.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_parsers_own_errors_are_one_line_naming_the_flag():
    """argparse's own refusals (a missing flag, two that exclude each other, an unknown command) in
    the CLI's one line, exit 2: no usage block, no `mamba-stream feed: error:`."""
    cases = {
        ("feed", "ms-x", "--text", "hi"): "error: InvalidRequest: the following arguments are required: --principal",
        ("feed", "ms-x", "--principal", "alice"):
            "error: InvalidRequest: one of the arguments --text --text-file --tokens is required",
        ("feed", "ms-x", "--principal", "alice", "--text", "a", "--tokens", "1"):
            "error: InvalidRequest: --tokens: not allowed with argument --text",
        ("feed", "ms-x", "--principal", "alice", "--text", "a", "--text-file", "f"):
            "error: InvalidRequest: --text-file: not allowed with argument --text",
        ("generate", "ms-x", "--principal", "alice"):
            "error: InvalidRequest: the following arguments are required: -n",
        ("generate", "ms-x", "--principal", "alice", "-n"): "error: InvalidRequest: -n: expected one argument",
        ("feed", "ms-x", "--principal", "alice", "--text", "a", "--bogus"):
            "error: InvalidRequest: unrecognized arguments: --bogus",
    }
    for args, line in cases.items():
        out = _cli(*args)
        assert (out.returncode, out.stderr, out.stdout) == (2, line + "\n", ""), (args, out.stderr)


def test_feed_and_generate_help_name_the_limits_from_the_code():
    opts, bounds = StreamOptions(), {k: StreamOptions.model_fields[k].metadata for k in StreamOptions.model_fields}

    def most(meta: list) -> int:
        return next(c.le for c in meta if getattr(c, "le", None) is not None)

    feed = _cli("feed", "--help")
    assert feed.returncode == 0, feed.stderr
    shown = _flat(feed.stdout)
    assert (f"The largest chunk a stream opened with the default options takes: {opts.max_text_bytes} bytes of UTF-8 "
            f"(StreamOptions.max_text_bytes; no stream takes more than {most(bounds['max_text_bytes'])})") in shown
    assert (f"the largest chunk a stream opened with the default options takes: {opts.max_chunk_tokens} tokens "
            f"(StreamOptions.max_chunk_tokens; no stream takes more than {most(bounds['max_chunk_tokens'])})") in shown
    assert "--text-file FILE the chunk as the text of FILE: UTF-8" in shown and "- reads it from stdin" in shown
    gen = _cli("generate", "--help")
    assert gen.returncode == 0, gen.stderr
    n_max = most(GenerateRequest.model_fields["max_tokens"].metadata)
    assert (f"-n N the most tokens to sample: at most {opts.max_generate_tokens} on a stream opened with the default "
            f"options (StreamOptions.max_generate_tokens; no stream takes more than {n_max})") in _flat(gen.stdout)
