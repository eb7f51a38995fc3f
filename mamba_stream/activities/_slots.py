"""The slot table: fixed-capacity, preallocated state buffers for one served model.

Dimension letters: K slots (capacity), then each state tensor's own shape (see the schema).

Every slot holds one stream's state with its identity (stream id, epoch, position, state key)
and a generation number. Insertion and removal move state and identity together.
A handle is (slot, generation); a slot's generation changes whenever its occupant does, so an old
handle can never read or write the new occupant. A released slot is zeroed before anyone can
reuse it. A table serves one schema: a state is admitted only if its schema fingerprint matches,
never merely because its shapes do.

Not thread-safe by itself: the decode batcher owns the table and is its only caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mamba_stream.scan import Model, State, zeros_on_demand

__all__ = ["SlotHandle", "SlotMeta", "SlotTable", "StaleSlot"]


class StaleSlot(LookupError):
    """A handle whose slot has since been released, reused or moved."""


@dataclass(frozen=True)
class SlotHandle:
    slot: int
    generation: int


@dataclass
class SlotMeta:
    stream_id: str | None = None
    epoch: int = 0
    position: int = 0
    state_key: str | None = None  # the committed checkpoint this slot holds; None while uncommitted
    generation: int = 0
    last_used: int = 0


class SlotTable:
    """Preallocated per-tensor buffers (K, *shape), plus the next-token logits of each slot."""

    def __init__(self, model: Model, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.model = model
        self.fingerprint = model.schema.fingerprint()
        self.capacity = capacity
        dev, dt = model.device, model.state_dtype
        # pages taken as slots are written: the memory of the slots used, not of the capacity (7 slots
        # of a 7B Mamba-2 are 1.95 GB)
        self.buffers = {t.name: zeros_on_demand((capacity, *t.shape), dt, dev) for t in model.schema.tensors}
        # an attention layer's k and v: a slot holds max_positions rows, a State its position's
        self._grows = {t.name for t in model.schema.tensors if t.rows == "position"}
        self.logits = torch.zeros((capacity, model.vocab_size), dtype=torch.float32, device=dev)
        self.has_logits = [False] * capacity
        self.meta = [SlotMeta() for _ in range(capacity)]
        self._by_stream: dict[str, int] = {}
        self._clock = 0
        self._generations = 0

    # --- lookup -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_stream)

    @property
    def free(self) -> int:
        return self.capacity - len(self._by_stream)

    def handle(self, stream_id: str) -> SlotHandle | None:
        slot = self._by_stream.get(stream_id)
        return None if slot is None else SlotHandle(slot, self.meta[slot].generation)

    def _check(self, h: SlotHandle) -> SlotMeta:
        if not 0 <= h.slot < self.capacity or self.meta[h.slot].generation != h.generation \
                or self.meta[h.slot].stream_id is None:
            raise StaleSlot(f"slot {h.slot} generation {h.generation} is no longer valid")
        return self.meta[h.slot]

    def lru(self, exclude: set[str] = frozenset()) -> str | None:
        """The least recently used stream, not in `exclude` (eviction candidate)."""
        live = [(m.last_used, m.stream_id) for m in self.meta if m.stream_id and m.stream_id not in exclude]
        return min(live)[1] if live else None

    # --- state ------------------------------------------------------------------------------

    def _next_generation(self) -> int:
        self._generations += 1
        return self._generations

    def insert(self, stream_id: str, state: State, *, epoch: int, state_key: str | None,
               logits: torch.Tensor | None = None) -> SlotHandle:
        """Put a stream's state in a free slot (or replace its current one)."""
        if state.origin != self.fingerprint:
            self.model.validate_state(state)  # raises for another schema, whatever the shapes
        slot = self._by_stream.get(stream_id)
        if slot is None:
            if not self.free:
                raise MemoryError("no free slot")
            slot = next(i for i, m in enumerate(self.meta) if m.stream_id is None)
        self._put(slot, state, self.meta[slot].position if self.meta[slot].stream_id == stream_id else 0)
        self._set_logits(slot, logits)
        self._clock += 1
        self.meta[slot] = SlotMeta(stream_id, epoch, state.position, state_key, self._next_generation(), self._clock)
        self._by_stream[stream_id] = slot
        return SlotHandle(slot, self.meta[slot].generation)

    def _put(self, slot: int, state: State, held: int) -> None:
        """Copy a state into a slot that holds rows up to position `held` (0: a zeroed slot): a
        growing tensor's rows past the state's position are zeroed where the slot held any."""
        p = state.position
        for name, buf in self.buffers.items():
            if name in self._grows:
                buf[slot, :p].copy_(state.tensors[name])
                if held > p:
                    buf[slot, p:held].zero_()
            else:
                buf[slot].copy_(state.tensors[name])

    def _set_logits(self, slot: int, logits: torch.Tensor | None) -> None:
        if logits is None:
            self.logits[slot].zero_()
            self.has_logits[slot] = False
        else:
            self.logits[slot].copy_(logits)
            self.has_logits[slot] = True

    def view(self, h: SlotHandle) -> State:
        """The slot's state as views into the buffers (no copy); valid until the slot changes."""
        meta = self._check(h)
        self._clock += 1
        meta.last_used = self._clock
        p = meta.position
        return State(p, {n: b[h.slot, :p] if n in self._grows else b[h.slot] for n, b in self.buffers.items()},
                     self.fingerprint)

    def next_logits(self, h: SlotHandle) -> torch.Tensor | None:
        self._check(h)
        return self.logits[h.slot] if self.has_logits[h.slot] else None

    def write(self, h: SlotHandle, state: State, logits: torch.Tensor | None, *, state_key: str | None) -> None:
        """Store a stream's new state in its slot (state and position move together)."""
        meta = self._check(h)
        self._put(h.slot, state, meta.position)
        if logits is not None:
            self._set_logits(h.slot, logits)
        meta.position = state.position
        meta.state_key = state_key

    def step(self, handles: list[SlotHandle], tokens: list[int]) -> tuple[torch.Tensor, str]:
        """One token for each handle's stream, computed on the buffers in place (one batched step).

        Positions advance, the slots' next-token logits are replaced, and the slots become
        uncommitted (state_key None) until `mark_committed`. The layers write the new states straight
        into the slots where the backend can (`Model.step_rows(in_place=True)`), so a step that
        raises may leave them partly advanced: its streams are then released (zeroed and freed)
        before the error propagates, and their next chunk reloads from the store.

        Returns:
            float32 logits (B, V), in the order of `handles`.
        """
        metas = [self._check(h) for h in handles]
        dev = self.logits.device
        # In slot order, so that adjacent occupied slots form one span (stepped as a view).
        order = sorted(range(len(handles)), key=lambda i: handles[i].slot)
        rows = torch.tensor([handles[i].slot for i in order], dtype=torch.long, device=dev)
        toks = torch.tensor([tokens[i] for i in order], dtype=torch.long, device=dev)
        # a hybrid's attention writes each token's KV row at its stream's position
        positions = torch.tensor([metas[i].position for i in order], dtype=torch.long, device=dev)
        try:
            sorted_logits, path = self.model.step_rows(self.buffers, rows, toks, in_place=True, positions=positions)
        except BaseException:
            for m in metas:
                if m.stream_id is not None:
                    self.release(m.stream_id)
            raise
        self.logits.index_copy_(0, rows, sorted_logits)
        if order == list(range(len(order))):
            logits = sorted_logits
        else:
            logits = torch.empty_like(sorted_logits)
            logits[torch.tensor(order, dtype=torch.long, device=dev)] = sorted_logits
        self._clock += 1
        for h, m in zip(handles, metas, strict=True):
            self.has_logits[h.slot] = True
            m.position += 1
            m.state_key = None
            m.last_used = self._clock
        return logits, path

    def state(self, h: SlotHandle) -> State:
        """A copy of the slot's state (the caller's own tensors)."""
        return self.view(h).clone()

    def mark_committed(self, h: SlotHandle, state_key: str) -> None:
        """The slot's state is the one committed under `state_key` (its checkpoint is in the store)."""
        self._check(h).state_key = state_key

    def release(self, stream_id: str) -> bool:
        """Zero the stream's slot and free it; True if the stream held one."""
        slot = self._by_stream.pop(stream_id, None)
        if slot is None:
            return False
        for buf in self.buffers.values():
            buf[slot].zero_()
        self._set_logits(slot, None)
        self.meta[slot] = SlotMeta(generation=self._next_generation())
        return True
