"""The models a worker serves, by id: loaded at worker start (`StreamActivities.warm`) or on first use.

`check` looks at every configured source without loading weights (a preset's name; a directory's
config.json and weight files), so a worker refuses a model it cannot load before it starts
anything (worker.py), not at a stream's first `open`.

A load runs under the registry's lock and is never interrupted: a model's first load imports
modules (torch._dynamo, sympy) that an exception raised half-way would leave half-imported for the
whole process. An attempt that waits for another one's load waits in slices, calling `on_wait`
between them (a heartbeat, and the point where a cancelled attempt stops waiting).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from scan import (
    PRESETS,
    TRAINED_PRESETS,
    WEIGHT_FORMATS,
    CheckpointError,
    ConfigError,
    Model,
    config_from_json,
    load_model,
)

__all__ = ["ModelRegistry", "UnknownModel"]

log = logging.getLogger(__name__)


class UnknownModel(KeyError):
    """This worker does not serve the requested model id."""

    reason = "UnknownModel"
    retryable = False

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else self.reason


class ModelRegistry:
    """Models by id: preset names, or `id=/path/to/checkpoint` entries, loaded on first use.

    A source may end in `#<format>` (`mine=/models/mine#bfloat16`): the format its weights are read
    in (`scan.load_model(weights=...)`); `weights` is the default for the others (None: as stored).
    """

    def __init__(self, sources: Mapping[str, str] | Iterable[str], *, backend: str = "auto",
                 dtype: torch.dtype = torch.float32, device: str = "cpu", weights: str | None = None) -> None:
        if isinstance(sources, Mapping):
            self._sources = dict(sources)
        else:
            self._sources = {s: s for s in sources}
        self._backend, self._dtype, self._device, self._weights = backend, dtype, device, weights
        self._models: dict[str, Model] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec: str, **kw: object) -> ModelRegistry:
        """Parse `tiny-mamba2,mine=/models/mine` (what MAMBA_STREAM_MODELS holds)."""
        sources: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            mid, _, src = item.partition("=")
            if not src:  # a preset, perhaps with a format: its id is its name
                mid, _, fmt = mid.partition("#")
                src = f"{mid}#{fmt}" if fmt else mid
            sources[mid.strip()] = src.strip()
        return cls(sources, **kw)  # type: ignore[arg-type]

    @property
    def ids(self) -> list[str]:
        return sorted(self._sources)

    def get(self, model_id: str, *, on_wait: Callable[[], None] | None = None) -> Model:
        """The model, loaded now if it was not. `on_wait` runs every 0.2 s spent waiting for
        another thread's load; what it raises ends the wait (never a load)."""
        model = self._models.get(model_id)
        if model is not None:  # loaded: no wait behind another model's load
            return model
        while not self._lock.acquire(timeout=0.2):
            if on_wait is not None:
                on_wait()
        try:
            model = self._models.get(model_id)
            if model is None:
                if model_id not in self._sources:
                    raise UnknownModel(f"model {model_id!r} is not served here; known: {self.ids}")
                source, _, fmt = self._sources[model_id].partition("#")
                model = load_model(source, backend=self._backend, dtype=self._dtype, device=self._device,
                                   weights=fmt or self._weights)
                model.model_id = model_id  # the id streams name it by, whatever its source
                self._models[model_id] = model
                log.info("loaded model %s (%s, %s)", model_id, model.revision[:19], model.backend)
            return model
        finally:
            self._lock.release()

    def check(self) -> None:
        """Every configured model, looked at without loading its weights: a preset name, or a
        directory with a readable config.json that describes a supported model and weight files
        (model.safetensors, a model.safetensors.index.json and the shards it names, or
        pytorch_model.bin); a `#<format>` is a known weight format.

        Raises:
            CheckpointError: one or more models cannot be loaded; its message names each (id and
                source) and what is wrong, on one line. Nothing is loaded or changed.
        """
        problems = []
        for model_id in self.ids:
            source, _, fmt = self._sources[model_id].partition("#")
            why = self._problem(source, fmt or self._weights)
            if why is not None:
                problems.append(f"model {model_id!r} ({source}): {why}")
        if problems:
            raise CheckpointError("; ".join(problems))

    @staticmethod
    def _problem(source: str, fmt: str | None) -> str | None:
        """What keeps `source` from loading, as far as its config and file names tell; None: nothing."""
        if fmt is not None and fmt not in WEIGHT_FORMATS:
            return f"unknown weight format {fmt!r}; expected one of {sorted(WEIGHT_FORMATS)}"
        if source in PRESETS or source in TRAINED_PRESETS:
            return None
        directory = Path(source)
        if not directory.exists():
            names = ", ".join(sorted([*PRESETS, *TRAINED_PRESETS]))
            return f"no such preset ({names}) or directory"
        if not directory.is_dir():
            return "not a checkpoint directory"
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            return "no config.json in the directory"
        try:
            raw = json.loads(cfg_path.read_text())
        except OSError as exc:
            return f"config.json cannot be read: {exc.strerror or exc}"
        except ValueError as exc:
            return f"config.json is not valid JSON: {exc}"
        if not isinstance(raw, dict):
            return "config.json is not a JSON object"
        try:
            config_from_json(raw)
        except ConfigError as exc:
            return f"config.json: {exc}"
        return ModelRegistry._weights_problem(directory)

    @staticmethod
    def _weights_problem(directory: Path) -> str | None:
        """Whether the directory holds readable weight files, in the names `scan.load_model` reads."""
        index = directory / "model.safetensors.index.json"
        files = [directory / "model.safetensors"]
        if not files[0].is_file() and index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return f"model.safetensors.index.json has no readable weight_map: {exc!r}"
            files = [directory / f for f in shards]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                return f"model.safetensors.index.json names shards that are not there: {missing[:4]}"
        elif not files[0].is_file():
            files = [directory / "pytorch_model.bin"]
            if not files[0].is_file():
                return "no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
        unreadable = [f.name for f in files if not os.access(f, os.R_OK)]
        if unreadable:
            return f"weight files not readable by this user: {unreadable[:4]}"
        return None
