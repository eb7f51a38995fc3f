"""What a worker serves, from its settings: `WorkerConfig` (the environment, documented in
`mamba_stream.worker`), and what they name: the keyring, the models, the activities, the
runtime's metrics and the deployment version. Used by the worker and by
`MambaStreamPlugin.for_worker` alike."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mamba_stream.workflows import ClientConfig

if TYPE_CHECKING:  # imported where used: it pulls in torch
    from mamba_stream.activities import ModelRegistry

__all__ = ["WorkerConfig", "build_activities", "build_runtime", "deployment_config", "load_keyring",
           "model_registry", "shared_prefixes"]

log = logging.getLogger("mamba_stream.worker")


@dataclass
class WorkerConfig(ClientConfig):
    """The client's settings (address, task queue, home, keyring, the embedded server's port, the
    models served), and what only a worker has."""

    store_url: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_STORE") or None)
    codec_port: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_CODEC_PORT", "8081")))
    ui_port: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_UI_PORT", "8233")))
    backend: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_BACKEND", "auto"))
    weights: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_WEIGHTS") or None)
    #: the most positions a stream of a model with attention layers reaches (its KV rows), where
    #: the checkpoint allows more; None: each checkpoint's max_position_embeddings
    max_positions: int | None = field(default_factory=lambda: _positive_int("MAMBA_STREAM_MAX_POSITIONS"))
    principal_keys: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_PRINCIPAL_KEYS") or None)
    metrics: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_METRICS", "127.0.0.1:9464"))
    drift_check_every: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_DRIFT_CHECK_EVERY", "0")))
    build_id: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_BUILD_ID") or None)
    deployment: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_DEPLOYMENT", "mamba-stream"))
    sweep_s: float = field(default_factory=lambda: float(os.environ.get("MAMBA_STREAM_SWEEP_S", "600")))
    orphan_grace_s: float = field(default_factory=lambda: float(os.environ.get("MAMBA_STREAM_ORPHAN_GRACE_S", "3600")))
    #: the prefix store's bound on each scope's bytes (a principal's, the shared one); 0: no prefix store
    prefix_bytes: int = field(default_factory=lambda: int(os.environ.get("MAMBA_STREAM_PREFIX_BYTES", str(1 << 30))))
    #: decoded prefix states a worker keeps in memory for hits
    prefix_ram_bytes: int = field(
        default_factory=lambda: int(os.environ.get("MAMBA_STREAM_PREFIX_RAM_BYTES", str(256 << 20))))
    #: a JSON file of the operator's shared prefixes, served to every principal:
    #: {"<model id>": ["<text>" or [token ids], ...]}
    shared_prefixes: str | None = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_SHARED_PREFIXES") or None)
    #: the worker's own fair sharing between principals, on or off, and their weights (principal=weight,...)
    fairness: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_FAIRNESS", "on"))
    fairness_weights: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_FAIRNESS_WEIGHTS", ""))
    fairness_burst: str = field(default_factory=lambda: os.environ.get("MAMBA_STREAM_FAIRNESS_BURST", ""))

    def __post_init__(self) -> None:
        from mamba_stream.activities import Fairness, Quotas

        # a TenancyConfigError (a ValueError) names the variable
        Fairness.from_spec(self.fairness, self.fairness_weights, self.fairness_burst)
        Quotas.from_env()

    @property
    def store(self) -> str:
        return self.store_url or f"file://{(self.home / 'states').resolve()}"


def _positive_int(name: str) -> int | None:
    """An environment variable holding a positive integer, or None where it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return int(raw)


def load_keyring(cfg: WorkerConfig):
    """The keyring: JSON in MAMBA_STREAM_KEYRING, a file it names, or the home's (made on first use)."""
    from mamba_stream.state_codec.keyring import KeyringError, find_keyring

    ring = find_keyring(cfg.keyring, cfg.home, create=True)
    if ring.principal is not None:
        raise KeyringError(f"a worker needs the master keyring, not principal {ring.principal!r}'s (a client's)")
    return ring



