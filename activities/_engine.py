"""StreamEngine: one model's slots and the thread that advances them, batching across streams.

Activities submit chunks and wait; the engine thread is the only one that touches the slot table
and runs the model. Each round it takes every waiting single-token step (decode, generate) as
one batched step on the slot buffers in place (`Model.step_rows`, the arithmetic of
`advance_batch`; up to `max_batch`, after waiting at most `max_wait_s` for company),
then one piece (`prefill_piece` tokens) of the oldest long chunk. A 4,096-token prefill therefore
holds waiting decodes up for at most one piece. Splitting a chunk into pieces is invisible by the
engine's own contract: bit-exact on the reference backend, within the declared bounds elsewhere.

States stay in their slots between chunks (the hot cache). A full table evicts its least
recently used idle stream: nothing is written, its checkpoint is already in the store, and its
next chunk reloads from there (a migration).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from activities._alloc import tune_allocator
from activities._slots import SlotTable
from scan import Model, State

__all__ = ["ChunkOutput", "EngineStats", "NeedsLoad", "StreamBusy", "StreamEngine"]

log = logging.getLogger(__name__)


class NeedsLoad(LookupError):
    """The stream's committed state is not in a slot: load it from the store and resubmit."""


class StreamBusy(RuntimeError):
    """Another chunk of the same stream is still running here (a retry overtook its attempt)."""


@dataclass
class ChunkOutput:
    tokens: list[int]  # the chunk's tokens (for a generation: the sampled ones)
    logits: torch.Tensor  # float32 (L, V)
    state: State  # the caller's own tensors (the slot keeps its copy), for sealing
    last_logits: torch.Tensor | None  # float32 (V,): next-token logits after the chunk
    path: str


@dataclass
class EngineStats:
    steps: int = 0  # batched single-token rounds
    stepped_streams: int = 0  # streams advanced by them (sum of batch sizes)
    max_batch: int = 0
    step_seconds: float = 0.0  # wall time inside the batched steps
    pieces: int = 0  # prefill pieces
    loads: int = 0  # states brought in from the store
    evictions: int = 0


@dataclass
class _Work:
    stream_id: str
    tokens: list[int]
    expected_key: str  # the committed state key the chunk starts from
    epoch: int
    load: tuple[State, torch.Tensor | None] | None
    future: Future = field(default_factory=Future)
    rows: list[torch.Tensor] = field(default_factory=list)
    done: int = 0
    path: str = "empty"
    handle: object = None
    # generation: picks the next token from the latest logits, or None to stop
    sampler: Callable[[torch.Tensor], int | None] | None = None
    max_tokens: int = 0


