"""StreamEngine: one model's slots and the thread that advances them, batching across streams.

Activities submit chunks and wait; the engine thread is the only one that touches the slot table
and runs the model. Each round it takes every waiting single-token step (decode, generate) as
one batched step on the slot buffers in place (`Model.step_rows`, the arithmetic of
`advance_batch`; up to `max_batch`, after waiting at most `max_wait_s` for company),
then one piece (`prefill_piece` tokens, fewer where a piece took longer than `piece_s`) of one long
chunk. A 4,096-token prefill therefore holds waiting decodes up for at most one piece. Splitting a
chunk into pieces is invisible by the engine's own contract: bit-exact on the exact and reference
backends, within the declared bounds elsewhere.

Fair across principals (`fair`, the default): a work's owner is its stream's principal tag, and
which long chunk gets the round's piece, and which single steps fill a full batch, is decided by
start-time fair queueing over owners (`_Shares`): each owner's virtual time grows by the tokens it
was served over its weight, the least goes first, and an owner that comes back from idle starts at
the least of those waiting (no credit saved up while idle). One principal's hundred chunks
therefore delay another's by about one piece, not a hundred. Scheduling never changes bits: each
stream's tokens are advanced in its own order, whatever the order between streams. `fair=False`:
first come, first served.

Per round, what is not the model's arithmetic is kept per batch rather than per row: the layers
write the new states straight into the slots (`SlotTable.step`, no copy-back), each stream's
logits rows go into one growing buffer of its own, and streams that sample with a
`SeededSampler` are sampled together (`sample_rows`: one softmax and one argmax for the batch,
each stream's own generator for its draws), with the bits of sampling each alone.

A work whose caller stopped waiting for it (a cancelled attempt: `on_wait` raised) is dropped at
the next round, with the half-advanced state in its slot: a cancelled long prefill does not keep
the engine busy to its end.

States stay in their slots between chunks (the hot cache). A full table evicts its least
recently used idle stream: nothing is written, its checkpoint is already in the store, and its
next chunk reloads from there (a migration).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import torch

from mamba_stream.activities._alloc import tune_allocator
from mamba_stream.activities._slots import SlotTable
from mamba_stream.failures import Failure
from mamba_stream.scan import ConfigError, Model, NonFiniteOutput, State
from mamba_stream.state_codec import stream_tag
from mamba_stream.workflows import QuotaExceeded

__all__ = ["ChunkOutput", "EngineDead", "EngineStats", "NeedsLoad", "SeededSampler", "StreamBusy", "StreamEngine",
           "owner_of", "sample_rows"]

log = logging.getLogger(__name__)

#: a stream that sent work this recently is expected to send more: a batch waits for it
COMPANY_WINDOW_S = 0.1
#: how often a caller waiting on its work runs its `on_wait` when nothing wakes it sooner (a
#: cancelled attempt notices there, and a dead engine is noticed)
WAIT_SLICE_S = 0.2
#: how often a waiting caller without news heartbeats (`on_wait` paces itself by it)
WAIT_S = 1.0


class EngineDead(RuntimeError):
    """The engine's thread is gone (an exception escaped it): nothing this engine holds or is
    given will advance. Untyped on purpose: it is the worker's fault, not the chunk's, and counts
    towards the worker's health (`activities.WorkerHealth`)."""


class NeedsLoad(LookupError):
    """The stream's committed state is not in a slot: load it from the store and resubmit."""


class StreamBusy(Failure, RuntimeError):
    """Another chunk of the same stream is still running here (a retry overtook its attempt, e.g.
    the regular attempt after a local one timed out). Retryable: once that one is done, the retry
    finds its record."""

    retryable = True


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
class SeededSampler:
    """A stream's seeded sampling, in a form the engine can batch with other streams' (`generate`).

    Calling it samples one row (the per-row path); `sample_rows` samples the rows of many
    streams at once. Both give, row for row, the token and the generator state of the activity's
    `_sample(next_logits, temperature, top_k, generator)`: temperature 0 is the argmax; else
    softmax(logits / temperature) (over the top_k largest when top_k > 0) and one draw of
    torch.multinomial from `generator`.

    proceed: called before each token is sampled; False ends the generation there (a stop text
        completed). None: always proceed.
    taken: told each token sampled.
    """

    temperature: float
    top_k: int
    generator: torch.Generator
    proceed: Callable[[], bool] | None = None
    taken: Callable[[int], None] | None = None

    def __call__(self, next_logits: torch.Tensor) -> int | None:
        if self.proceed is not None and not self.proceed():
            return None
        tok = _sample_one(next_logits.cpu(), self.temperature, self.top_k, self.generator)
        if self.taken is not None:
            self.taken(tok)
        return tok


