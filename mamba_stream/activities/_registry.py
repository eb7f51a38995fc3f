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
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from mamba_stream.failures import Failure
from mamba_stream.scan import CheckpointError, Model, checkpoint_problem, config_from_json, load_model

__all__ = ["ModelRegistry", "UnknownModel"]

log = logging.getLogger(__name__)


class UnknownModel(Failure, KeyError):
    """This worker does not serve the requested model id."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else self.reason


class ModelRegistry:
    """Models by id: preset names, or `id=/path/to/checkpoint` entries, loaded on first use.

    A source may end in `#<format>` (`mine=/models/mine#bfloat16`): the format its weights are read
    in (`scan.load_model(weights=...)`); `weights` is the default for the others (None: as stored).
    `max_positions`: the most positions a stream of a model with attention layers may reach (its
    KV rows), where that is below the checkpoint's own `max_position_embeddings`
    (MAMBA_STREAM_MAX_POSITIONS; None: the checkpoint's); models without attention ignore it.
    """

    def __init__(self, sources: Mapping[str, str] | Iterable[str], *, backend: str = "auto",
                 dtype: torch.dtype = torch.float32, device: str = "cpu", weights: str | None = None,
                 max_positions: int | None = None) -> None:
        if isinstance(sources, Mapping):
            self._sources = dict(sources)
        else:
            self._sources = {s: s for s in sources}
        if max_positions is not None and (isinstance(max_positions, bool) or not isinstance(max_positions, int)
                                          or max_positions < 1):
            raise ValueError(f"max_positions must be a positive integer, got {max_positions!r}")
        self._backend, self._dtype, self._device, self._weights = backend, dtype, device, weights
        self._max_positions = max_positions
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

    def loaded(self, model_id: str) -> Model | None:
        """The model if it is loaded already, else None (never loads)."""
        return self._models.get(model_id)

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
                                   weights=fmt or self._weights, max_positions=self._bound(source))
                model.model_id = model_id  # the id streams name it by, whatever its source
                self._models[model_id] = model
                log.info("loaded model %s (%s, %s)", model_id, model.revision[:19], model.backend)
            return model
        finally:
            self._lock.release()

    def _bound(self, source: str) -> int | None:
        """The position bound to load `source` with: the registry's, where the checkpoint has
        attention layers and allows more (None: the checkpoint's own, or no attention)."""
        if self._max_positions is None:
            return None
        path = Path(source) / "config.json"
        if not path.is_file():  # a preset: no attention
            return None
        own = config_from_json(json.loads(path.read_text()))[0].max_positions
        return None if own is None or own <= self._max_positions else self._max_positions

    def check(self) -> None:
        """Every configured model, looked at without loading its weights (`scan.checkpoint_problem`:
        a preset name, or a directory with a readable config.json that describes a supported
        model, and its weight files; a `#<format>` that is a known weight format).

        Raises:
            CheckpointError: one or more models cannot be loaded; its message names each (id and
                source) and what is wrong, on one line. Nothing is loaded or changed.
        """
        problems = []
        for model_id in self.ids:
            source, _, fmt = self._sources[model_id].partition("#")
            why = checkpoint_problem(source, fmt or self._weights)
            if why is not None:
                problems.append(f"model {model_id!r} ({source}): {why}")
        if problems:
            raise CheckpointError("; ".join(problems))