def build_runtime(cfg: WorkerConfig):
    """A Temporal runtime exporting metrics on cfg.metrics (None when "off")."""
    if cfg.metrics.lower() in ("", "off", "none"):
        return None
    from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

    from mamba_stream.activities import HISTOGRAM_BUCKETS

    try:
        return Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(
            bind_address=cfg.metrics, histogram_bucket_overrides=HISTOGRAM_BUCKETS)))
    except ValueError as exc:  # the port is taken (another worker on this host): serve, unmetered
        log.warning("no metrics endpoint on %s: %s (set MAMBA_STREAM_METRICS)", cfg.metrics, exc)
        return None


def deployment_config(cfg: WorkerConfig):
    """Worker versioning: this worker as a version of the deployment, streams pinned (None: unversioned)."""
    if not cfg.build_id:
        return None
    from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
    from temporalio.worker import WorkerDeploymentConfig

    return WorkerDeploymentConfig(
        version=WorkerDeploymentVersion(deployment_name=cfg.deployment, build_id=cfg.build_id),
        use_worker_versioning=True, default_versioning_behavior=VersioningBehavior.PINNED)


def model_registry(cfg: WorkerConfig) -> ModelRegistry:
    """The models of MAMBA_STREAM_MODELS, each checked without loading its weights.

    Raises:
        scan.CheckpointError: a model cannot be loaded (an unknown preset, a directory without
            config.json or weights, an unsupported config); the message names each such model.
    """
    from mamba_stream.activities import ModelRegistry

    models = ModelRegistry.from_spec(cfg.models, backend=cfg.backend, weights=cfg.weights,
                                     max_positions=cfg.max_positions)
    models.check()
    return models


def build_activities(cfg: WorkerConfig, keyring, worker_queue: str, metrics=None):
    from mamba_stream.activities import Fairness, Quotas, StreamActivities, open_store
    from mamba_stream.state_codec.signing import PrincipalKeys

    fairness = Fairness.from_spec(cfg.fairness, cfg.fairness_weights, cfg.fairness_burst)
    models = model_registry(cfg)  # before the store is opened: a bad model changes nothing
    shared = shared_prefixes(cfg)
    keys = PrincipalKeys.from_spec(cfg.principal_keys) if cfg.principal_keys else None
    if keys is not None:
        log.info("verifying signed requests of %d principals", len(keys))
    return StreamActivities(models=models, store=open_store(cfg.store), keyring=keyring, worker_queue=worker_queue,
                            principal_keys=keys, metrics=metrics, drift_check_every=cfg.drift_check_every,
                            prefix_bytes=cfg.prefix_bytes, prefix_ram_bytes=cfg.prefix_ram_bytes,
                            shared_prefixes=shared, fairness=fairness, quotas=Quotas.from_env())


def shared_prefixes(cfg: WorkerConfig) -> dict[str, list[str | list[int]]] | None:
    """The operator's shared prefixes (MAMBA_STREAM_SHARED_PREFIXES), checked for their form.

    Raises:
        scan.CheckpointError: the file is unreadable, or not {model id: [text or token ids, ...]}
            for models this worker serves (the worker exits `EXIT_CONFIG`, saying why).
    """
    if not cfg.shared_prefixes:
        return None
    from mamba_stream.scan import CheckpointError

    try:
        data = json.loads(Path(cfg.shared_prefixes).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"shared prefixes {cfg.shared_prefixes}: {exc}") from exc
    ok = isinstance(data, dict) and all(
        isinstance(m, str) and isinstance(ps, list) and all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) and t >= 0 for t in p))
            for p in ps) for m, ps in data.items())
    if not ok:
        raise CheckpointError(f"shared prefixes {cfg.shared_prefixes}: expected {{model id: [text or [token ids], "
                              f"...]}}")
    return data