class StreamEngine:
    """Args:
    model: the served model.
    capacity: slots (streams held hot at once).
    max_batch: single-token steps advanced together.
    max_wait_s: how long a lone step waits for company.
    prefill_piece: tokens of a long chunk advanced per round.
    """

    def __init__(self, model: Model, *, capacity: int = 256, max_batch: int = 64, max_wait_s: float = 0.002,
                 prefill_piece: int = 256) -> None:
        tune_allocator()  # batched steps churn state-sized temporaries; see activities/_alloc.py
        self.model = model
        self.slots = SlotTable(model, capacity)
        self.max_batch, self.max_wait_s, self.prefill_piece = max_batch, max_wait_s, prefill_piece
        self.stats = EngineStats()
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards `_committed` and `_busy`, read by other threads
        self._committed: dict[str, str] = {}  # stream -> committed state key held in its slot
        self._busy: set[str] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"engine-{model.model_id}", daemon=True)
        self._thread.start()

    # --- called from activity threads ----------------------------------------------------------

    def hot_stream_ids(self) -> list[str]:
        """Streams whose committed state this engine holds in a slot."""
        with self._lock:
            return sorted(self._committed)

    def holds(self, stream_id: str, state_key: str) -> bool:
        """Whether the stream's slot holds exactly this committed state."""
        with self._lock:
            return self._committed.get(stream_id) == state_key

    def advance(self, stream_id: str, tokens: list[int], *, expected_key: str, epoch: int,
                load: Callable[[], tuple[State, torch.Tensor | None]],
                on_wait: Callable[[], None] | None = None) -> ChunkOutput:
        """Advance a stream from its committed state `expected_key` by `tokens`; waits.

        `load` brings the committed state from the store when no slot holds it; `on_wait` runs
        every second of waiting (activities heartbeat there).
        """
        return self._submit(lambda pre: _Work(stream_id, list(tokens), expected_key, epoch, pre),
                            stream_id, expected_key, load, on_wait)

    def generate(self, stream_id: str, sampler: Callable[[torch.Tensor], int | None], max_tokens: int, *,
                 expected_key: str, epoch: int, load: Callable[[], tuple[State, torch.Tensor | None]],
                 on_wait: Callable[[], None] | None = None) -> ChunkOutput:
        """Sample up to `max_tokens` tokens, each advancing the state; every step is batched with
        the other streams' single-token steps. `sampler(next_logits)` returns a token or None."""
        return self._submit(lambda pre: _Work(stream_id, [], expected_key, epoch, pre, sampler=sampler,
                                              max_tokens=max_tokens),
                            stream_id, expected_key, load, on_wait)

    def _submit(self, make: Callable[[object], _Work], stream_id: str, expected_key: str,
                load: Callable[[], tuple[State, torch.Tensor | None]],
                on_wait: Callable[[], None] | None) -> ChunkOutput:
        from concurrent.futures import TimeoutError as FutureTimeout

        pre = None if self.holds(stream_id, expected_key) else load()
        for _ in range(3):
            work = make(pre)
            self._inbox.put(work)
            try:
                while True:
                    try:
                        return work.future.result(timeout=1.0 if on_wait else None)
                    except FutureTimeout:
                        on_wait()  # type: ignore[misc]
            except NeedsLoad:  # evicted between the check and the run
                pre = load()
        raise NeedsLoad(f"stream {stream_id} keeps being evicted; raise the engine's capacity")

    def commit(self, stream_id: str, state_key: str) -> None:
        """The chunk's checkpoint is in the store: its slot now holds that committed state."""
        self._call(lambda: self._commit(stream_id, state_key))

    def put(self, stream_id: str, state: State, *, epoch: int, state_key: str,
            logits: torch.Tensor | None = None) -> None:
        """Hold a committed state (a stream just opened, reset or resumed)."""
        self._call(lambda: self._insert(stream_id, state, epoch, state_key, logits))

    def release(self, stream_id: str) -> bool:
        """Zero and free the stream's slot; True if it held one."""
        return self._call(lambda: self._release(stream_id))

    def close(self) -> None:
        self._stop = True
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _call(self, fn: Callable[[], object]):
        fut: Future = Future()
        self._inbox.put((fn, fut))
        return fut.result()

    # --- the engine thread -----------------------------------------------------------------------

    def _commit(self, stream_id: str, key: str) -> None:
        h = self.slots.handle(stream_id)
        if h is not None:
            self.slots.commit(h, key)
            with self._lock:
                self._committed[stream_id] = key

    def _insert(self, stream_id: str, state: State, epoch: int, key: str | None, logits) -> object:
        if self.slots.handle(stream_id) is None and not self.slots.free:
            with self._lock:
                busy = set(self._busy)
            victim = self.slots.lru(exclude=busy)
            if victim is None:
                raise MemoryError("every slot is busy")
            self._release(victim)
            self.stats.evictions += 1
        h = self.slots.insert(stream_id, state, epoch=epoch, state_key=key, logits=logits)
        with self._lock:
            if key is None:
                self._committed.pop(stream_id, None)
            else:
                self._committed[stream_id] = key
        return h

    def _release(self, stream_id: str) -> bool:
        with self._lock:
            self._committed.pop(stream_id, None)
        return self.slots.release(stream_id)

    def _admit(self, w: _Work) -> bool:
        """Bind a work to its stream's slot, loading the state it brought; False if it failed."""
        with self._lock:
            if w.stream_id in self._busy:
                w.future.set_exception(StreamBusy(f"stream {w.stream_id} already has a chunk running here"))
                return False
            committed = self._committed.get(w.stream_id)
        try:
            if committed != w.expected_key:
                if w.load is None:
                    raise NeedsLoad(w.stream_id)
                state, logits = w.load
                self._insert(w.stream_id, state, w.epoch, w.expected_key, logits)
                self.stats.loads += 1
            h = self.slots.handle(w.stream_id)
            assert h is not None
            w.handle = h
            if w.sampler is not None:
                first = self.slots.next_logits(h)
                if first is None:
                    raise ValueError("nothing to continue from: feed a prompt before generating")
                tok = w.sampler(first)
                w.tokens = [] if tok is None else [tok]
            with self._lock:
                self._busy.add(w.stream_id)
                self._committed.pop(w.stream_id, None)  # from here the slot runs ahead of the store
            return True
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            w.future.set_exception(exc)
            return False

    def _finish(self, w: _Work, state: State, last: torch.Tensor | None) -> None:
        logits = torch.cat(w.rows) if w.rows else torch.zeros((0, self.model.vocab_size))
        if last is None:
            last = self.slots.next_logits(w.handle)
            last = None if last is None else last.clone()
        with self._lock:
            self._busy.discard(w.stream_id)
        w.future.set_result(ChunkOutput(list(w.tokens), logits, state, last, w.path))

    def _fail(self, w: _Work, exc: BaseException) -> None:
        with self._lock:
            self._busy.discard(w.stream_id)
        self._release(w.stream_id)  # its slot may hold a half-advanced state: drop it
        w.future.set_exception(exc)

    def _loop(self) -> None:
        pending: list[_Work] = []
        while not self._stop:
            block = not pending
            try:
                item = self._inbox.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                item = None
            deadline = time.perf_counter() + self.max_wait_s
            while item is not None:
                if isinstance(item, tuple):  # a control call
                    fn, fut = item
                    try:
                        fut.set_result(fn())
                    except Exception as exc:  # noqa: BLE001
                        fut.set_exception(exc)
                elif isinstance(item, _Work):
                    if self._admit(item):
                        pending.append(item)
                else:  # None: stop
                    return
                singles = sum(1 for w in pending if len(w.tokens) - w.done == 1)
                wait = deadline - time.perf_counter()
                if singles >= self.max_batch or (pending and wait <= 0):
                    break
                try:
                    item = self._inbox.get(timeout=max(wait, 0)) if pending else self._inbox.get()
                except queue.Empty:
                    item = None
            if pending:
                pending = self._round(pending)

    def _round(self, pending: list[_Work]) -> list[_Work]:
        """One batched step of every single-token work, then one piece of the oldest long one."""
        model, slots = self.model, self.slots
        for w in [w for w in pending if not w.tokens]:  # empty chunks: the state as it is
            self._finish(w, slots.view(w.handle).clone(), None)
        pending = [w for w in pending if w.tokens]
        singles = [w for w in pending if len(w.tokens) - w.done == 1][: self.max_batch]
        if singles:
            try:
                t0 = time.perf_counter()
                logits, path = slots.step([w.handle for w in singles], [w.tokens[w.done] for w in singles])
                self.stats.step_seconds += time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001
                for w in singles:
                    self._fail(w, exc)
                return [w for w in pending if w not in singles]
            self.stats.steps += 1
            self.stats.stepped_streams += len(singles)
            self.stats.max_batch = max(self.stats.max_batch, len(singles))
            for i, w in enumerate(singles):
                row = logits[i : i + 1].clone()  # not a view: the batch must not outlive its round
                w.rows.append(row)
                w.done += 1
                w.path = path
                if w.sampler is not None and w.done < w.max_tokens:
                    try:
                        nxt = w.sampler(row[0])
                    except Exception as exc:  # noqa: BLE001 - the sampler is the caller's
                        self._fail(w, exc)
                        continue
                    if nxt is not None:
                        w.tokens.append(nxt)
                        continue
                self._finish(w, slots.state(w.handle), row[0].clone())
        longs = [w for w in pending if len(w.tokens) - w.done > 1]
        if longs:
            w = longs[0]
            piece = w.tokens[w.done : w.done + self.prefill_piece]
            try:
                r = model.advance(slots.view(w.handle), piece)
            except Exception as exc:  # noqa: BLE001
                self._fail(w, exc)
                return [x for x in pending if x is not w and x not in singles]
            self.stats.pieces += 1
            slots.write(w.handle, r.state, r.logits[-1], state_key=None)
            w.rows.append(r.logits)
            w.done += len(piece)
            w.path = r.path
            if w.done == len(w.tokens):
                self._finish(w, r.state, r.logits[-1])
        return [w for w in pending if w.done < len(w.tokens) and not w.future.done()]