def _sample_one(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """One row (V,): how a generate samples (`SeededSampler`); `sample_rows` reproduces it for a batch."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    x = logits.double() / temperature
    if top_k:
        vals, idx = torch.topk(x, min(top_k, x.numel()))
        choice = torch.multinomial(torch.softmax(vals, dim=-1), 1, generator=gen)
        return int(idx[choice])
    probs = torch.softmax(x, dim=-1)
    if not math.isfinite(float(probs.sum())):
        raise NonFiniteOutput("non-finite sampling distribution")
    return int(torch.multinomial(probs, 1, generator=gen))


def sample_rows(logits: torch.Tensor, samplers: list[SeededSampler]) -> list[int]:
    """Sample row i of `logits` (B, V) with samplers[i], for all rows at once; each token and each
    generator's state is what `samplers[i]` alone would give (`proceed` and `taken` are not
    called: that is the caller's part). A row that fails alone (a non-finite distribution) raises
    its error, after every other row has drawn as it would have alone.

    torch.multinomial draws one sample as argmax(p / q), q ~ Exp(1) drawn from the generator
    (ATen's Gumbel-max form, checked at first use by `_multinomial_form_holds`), so only the
    draws stay per row; the casts, divisions, softmax, validity checks and argmax run once
    for the batch. A row the batch cannot take as it is (a distribution torch would refuse, or a
    torch whose multinomial is another algorithm) is sampled alone.
    """
    out = _sample_rows(logits, samplers)
    for t in out:
        if isinstance(t, BaseException):
            raise t
    return out  # type: ignore[return-value]


def _sample_rows(logits: torch.Tensor, samplers: list[SeededSampler]) -> list[int | Exception]:
    """`sample_rows`, each failing row's exception in its place."""
    n = len(samplers)
    if n != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows but {n} samplers")
    out: list[int | Exception] = [0] * n
    if n == 0:
        return out
    logits = logits.cpu()

    def alone(i: int) -> None:
        s = samplers[i]
        try:
            out[i] = _sample_one(logits[i], s.temperature, s.top_k, s.generator)
        except Exception as exc:  # noqa: BLE001 - the row's own error, for its own stream
            out[i] = exc

    greedy = [i for i, s in enumerate(samplers) if s.temperature == 0.0]
    if greedy:
        for i, t in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist(), strict=True):
            out[i] = int(t)
    rest = [i for i, s in enumerate(samplers) if s.temperature != 0.0]
    if rest and not _multinomial_form_holds():
        for i in rest:
            alone(i)
        return out
    # one group per (temperature, top_k): a row's division is by its own Python float, as alone
    groups: dict[tuple[float, int], list[int]] = {}
    for i in rest:
        groups.setdefault((samplers[i].temperature, samplers[i].top_k), []).append(i)
    for (temperature, top_k), idx in groups.items():
        x = logits[idx].double() / temperature  # (b, V)
        if top_k:
            vals, cols = torch.topk(x, min(top_k, x.shape[-1]), dim=-1)  # (b, k)
            probs = torch.softmax(vals, dim=-1)
        else:
            cols, probs = None, torch.softmax(x, dim=-1)
        # the non-finite check of a row sampled alone, and what torch.multinomial refuses
        total = probs.sum(dim=-1)
        ok = (torch.isfinite(total) & (total != 0) & (probs.amax(dim=-1) < math.inf)
              & (probs.amin(dim=-1) >= 0)).tolist()
        q = torch.empty_like(probs)
        good: list[int] = []
        for j, i in enumerate(idx):
            if ok[j]:
                q[j].exponential_(1, generator=samplers[i].generator)
                good.append(j)
            else:
                alone(i)  # it raises (or draws) exactly as alone
        if good:
            sel = torch.tensor(good, dtype=torch.long)
            picks = torch.argmax(probs[sel] / q[sel], dim=-1)  # (g,)
            if cols is not None:
                picks = cols[sel].gather(1, picks.unsqueeze(1)).squeeze(1)
            for j, t in zip(good, picks.tolist(), strict=True):
                out[idx[j]] = int(t)
    return out


_FORM: list[bool] = []


def _multinomial_form_holds() -> bool:
    """Whether this torch's one-sample multinomial is argmax(p / Exp(1) draws), draws and all
    (checked once: a torch that samples otherwise gets the per-row path, never other tokens)."""
    if not _FORM:
        probs = torch.softmax(torch.linspace(-3.0, 3.0, 97, dtype=torch.float64), dim=-1)
        same = True
        for seed in range(8):
            a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            want = int(torch.multinomial(probs, 1, generator=a))
            got = int(torch.argmax(probs / torch.empty_like(probs).exponential_(1, generator=b)))
            same = same and want == got and torch.equal(a.get_state(), b.get_state())
        if not same:
            log.warning("torch.multinomial is not the Gumbel-max form here; sampling row by row")
        _FORM.append(same)
    return _FORM[0]


#: the most queued items (calls and chunks) an engine takes between two rounds once a round is due:
#: a burst is served at once, a flood cannot hold the rounds off
DRAIN_ITEMS = 256


class _Rows:
    """A stream's logits rows, float32 (n, V), in one buffer that doubles when full: a row costs
    one copy, and the chunk's logits need no concatenation at the end."""

    def __init__(self, vocab: int, hint: int, device: torch.device) -> None:
        self._buf = torch.empty((max(1, hint), vocab), dtype=torch.float32, device=device)
        self.n = 0

    def extend(self, rows: torch.Tensor) -> None:
        """Append rows (k, V)."""
        k = rows.shape[0]
        if self.n + k > self._buf.shape[0]:
            grown = self._buf.new_empty((max(2 * self._buf.shape[0], self.n + k), self._buf.shape[1]))
            grown[: self.n].copy_(self._buf[: self.n])
            self._buf = grown
        self._buf[self.n : self.n + k].copy_(rows)
        self.n += k

    def last(self) -> torch.Tensor:
        return self._buf[self.n - 1].clone()

    def tensor(self) -> torch.Tensor:
        """The rows as the caller's own tensor (n, V), not holding a larger buffer alive."""
        if self.n == self._buf.shape[0]:
            return self._buf
        return self._buf[: self.n].clone()


class _LastRow(_Rows):
    """The newest row only: a chunk whose caller needs the next-token logits and nothing else (a
    prefix's state: 2,048 rows of a 50,280-token vocabulary would be 412 MB)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        super().__init__(vocab, 1, device)

    def extend(self, rows: torch.Tensor) -> None:
        self._buf[0].copy_(rows[-1])
        self.n = 1

    def tensor(self) -> torch.Tensor:
        return self._buf[:0].clone()  # no rows kept


@dataclass
class _Work:
    stream_id: str
    tokens: list[int]
    expected_key: str  # the committed state key the chunk starts from
    epoch: int
    load: tuple[State, torch.Tensor | None] | None
    future: Future = field(default_factory=Future)
    rows: _Rows | None = None  # the chunk's logits so far, from admission
    done: int = 0
    path: str = "empty"
    handle: object = None
    # generation: picks the next token from the latest logits, or None to stop
    sampler: Callable[[torch.Tensor], int | None] | None = None
    max_tokens: int = 0
    abandoned: bool = False  # its caller stopped waiting (a cancelled attempt): dropped at the next round
    keep_rows: bool = True  # False: only the last row is kept (ChunkOutput.logits is empty)
    owner: str | None = None  # whose share it is served from; None: the stream's (`owner_of`)

    def __post_init__(self) -> None:
        if self.owner is None:
            self.owner = owner_of(self.stream_id)


def owner_of(stream_id: str) -> str:
    """The owner a stream's work is served as: its principal tag ("" for an id without one)."""
    return stream_tag(stream_id) or ""


class _Shares:
    """Start-time fair queueing over owners. `order` lists works so that each owner's are in
    arrival order and owners alternate by virtual time (tokens served / weight, the least first;
    ties: the earlier arrival); `charge` adds what was served. An owner with no work waiting is
    forgotten, and starts again at the least virtual time of those waiting: nothing is saved up
    while idle, nothing owed either."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self.vt: dict[str, float] = {}

    def weight(self, owner: str) -> float:
        return self.weights.get(owner, 1.0)

    def settle(self, waiting: list[_Work]) -> None:
        """Forget the owners with nothing waiting; start new ones at the floor."""
        owners = {w.owner for w in waiting}
        self.vt = {o: t for o, t in self.vt.items() if o in owners}
        floor = min(self.vt.values(), default=0.0)
        for o in owners:
            self.vt.setdefault(o, floor)

    def order(self, works: list[_Work], cost: Callable[[_Work], int], limit: int) -> list[_Work]:
        """Up to `limit` of `works` (in arrival order), in fair order."""
        if len(works) <= limit:  # every one is served: the order between them changes nothing
            return works
        queues: dict[str, list[_Work]] = {}
        for w in works:
            queues.setdefault(w.owner, []).append(w)
        if len(queues) <= 1:
            return works[:limit]
        vt = {o: self.vt.get(o, 0.0) for o in queues}
        pos = {id(w): i for i, w in enumerate(works)}
        first = {o: pos[id(q[0])] for o, q in queues.items()}
        heads = dict.fromkeys(queues, 0)
        out: list[_Work] = []
        while len(out) < limit and heads:
            o = min(heads, key=lambda k: (vt[k], first[k]))
            w = queues[o][heads[o]]
            out.append(w)
            vt[o] += cost(w) / self.weight(o)
            heads[o] += 1
            if heads[o] == len(queues[o]):
                del heads[o]
            else:
                first[o] = pos[id(queues[o][heads[o]])]
        return out

    def charge(self, owner: str, tokens: int) -> None:
        self.vt[owner] = self.vt.get(owner, 0.0) + tokens / self.weight(owner)


#: how long one prefill piece may hold the engine before pieces are made shorter
PIECE_S = 0.5
#: the shortest piece a long prefill is cut into
MIN_PIECE = 16

#: the most memory one model's slot table takes by default: its capacity is cut to fit (a 7B
#: Mamba-2's state is 275 MB a stream, so 256 slots would be 70 GB; a full table evicts its least
#: recently used stream to its checkpoint, so fewer slots cost reloads, not streams)
SLOT_MEMORY = 2 << 30


class StreamEngine:
    """Args:
    model: the served model.
    capacity: slots (streams held hot at once), at most as many as `slot_memory` bytes hold.
    max_batch: single-token steps advanced together.
    max_wait_s: how long a lone step waits for company.
    prefill_piece: tokens of a long chunk advanced per round, at most.
    piece_s: a piece that took longer makes the next ones shorter (to about this long, at least
        `MIN_PIECE` tokens): a large model's prefill holds the other streams up for a bounded time.
    fair: share the rounds between owners (principal tags) by `weights` (tag -> weight, default
        1.0); False: first come, first served.
    state_quota: the most slot bytes (states, logits rows) one owner holds (`Quotas.state_bytes`):
        a chunk past it evicts the owner's own least recently used idle stream, or is refused
        `QuotaExceeded` when all of them are running; a state held after a commit is then not
        kept hot (it is in the store). None: no bound but the table's.
    """

    def __init__(self, model: Model, *, capacity: int = 256, max_batch: int = 64, max_wait_s: float = 0.002,
                 prefill_piece: int = 256, slot_memory: int = SLOT_MEMORY, piece_s: float = PIECE_S,
                 fair: bool = True, weights: dict[str, float] | None = None,
                 state_quota: int | None = None) -> None:
        tune_allocator()  # batched steps churn state-sized temporaries; see activities/_alloc.py
        self.model = model
        per_slot = model.schema.state_bytes + model.vocab_size * 4  # a state and its logits row
        if per_slot > slot_memory and model.config.max_positions is not None:
            # a hybrid's slot holds its KV at the bound: one that does not fit is refused, not half-served
            raise ConfigError(f"model {model.model_id!r}: one stream's state at max_positions="
                              f"{model.config.max_positions} is {per_slot / 2**30:.2f} GiB, more than the "
                              f"{slot_memory / 2**30:.2f} GiB of slots a model gets; lower the bound "
                              "(MAMBA_STREAM_MAX_POSITIONS)", field="max_positions")
        self._per_slot, self.state_quota = per_slot, state_quota
        fits = max(1, slot_memory // per_slot)
        if fits < capacity:
            log.info("engine for %s: %d slots of %.1f MB fit %.1f GB (asked for %d)", model.model_id, fits,
                     per_slot / 1e6, slot_memory / 1e9, capacity)
        self.slots = SlotTable(model, min(capacity, fits))
        self.max_batch, self.max_wait_s, self.prefill_piece = max_batch, max_wait_s, prefill_piece
        self.piece_s, self.fair = piece_s, fair
        self._piece = prefill_piece  # the current piece length (`_next_piece`)
        self._shares = _Shares(weights)
        self.stats = EngineStats()
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards `_committed` and `_busy`, read by other threads
        self._committed: dict[str, str] = {}  # stream -> committed state key held in its slot
        self._busy: set[str] = set()
        self._stop = False
        self._seen: dict[str, float] = {}  # stream -> when its last work arrived (for `_company`)
        self._round_s = 0.0  # moving average of a round's seconds (for `expected_seconds`)
        self._died: BaseException | None = None  # what ended the engine thread, if not `close`
        self._thread = threading.Thread(target=self._run, name=f"engine-{model.model_id}", daemon=True)
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
                on_wait: Callable[[], float | None] | None = None, keep_rows: bool = True,
                owner: str | None = None) -> ChunkOutput:
        """Advance a stream from its committed state `expected_key` by `tokens`; waits.

        `load` brings the committed state from the store when no slot holds it; `on_wait` runs
        in the caller's thread while it waits (activities check for cancellation and heartbeat
        there): every `WAIT_SLICE_S`, or when `wake` is set, or after the pause it returned (see
        `_wait`). `keep_rows` False: the output's `logits` is empty, `last_logits` set (the
        chunk's other rows are never kept). `owner`: whose share the work is served from (default
        the stream's principal tag, `owner_of`).
        """
        return self._submit(lambda pre: _Work(stream_id, list(tokens), expected_key, epoch, pre,
                                              keep_rows=keep_rows, owner=owner),
                            stream_id, expected_key, load, on_wait, None)

    def generate(self, stream_id: str, sampler: Callable[[torch.Tensor], int | None], max_tokens: int, *,
                 expected_key: str, epoch: int, load: Callable[[], tuple[State, torch.Tensor | None]],
                 on_wait: Callable[[], float | None] | None = None,
                 wake: threading.Event | None = None) -> ChunkOutput:
        """Sample up to `max_tokens` tokens, each advancing the state; every step is batched with
        the other streams' single-token steps. `sampler(next_logits)` returns a token or None.

        A `SeededSampler` is sampled together with the other streams' in each round
        (`sample_rows`), with the same tokens as called one row at a time; any other callable is
        called per row. An activity adopts it with
        `generate(stream_id, SeededSampler(temperature, top_k, generator, proceed=..., taken=...),
        max_tokens, ...)`, `proceed` doing what its callback did before sampling (metrics, the
        stop-text check: False to stop) and `taken` recording the token.

        `wake`: an event the caller sets (from `taken`, say) to have `on_wait` run at once, in the
        caller's thread: a streaming generate heartbeats its newest tokens there, never from the
        engine thread (a heartbeat waits for the worker's event loop).
        """
        return self._submit(lambda pre: _Work(stream_id, [], expected_key, epoch, pre, sampler=sampler,
                                              max_tokens=max_tokens),
                            stream_id, expected_key, load, on_wait, wake)

    def _submit(self, make: Callable[[object], _Work], stream_id: str, expected_key: str,
                load: Callable[[], tuple[State, torch.Tensor | None]],
                on_wait: Callable[[], float | None] | None, wake: threading.Event | None) -> ChunkOutput:
        pre = None if self.holds(stream_id, expected_key) else load()
        for _ in range(3):
            work = make(pre)
            pre = None  # the work holds it until its admission puts it in the slot, then nobody
            self._inbox.put(work)
            try:
                return self._wait(work, on_wait, wake)
            except NeedsLoad:  # evicted between the check and the run
                pre = load()
        raise NeedsLoad(f"stream {stream_id} keeps being evicted; raise the engine's capacity")

    def _wait(self, work: _Work, on_wait: Callable[[], float | None] | None,
              wake: threading.Event | None) -> ChunkOutput:
        """The work's output, running `on_wait` in this thread while it is not ready: after
        `WAIT_SLICE_S`, or as soon as `wake` is set, or, when `on_wait` returned a pause (seconds),
        once that pause has passed whatever `wake` says (a heartbeat paces itself this way, not per
        token), and at least every `WAIT_SLICE_S` (a dead engine and a cancellation are noticed
        within it). An exception from `on_wait` (the attempt was cancelled) abandons the work: the
        engine stops spending rounds on it and drops the half-advanced state it left."""
        future = work.future
        event = wake if wake is not None else threading.Event()
        future.add_done_callback(lambda _: event.set())
        pause: float | None = None
        while True:
            if pause is None:
                event.wait(WAIT_SLICE_S)
            else:
                futures_wait([future], timeout=min(pause, WAIT_SLICE_S))
            event.clear()  # cleared before the check: a token or the end after it sets it again
            if future.done():
                return future.result()
            self._alive()
            if on_wait is not None:
                try:
                    pause = on_wait()
                except BaseException:
                    work.abandoned = True
                    raise

    def expected_seconds(self, rounds: int) -> float | None:
        """About how long `rounds` rounds take now, at the engine's recent pace (a generate of n
        tokens is n rounds; a prefill, one per `prefill_piece` tokens); None before its first round."""
        return rounds * self._round_s if self._round_s > 0 else None

    def mark_committed(self, stream_id: str, state_key: str) -> None:
        """The chunk's checkpoint is in the store: its slot now holds that committed state."""
        self._call(lambda: self._mark_committed(stream_id, state_key))

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
        from concurrent.futures import TimeoutError as FutureTimeout

        fut: Future = Future()
        self._inbox.put((fn, fut))
        while True:
            try:
                return fut.result(timeout=1.0)
            except FutureTimeout:
                self._alive()

    def _alive(self) -> None:
        """Raise EngineDead if the engine's thread ended without being closed: a caller must not
        wait forever on work nobody will do."""
        if not self._thread.is_alive():
            raise EngineDead(f"the engine thread of {self.model.model_id} is gone"
                             + ("" if self._stop else f": {self._died!r}"))

    # --- the engine thread -----------------------------------------------------------------------

    def _mark_committed(self, stream_id: str, key: str) -> None:
        h = self.slots.handle(stream_id)
        if h is not None:
            self.slots.mark_committed(h, key)
            with self._lock:
                self._committed[stream_id] = key

    def _owner_room(self, stream_id: str, strict: bool) -> bool:
        """Whether the stream's owner may hold one more slot under `state_quota`, after evicting
        its own least recently used idle streams; False (not strict) or `QuotaExceeded` (strict)
        when every slot it holds is running."""
        owner = owner_of(stream_id)
        if self.state_quota is None or not owner:
            return True
        held = [m.stream_id for m in self.slots.meta if m.stream_id]
        mine = [sid for sid in held if owner_of(sid) == owner]
        others = set(held) - set(mine)
        while (len(mine) + 1) * self._per_slot > self.state_quota:
            victim = self._evict(others)
            if victim is None:
                if not strict:
                    return False
                raise QuotaExceeded(
                    f"the principal's {len(mine)} running streams hold {len(mine) * self._per_slot} bytes of state "
                    f"on this worker; one more is past its quota state_bytes {self.state_quota} "
                    "(MAMBA_STREAM_QUOTA_STATE_BYTES)",
                    quota="state_bytes", limit=self.state_quota, used=len(mine) * self._per_slot)
            mine.remove(victim)
        return True

    def _evict(self, spare: set[str] = frozenset()) -> str | None:
        """Release the least recently used idle stream not in `spare` (its checkpoint is in the
        store); the one released, or None when every candidate is running."""
        with self._lock:
            busy = set(self._busy)
        victim = self.slots.lru(exclude=busy | spare)
        if victim is not None:
            self._release(victim)
            self.stats.evictions += 1
        return victim

    def _insert(self, stream_id: str, state: State, epoch: int, key: str | None, logits, *,
                strict: bool = False) -> object:
        """Hold `state` in the stream's slot. `strict`: a chunk about to run (past the owner's
        quota: `QuotaExceeded`); else a committed state kept hot, which is dropped instead (None)."""
        if self.slots.handle(stream_id) is None:
            if not self._owner_room(stream_id, strict):
                return None
            if not self.slots.free and self._evict() is None:
                raise MemoryError("every slot is busy")
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
                # the slot holds a copy: the loaded state (a whole state's size) is let go now,
                # not when the chunk ends
                w.load = None
                self._insert(w.stream_id, state, w.epoch, w.expected_key, logits, strict=True)
                self.stats.loads += 1
            h = self.slots.handle(w.stream_id)
            assert h is not None
            w.handle = h
            hint = len(w.tokens) if w.sampler is None else min(w.max_tokens, 256)
            w.rows = (_Rows(self.model.vocab_size, hint, self.slots.logits.device) if w.keep_rows
                      else _LastRow(self.model.vocab_size, self.slots.logits.device))
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
        if w.rows is not None and w.rows.n and w.keep_rows:
            logits = w.rows.tensor()
        else:
            logits = torch.zeros((0, self.model.vocab_size))
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

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # recorded for the callers left waiting (`_alive`)
            self._died = exc
            log.critical("the engine thread of %s died", self.model.model_id, exc_info=exc)
            raise

    def _loop(self) -> None:
        pending: list[_Work] = []
        while not self._stop:
            block = not pending
            try:
                item = self._inbox.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                item = None
            deadline = time.perf_counter() + self.max_wait_s
            drained = 0
            while item is not None:
                if isinstance(item, tuple):  # a control call
                    self._control(*item)
                elif isinstance(item, _Work):
                    self._seen[item.stream_id] = time.perf_counter()
                    if self._admit(item):
                        pending.append(item)
                else:  # None: stop
                    return
                # not held while this thread waits for the next: a call's closure may hold a whole
                # state (a put's), which would stay in memory as long as the engine is idle
                item = None
                singles = sum(1 for w in pending if len(w.tokens) - w.done == 1)
                wait = deadline - time.perf_counter()
                # a lone stream does not wait for company that is not coming: it would wait out
                # max_wait_s on every token; with other streams active lately, it waits
                ready = singles >= self.max_batch or (pending and (wait <= 0 or not self._company(pending)))
                drained += 1
                if ready and drained > DRAIN_ITEMS:
                    break
                try:
                    # ready: what is already queued is still taken (waiting for nothing), so that a
                    # burst of calls (30 streams opening at once, each putting its state) is not
                    # served one per round behind the other streams' decode steps
                    item = (self._inbox.get_nowait() if ready else
                            self._inbox.get(timeout=max(wait, 0)) if pending else self._inbox.get())
                except queue.Empty:
                    item = None
            if pending:
                t0 = time.perf_counter()
                pending = self._round(pending)
                self._round_s += 0.2 * (time.perf_counter() - t0 - self._round_s)

    @staticmethod
    def _control(fn: Callable[[], object], fut: Future) -> None:
        """Run a control call for its caller (`_call`); nothing of it stays referenced here."""
        try:
            fut.set_result(fn())
        except Exception as exc:  # noqa: BLE001
            fut.set_exception(exc)

    def _company(self, pending: list[_Work]) -> bool:
        """Whether another stream, not waiting yet, sent work within the last COMPANY_WINDOW_S."""
        now = time.perf_counter()
        here = {w.stream_id for w in pending}
        if len(self._seen) > 2 * self.slots.capacity:
            self._seen = {k: t for k, t in self._seen.items() if now - t < COMPANY_WINDOW_S}
        return any(now - t < COMPANY_WINDOW_S and sid not in here for sid, t in self._seen.items())

    def _round(self, pending: list[_Work]) -> list[_Work]:
        """One batched step of every single-token work, then one piece of the oldest long one."""
        model, slots = self.model, self.slots
        for w in [w for w in pending if w.abandoned]:
            self._fail(w, RuntimeError("abandoned by its caller"))
        pending = [w for w in pending if not w.abandoned]
        for w in [w for w in pending if not w.tokens]:  # empty chunks: the state as it is
            self._finish(w, slots.view(w.handle).clone(), None)
        pending = [w for w in pending if w.tokens]
        if self.fair:
            self._shares.settle(pending)
        singles = [w for w in pending if len(w.tokens) - w.done == 1]
        singles = (self._shares.order(singles, lambda w: 1, self.max_batch) if self.fair
                   else singles[: self.max_batch])
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
            if self.fair:
                for w in singles:
                    self._shares.charge(w.owner, 1)
            self.stats.max_batch = max(self.stats.max_batch, len(singles))
            batched: list[tuple[int, _Work]] = []  # rows whose SeededSampler draws with the batch
            for i, w in enumerate(singles):
                assert w.rows is not None
                w.rows.extend(logits[i : i + 1])
                w.done += 1
                w.path = path
                if w.sampler is not None and w.done < w.max_tokens:
                    if isinstance(w.sampler, SeededSampler):
                        try:
                            go = w.sampler.proceed is None or w.sampler.proceed()
                        except Exception as exc:  # noqa: BLE001 - the callback is the caller's
                            self._fail(w, exc)
                            continue
                        if go:
                            batched.append((i, w))
                            continue
                    else:
                        try:
                            nxt = w.sampler(logits[i])
                        except Exception as exc:  # noqa: BLE001 - the sampler is the caller's
                            self._fail(w, exc)
                            continue
                        if nxt is not None:
                            w.tokens.append(nxt)
                            continue
                self._finish(w, slots.state(w.handle), w.rows.last())
            if batched:
                self._sample_batch(logits, batched)
        longs = [w for w in pending if len(w.tokens) - w.done > 1]
        if longs:
            w = self._shares.order(longs, lambda w: len(w.tokens) - w.done, 1)[0] if self.fair else longs[0]
            piece = w.tokens[w.done : w.done + self._piece]
            t0 = time.perf_counter()
            try:
                # a work that keeps no rows (a prefix's) needs each piece's last row only
                r = model.advance(slots.view(w.handle), piece, logits="all" if w.keep_rows else "last")
            except Exception as exc:  # noqa: BLE001
                self._fail(w, exc)
                return [x for x in pending if x is not w and x not in singles]
            self._next_piece(len(piece), time.perf_counter() - t0)
            self.stats.pieces += 1
            if self.fair:
                self._shares.charge(w.owner, len(piece))
            slots.write(w.handle, r.state, r.logits[-1], state_key=None)
            assert w.rows is not None
            w.rows.extend(r.logits)
            w.done += len(piece)
            w.path = r.path
            if w.done == len(w.tokens):
                self._finish(w, r.state, r.logits[-1])
        return [w for w in pending if w.done < len(w.tokens) and not w.future.done()]

    def _next_piece(self, tokens: int, seconds: float) -> None:
        """The next piece's length: `prefill_piece`, or shorter where a piece of this model took
        longer than `piece_s` (to about `piece_s`, at least `MIN_PIECE`); back up as pieces speed up."""
        if tokens < MIN_PIECE or seconds <= 0:
            return
        fits = tokens * self.piece_s / seconds  # inf where piece_s is: never shortened
        self._piece = max(MIN_PIECE, int(min(self.prefill_piece, fits)))

    def _sample_batch(self, logits: torch.Tensor, batched: list[tuple[int, _Work]]) -> None:
        """The next token of every row in `batched` ((row of `logits`, work)), sampled at once."""
        toks = _sample_rows(logits[[i for i, _ in batched]], [w.sampler for _, w in batched])  # type: ignore[misc]
        for (_, w), tok in zip(batched, toks, strict=True):
            if isinstance(tok, Exception):
                self._fail(w, tok)
                continue
            taken = w.sampler.taken  # type: ignore[union-attr]
            if taken is not None:
                try:
                    taken(tok)
                except Exception as exc:  # noqa: BLE001 - the callback is the caller's
                    self._fail(w, exc)
                    continue
            w.tokens.append(tok)
