"""What a client needs to reach the streams, from the environment (standard library only).

Workers extend it (`worker.WorkerConfig`); clients (the CLI's stream commands, agents) use it
alone and never load the worker, the engine or the checkpoint codec.

    TEMPORAL_ADDRESS          the Temporal frontend (default 127.0.0.1:$MAMBA_STREAM_TEMPORAL_PORT)
    MAMBA_STREAM_TEMPORAL_PORT
                              the port of the worker's embedded dev server (default 7233): a
                              client configured like the worker finds it without TEMPORAL_ADDRESS
    MAMBA_STREAM_MODELS       the models the workers serve, as the worker reads it (default: the
                              worker's default presets): what the CLI's help lists; a worker may
                              serve others
    MAMBA_STREAM_TASK_QUEUE   the streams' task queue (default mamba-stream)
    MAMBA_STREAM_HOME         where the embedded stack keeps its keyring, store and database
                              (default: the per-user data directory, never the current one)
    MAMBA_STREAM_KEYRING      keyring JSON, or the path of a 0600 keyring file
    MAMBA_STREAM_SIGNING_KEY  this client's signing key, when the workers verify signatures
    TEMPORAL_API_KEY          the bearer token (a JWT) this process presents to a frontend that
                              authorizes callers (Temporal's authorizer and claim mapper:
                              docs/deploying.md); TEMPORAL_TLS=1 also uses TLS
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mamba_stream.state_codec.keyring import Keyring, default_home, find_keyring

__all__ = ["DEFAULT_TASK_QUEUE", "ClientConfig"]

DEFAULT_TASK_QUEUE = "mamba-stream"
#: the models a worker serves when MAMBA_STREAM_MODELS is unset: built-in presets, no checkpoint to find
_DEFAULT_MODELS = "tiny-mamba1,tiny-mamba2,tiny-mamba3,recall-mamba1,recall-mamba2,recall-mamba3,kjv-mamba2"


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


@dataclass
class ClientConfig:
    home: Path = field(default_factory=default_home)
    address: str | None = field(default_factory=lambda: _env("TEMPORAL_ADDRESS"))
    keyring: str | None = field(default_factory=lambda: _env("MAMBA_STREAM_KEYRING"))
    task_queue: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_TASK_QUEUE", DEFAULT_TASK_QUEUE))
    signing_key: str | None = field(default_factory=lambda: _env("MAMBA_STREAM_SIGNING_KEY"))
    api_key: str | None = field(default_factory=lambda: _env("TEMPORAL_API_KEY"), repr=False)
    tls: bool = field(default_factory=lambda: os.environ.get("TEMPORAL_TLS", "") in ("1", "true", "yes"))
    # read by the client as by the worker (worker.WorkerConfig extends this): a client in the
    # worker's environment reaches the same server, and names the models it serves
    temporal_port: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_TEMPORAL_PORT", "7233")))
    models: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_MODELS", _DEFAULT_MODELS))

    @property
    def target(self) -> str:
        """TEMPORAL_ADDRESS, else the embedded dev server's address (`python worker.py` with no
        TEMPORAL_ADDRESS starts it on 127.0.0.1:$MAMBA_STREAM_TEMPORAL_PORT)."""
        return self.address or f"127.0.0.1:{self.temporal_port}"

    def model_ids(self) -> list[str]:
        """The ids of the models the workers serve, as far as this environment says
        (MAMBA_STREAM_MODELS: `preset`, `id=/checkpoint/dir` or either with `#<weights format>`);
        a worker configured otherwise may serve others."""
        # parsed as activities.ModelRegistry.from_spec parses it: the id is what precedes `=` or `#`
        ids = (item.partition("=")[0].partition("#")[0].strip() for item in self.models.split(","))
        return [i for i in ids if i]

    def connect_args(self) -> dict:
        """`Client.connect` keywords: the bearer token (when set) and whether to use TLS."""
        return {"api_key": self.api_key, "tls": self.tls}

    def load_keyring(self) -> Keyring:
        """The workers' keyring, found, never made (`KeyringNotFound` names where it looked)."""
        return find_keyring(self.keyring, self.home, create=False)
