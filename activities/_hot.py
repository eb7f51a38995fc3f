"""The models a worker serves, and the states it keeps hot between chunks."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from scan import Model, State, load_model
from state_codec import Receipt

__all__ = ["HotCache", "HotEntry", "ModelRegistry", "UnknownModel"]

log = logging.getLogger(__name__)


class UnknownModel(KeyError):
    """This worker does not serve the requested model id."""


class ModelRegistry:
    """Models by id: preset names, or `id=/path/to/checkpoint` entries, loaded on first use."""

    def __init__(self, sources: Mapping[str, str] | Iterable[str], *, backend: str = "auto",
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        if isinstance(sources, Mapping):
            self._sources = dict(sources)
        else:
            self._sources = {s: s for s in sources}
        self._backend, self._dtype, self._device = backend, dtype, device
        self._models: dict[str, Model] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_spec(cls, spec: str, **kw: object) -> ModelRegistry:
        """Parse `tiny-mamba2,mine=/models/mine` (what MAMBA_STREAM_MODELS holds)."""
        sources: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            mid, _, src = item.partition("=")
            sources[mid.strip()] = (src or mid).strip()
        return cls(sources, **kw)  # type: ignore[arg-type]

    @property
    def ids(self) -> list[str]:
        return sorted(self._sources)

    def get(self, model_id: str) -> Model:
        with self._lock:
            model = self._models.get(model_id)
            if model is None:
                if model_id not in self._sources:
                    raise UnknownModel(f"model {model_id!r} is not served here; known: {self.ids}")
                model = load_model(self._sources[model_id], backend=self._backend, dtype=self._dtype,
                                   device=self._device)
                model.model_id = model_id  # the id streams name it by, whatever its source
                self._models[model_id] = model
                log.info("loaded model %s (%s, %s)", model_id, model.revision[:19], model.backend)
            return model


@dataclass
class HotEntry:
    stream_id: str
    receipt: Receipt
    state: State
    last_logits: torch.Tensor | None  # float32 (V,): the next-token logits after this state

    @property
    def nbytes(self) -> int:
        extra = 0 if self.last_logits is None else self.last_logits.numel() * 4
        return self.state.nbytes + extra


class HotCache:
    """States kept in memory between chunks, keyed by state key (never by shape), LRU-bounded.

    Eviction writes nothing: every state in here is already committed to the store, and a later
    chunk reloads it from there. Disposing a stream zeroes its tensors before dropping them.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, HotEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str, receipt: Receipt) -> HotEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.receipt != receipt:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: str, entry: HotEntry) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.nbytes
                self.evictions += 1

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def evict_stream(self, stream_id: str) -> int:
        """Zero and drop every state of a stream; returns how many."""
        with self._lock:
            keys = [k for k, e in self._entries.items() if e.stream_id == stream_id]
            for k in keys:
                entry = self._entries.pop(k)
                self._bytes -= entry.nbytes
                with torch.inference_mode():  # states may be inference tensors
                    for t in entry.state.tensors.values():
                        t.zero_()
                    if entry.last_logits is not None:
                        entry.last_logits.zero_()
            return len(keys)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
