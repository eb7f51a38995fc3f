"""The prefix store: the states of token prefixes, computed once, opened from by later streams.

On an exact arithmetic a state is a pure function of (model revision, arithmetic id, input
transform, tokens): every chunking gives the same bits. So the state of a prefix (a system prompt,
a tool list) computed once is *the* state of that prefix for every later stream, at any length,
not only at a block boundary. `PrefixStore.state_for` gives a new stream the state of its prefix:
from the longest stored prefix of it, computing only the rest, and stores the whole prefix's state
for the next stream. Only an exact arithmetic serves or fills the store: elsewhere the bits follow
the machine, so a prefix is computed for each stream, as if fed by its first chunk.

Entries are scoped. A principal's prefixes are its own ("principal" scope): a scope's entries are
named by an HMAC, under a workers' key, of the scope and of everything the state's bits depend on
(`entry_id`), so a lookup for principal B can only ever name B's entries; a lookup makes the same
store calls whether or not another principal holds the same prefix, and a hit on B's side never
touches A's entries, their recency included. The operator may declare shared prefixes (a published
system prompt) per model (`shared`): those are served to every principal whose prefix starts with
one, from the "shared" scope, sealed under the workers' key like the rest.

In the store an entry is a sealed blob like a checkpoint (`state_codec.codec.seal`, bound to the
entry's own receipt, `stream_id` `pfx.<scope tag>`), its next-token logits beside it
(`<key>.out`), and an index record in the store's metadata (kind `prefix.<scope tag>`, name the
entry id), sealed (`seal_bytes`, bound to its kind and name): tokens, bytes, last use, the lease
generation that wrote it, the entry's receipt. `prefix-scopes` lists the scopes, for the sweep,
sealed too. Nothing a reader of the store without the keys can test a guessed prompt against: no
checksum, token count or principal is in clear, and a receipt names its prefix by a digest keyed
per scope (`PrefixStore.digest`), so the same prefix of two principals has two digests.
Retention is bounded by bytes per scope, least recently used out first: a bound shared by every
scope would let one principal's fills evict, and so detect, another's entries.

Concurrent opens of one new prefix compute it once in the deployment: on a worker they take the
entry's lock in turn, and across workers its fill lease in the store's metadata (`_lease`: first
writer wins, renewed while held, taken over once stale); the others wait, then load what the first
one stored. An open whose whole prefix is stored waits for no one. A lease carries a generation
(a token unique to one holding, first in its record), and every write its holder makes (the
entry's blobs, its index record) is fenced by it: a holder that stalled past the stale time while
another worker took the lease over has its writes refused (`LeaseLost`), keeps what it computed
for its own stream, and stores nothing. Decoded states of recent entries stay in memory (bounded
by bytes): a hit on one skips the store's read and the unsealing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.activities._segments import KVSegments
from mamba_stream.activities._store import (
    Fence,
    LeaseLost,
    StateStore,
    StoreCorrupt,
    StoreError,
    since_of,
    since_record,
)
from mamba_stream.scan import Model, State
from mamba_stream.state_codec import Origin, Receipt, StateRejected, continue_arithmetic, prefix_digest
from mamba_stream.state_codec.codec import Keyring, open_bytes, seal, seal_bytes, segment_rows, unseal

__all__ = ["PREFIX_STREAM_PREFIX", "SHARED_PRINCIPAL", "PrefixStore", "PrefixSweep", "Scope", "is_prefix_stream"]

log = logging.getLogger(__name__)

#: the stream ids of prefix entries start with this; no stream may take one (`is_prefix_stream`)
PREFIX_STREAM_PREFIX = "pfx."
#: the principal column (and sealing binding) of shared entries; no principal's scope is named by it
SHARED_PRINCIPAL = "*shared*"
#: metadata kind listing the scopes that hold entries (name: scope tag; data: its principal)
SCOPES_KIND = "prefix-scopes"
#: the workers' key that names scopes and entries (`Keyring.subkey`)
_KEY_LABEL = "mamba-stream/prefix/v1"
#: an entry's last use is written back at most this often (seconds): a hit reads nothing else
TOUCH_S = 1.0
#: the index record's layout (1: in clear, from before records were sealed; still read)
_RECORD_VERSION = 2
#: a fill's lease in the store's metadata (kind `prefix-fill.<scope tag>`, name the entry id): one
#: worker of the deployment computes a new prefix at a time; the others wait for its entry. Renewed
#: every LEASE_S / 3 while held; one not renewed for LEASE_S (its worker died) is taken over.
#: Its record is `<generation> <{"since": ..., "by": ...}>`: the generation first, for fences.
LEASE_S = 30.0
#: how often a worker waiting for another's fill looks whether its lease is gone
LEASE_POLL_S = 0.1

ScopeKind = Literal["principal", "shared"]


def is_prefix_stream(stream_id: str) -> bool:
    """Whether `stream_id` is in the prefix store's namespace (no stream may take such an id:
    disposing it would delete the scope's entries)."""
    return stream_id.startswith(PREFIX_STREAM_PREFIX)


@dataclass(frozen=True)
class Scope:
    """Whose entries: one principal's, or the shared ones."""

    kind: ScopeKind
    principal: str  # whose: the entries' receipts and seals name it (SHARED_PRINCIPAL for the shared scope)
    tag: str  # HMAC of the scope: the stream id and metadata kind of its entries
    owner: str  # the store's owner of its objects: the principal's keyed tag

    @property
    def stream_id(self) -> str:
        return f"{PREFIX_STREAM_PREFIX}{self.tag}"

    @property
    def index_kind(self) -> str:
        return f"prefix.{self.tag}"

    @property
    def lease_kind(self) -> str:
        return f"prefix-fill.{self.tag}"

    def key(self, eid: str) -> str:
        """The store key of entry `eid`'s state (its logits: `<key>.out`)."""
        return f"{self.stream_id}.{eid}"


@dataclass(frozen=True)
class _Entry:
    """An index record: one stored prefix state."""

    id: str
    scope: Scope
    tokens: int
    bytes: int
    used: float
    made: float
    receipt: Receipt
    generation: str = ""  # the fill lease's generation that stored it ("" from before leases had one)

    @property
    def key(self) -> str:
        return self.receipt.state_key

    def seal(self, keyring: Keyring) -> bytes:
        """The index record as stored: sealed, bound to its kind and name."""
        body = json.dumps({"v": _RECORD_VERSION, "tokens": self.tokens, "bytes": self.bytes, "used": self.used,
                           "made": self.made, "generation": self.generation,
                           "receipt": self.receipt.model_dump(mode="json")}, separators=(",", ":")).encode()
        return seal_bytes(body, binding=_index_binding(self.scope, self.id), keyring=keyring)

    @classmethod
    def open(cls, eid: str, scope: Scope, data: bytes, keyring: Keyring) -> _Entry:
        """An index record as stored (a version-1 record, in clear, is read too)."""
        if not _in_clear(data):
            data = open_bytes(data, binding=_index_binding(scope, eid), keyring=keyring)
        obj = json.loads(data)
        return cls(eid, scope, int(obj["tokens"]), int(obj["bytes"]), float(obj["used"]), float(obj["made"]),
                   Receipt.model_validate(obj["receipt"]), str(obj.get("generation", "")))


def _index_binding(scope: Scope, eid: str) -> str:
    return f"prefix-index|{scope.index_kind}|{eid}"


def _scope_binding(tag: str) -> str:
    return f"prefix-scope|{tag}"


def _in_clear(data: bytes) -> bool:
    """A metadata record written in clear JSON, before records were sealed (a sealed one is msgpack)."""
    return data[:1] == b"{"


def _lease_record(generation: str, when: float, by: str) -> bytes:
    """A fill lease's record: its generation first (what fences compare), then when and by whom."""
    return generation.encode() + b" " + since_record(when, by=by)


def _lease_since(data: bytes | None) -> float | None:
    """When a lease was taken or last renewed; None for none, or an unreadable one (taken over)."""
    if data is None:
        return None
    try:
        return since_of(data if _in_clear(data) else data.partition(b" ")[2])
    except StoreCorrupt:
        return None


class _Held:
    """A fill lease this worker holds: its fence, its record as last written, whether it was lost."""

    def __init__(self, kind: str, eid: str, generation: str, record: bytes) -> None:
        self.kind, self.eid, self.generation, self.record = kind, eid, generation, record
        self.fence = Fence(kind, eid, generation.encode() + b" ")
        self.lost = False


@dataclass(frozen=True)
class Opened:
    """A prefix's state for a new stream: the state, its next-token logits, where it came from."""

    state: State
    logits: torch.Tensor | None
    origin: Origin


@dataclass
class PrefixSweep:
    """What a sweep of the prefix store did."""

    scopes: int = 0
    entries: int = 0
    bytes: int = 0
    evicted: int = 0
    incomplete: int = 0


#: `compute(state, tokens)`: the state after `tokens`, its next-token logits and the path that ran
Compute = Callable[[State, list[int]], tuple[State, torch.Tensor | None, str]]


class PrefixStore:
    """Prefix states of the models one worker serves, in the deployment's state store.

    Args:
        store, keyring, metrics: the worker's.
        max_bytes: the bound on each scope's entries (sealed bytes); 0 turns the store off (every
            prefix is computed, nothing is stored).
        ram_bytes: decoded states kept in memory for hits (0: none).
        shared: the operator's shared prefixes by model id: texts (encoded by the model's input
            transform at first use) or token ids.
        segments: where a hybrid's KV segments go (the worker's commits', so that a stream opened
            from an entry shares its segments).
    """

    def __init__(self, store: StateStore, keyring: Keyring, metrics: StreamMetrics | None = None, *,
                 max_bytes: int = 1 << 30, ram_bytes: int = 256 << 20,
                 shared: Mapping[str, Sequence[str | Sequence[int]]] | None = None,
                 segments: KVSegments | None = None) -> None:
        self.store = store
        self.segments = segments or KVSegments(store, keyring)
        self.keyring = keyring
        self.metrics = metrics or StreamMetrics()
        self.max_bytes = max_bytes
        self.ram_bytes = ram_bytes
        self.shared = {m: list(ps) for m, ps in (shared or {}).items()}
        self._shared_tokens: dict[tuple[str, str], list[list[int]]] = {}
        self._secret = keyring.subkey(_KEY_LABEL)
        self._guard = threading.Lock()
        self._flights: dict[str, list[Any]] = {}  # entry id -> [lock, waiters]
        self._ram: OrderedDict[str, tuple[State, torch.Tensor | None, _Entry]] = OrderedDict()
        self._ram_used = 0
        self._touched: dict[str, float] = {}  # entry id -> last use written back
        #: the wall clock of last uses, fills and leases, and the wait between looks at another
        #: worker's lease (tests set others)
        self.clock: Callable[[], float] = time.time
        self.sleep: Callable[[float], None] = time.sleep
        self._me = uuid.uuid4().hex[:12]  # this worker, in the leases it holds
        #: a fill lease not renewed for this long is taken over (tests shorten it)
        self.lease_s = LEASE_S
        #: the store keeps metadata (the entries' index, their leases): a store written before it does not
        self._keeps_meta = all(getattr(type(store), m) is not getattr(StateStore, m)
                               for m in ("read_meta", "put_meta", "put_meta_if_absent", "delete_meta"))

    # --- names ---------------------------------------------------------------------------------

    def scope(self, principal: str | None) -> Scope:
        """A principal's scope, or (None) the shared one."""
        name = "shared" if principal is None else f"principal|{principal}"
        tag = hmac.new(self._secret, f"scope|{name}".encode(), hashlib.sha256).hexdigest()[:32]
        return self._scope("shared" if principal is None else "principal",
                           SHARED_PRINCIPAL if principal is None else principal, tag)

    def _scope(self, kind: ScopeKind, principal: str, tag: str) -> Scope:
        return Scope(kind, principal, tag, self.keyring.principal_tag(principal))

    def entry_id(self, model: Model, scope: Scope, tokens: Sequence[int]) -> str:
        """The entry of `tokens`' state in `scope`: keyed by everything its bits depend on."""
        ident, a = model.identity(), model.arithmetic()
        body = json.dumps([scope.tag, ident.model_id, ident.model_revision, ident.fingerprint, a.id,
                           ident.input_transform, ident.input_transform_revision, _tokens_hash(tokens)],
                          separators=(",", ":"))
        return hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()[:40]

    def digest(self, scope: Scope, tokens: Sequence[int]) -> str:
        """What a receipt names a prefix by (`Origin.digest`): its tokens' digest keyed by `scope`,
        so that the same prefix of two principals has two digests, which neither a store reader
        nor the other principal can test a guess against; a declared shared prefix's is the
        shared scope's, the same for everyone."""
        return prefix_digest(tokens, hmac.new(self._secret, f"digest|{scope.tag}".encode(), hashlib.sha256).digest())

    def serves(self, model: Model) -> bool:
        """Whether prefixes of `model` are stored and served here: an exact arithmetic only, on a
        store that keeps metadata (the entries' index)."""
        return self.max_bytes > 0 and self._keeps_meta and model.arithmetic().exact

    # --- the open path -------------------------------------------------------------------------

    def state_for(self, model: Model, principal: str, tokens: list[int], compute: Compute,
                  on_wait: Callable[[], Any] = lambda: None) -> Opened:
        """The state of `tokens` (a checked, non-empty prefix) for a new stream of `principal`:
        from the longest stored prefix of it (the principal's own, or a declared shared one),
        computing only the rest, then stored whole in the principal's scope."""
        own = self.scope(principal)
        declared = self._declared(model, tokens)
        digest = self.digest(self.scope(None) if declared == tokens else own, tokens)
        if not self.serves(model):
            state, logits, _ = compute(model.initial_state(), tokens)
            self.metrics.prefix_tokens.add(len(tokens), {"model": model.model_id, "how": "computed"})
            return Opened(state, logits, Origin(kind="prefix", digest=digest, tokens=len(tokens)))
        eid = self.entry_id(model, own, tokens)
        hit = self._longest(model, own, tokens, eid)
        if hit is not None and hit[0].tokens == len(tokens):  # the whole prefix: no need to wait for anyone
            entry, state, logits = hit
            self._count_hit(model, entry, full=True, total=entry.tokens)
            return Opened(state, logits, Origin(kind="prefix", digest=digest, tokens=len(tokens),
                                                stored_tokens=entry.tokens, scope=entry.scope.kind))
        with self._once(own, eid, on_wait) as held:
            hit = self._longest(model, own, tokens, eid)  # again: another open may have stored it meanwhile
            fresh = False  # the declared shared prefix was computed just now
            if declared and (hit is None or hit[0].tokens < len(declared)):
                got, fresh = self._shared_entry(model, declared, compute, on_wait)
                hit = got or hit
            start, logits, at, stored, scope = model.initial_state(), None, 0, 0, ""
            if hit is not None:
                entry, start, logits = hit
                at = entry.tokens
                if not fresh:
                    stored, scope = entry.tokens, entry.scope.kind
                    self._count_hit(model, entry, full=at == len(tokens), total=stored)
            if not stored:
                self.metrics.prefix_misses.add(1, {"model": model.model_id})
            origin = Origin(kind="prefix", digest=digest, tokens=len(tokens), stored_tokens=stored, scope=scope)
            if at == len(tokens):
                return Opened(start, logits, origin)
            state, logits, path = compute(start, tokens[at:])
            self.metrics.prefix_tokens.add(len(tokens) - at, {"model": model.model_id, "how": "computed"})
            self._fill(model, own, eid, tokens, state, logits, path, held)
            return Opened(state, logits, origin)

    def _count_hit(self, model: Model, entry: _Entry, *, full: bool, total: int) -> None:
        self.metrics.prefix_hits.add(1, {"model": model.model_id, "scope": entry.scope.kind,
                                         "match": "full" if full else "partial"})
        self.metrics.prefix_tokens.add(total, {"model": model.model_id, "how": "stored"})

    def _declared(self, model: Model, tokens: list[int]) -> list[int] | None:
        """The longest shared prefix the operator declared for `model` that `tokens` starts with."""
        if model.model_id not in self.shared:
            return None
        key = (model.model_id, model.revision)
        declared = self._shared_tokens.get(key)
        if declared is None:
            declared = []
            for p in self.shared[model.model_id]:
                toks = model.transform.encode(p) if isinstance(p, str) and model.transform is not None else p
                if isinstance(toks, str):
                    log.warning("shared prefix of %s is text, but the model has no input transform: not served",
                                model.model_id)
                    continue
                model.check_tokens(list(toks))
                if toks:
                    declared.append(list(toks))
            self._shared_tokens[key] = declared
        best = None
        for p in declared:
            if len(p) <= len(tokens) and tokens[: len(p)] == p and (best is None or len(p) > len(best)):
                best = p
        return best

    def _shared_entry(self, model: Model, tokens: list[int], compute: Compute, on_wait: Callable[[], Any]
                      ) -> tuple[tuple[_Entry, State, torch.Tensor | None] | None, bool]:
        """A declared shared prefix's entry, computed and stored first if it is not yet (then
        also True: it was computed here)."""
        scope = self.scope(None)
        eid = self.entry_id(model, scope, tokens)
        with self._once(scope, eid, on_wait) as held:
            got = self._from_ram(eid) or self._load(model, self._index(scope).get(eid))
            if got is not None:
                return got, False
            state, logits, path = compute(model.initial_state(), tokens)
            self.metrics.prefix_tokens.add(len(tokens), {"model": model.model_id, "how": "computed"})
            entry = self._fill(model, scope, eid, tokens, state, logits, path, held)
            return (None if entry is None else (entry, state, logits)), True

    @contextmanager
    def _once(self, scope: Scope, eid: str, on_wait: Callable[[], Any]) -> Iterator[_Held]:
        """One caller at a time per entry in the deployment: on this worker (a lock), then across
        workers (`_lease`, yielded: its fence guards the caller's writes). The others wait
        (calling `on_wait`, an activity's safe point and heartbeat), then find what the first one
        stored."""
        with self._guard:
            flight = self._flights.setdefault(eid, [threading.Lock(), 0])
            flight[1] += 1
        try:
            while not flight[0].acquire(timeout=0.2):
                on_wait()
            try:
                with self._lease(scope, eid, on_wait) as held:
                    yield held
            finally:
                flight[0].release()
        finally:
            with self._guard:
                flight[1] -= 1
                if flight[1] == 0:
                    del self._flights[eid]

    @contextmanager
    def _lease(self, scope: Scope, eid: str, on_wait: Callable[[], Any]) -> Iterator[_Held]:
        """The entry's fill lease in the store (first writer wins, a generation of its own): held,
        renewed by a thread of its own, until the block ends. Held by another worker, it is
        waited for until it is gone (that worker stored the entry, or gave up) or stale (that
        worker died, or stalled: taken over by a compare-and-set, so of two takers one wins).
        Every change of a lease record is a compare-and-set: a renewal or release that finds the
        record changed (taken over) changes nothing, and the lease is `lost`."""
        kind, generation = scope.lease_kind, uuid.uuid4().hex
        while True:
            mine = _lease_record(generation, self.clock(), self._me)
            if self.store.swap_meta(kind=kind, name=eid, expect=None, data=mine):
                break
            current = self.store.get_meta(kind=kind, name=eid)
            if current is None:  # released meanwhile
                continue
            since = _lease_since(current)
            if since is not None and self.clock() - since < self.lease_s:
                on_wait()
                self.sleep(LEASE_POLL_S)
                continue
            if self.store.swap_meta(kind=kind, name=eid, expect=current, data=mine):
                log.warning("prefix store: a fill lease of %s was not renewed for %.0f s: taken over", eid,
                            self.lease_s)
                break
        held = _Held(kind, eid, generation, mine)
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.lease_s / 3):
                record = _lease_record(generation, self.clock(), self._me)
                try:
                    if not self.store.swap_meta(kind=kind, name=eid, expect=held.record, data=record):
                        held.lost = True  # taken over: this worker's writes will be refused
                        log.warning("prefix store: the fill lease of %s was taken over by another worker", eid)
                        return
                    held.record = record
                except StoreError as exc:  # the lease may go stale: another worker computes it too
                    log.warning("prefix store: could not renew the fill lease of %s: %s", eid, exc)

        renewer = threading.Thread(target=renew, name=f"prefix-lease-{eid[:8]}", daemon=True)
        renewer.start()
        try:
            yield held
        finally:
            stop.set()
            renewer.join()
            try:
                self.store.swap_meta(kind=kind, name=eid, expect=held.record, data=None)
            except StoreError as exc:  # it goes stale, and the next worker takes it over
                log.warning("prefix store: could not drop the fill lease of %s: %s", eid, exc)

    # --- entries -------------------------------------------------------------------------------

    def _index(self, scope: Scope) -> dict[str, _Entry]:
        out = {}
        for eid, data in self.store.read_meta(kind=scope.index_kind).items():
            try:
                out[eid] = _Entry.open(eid, scope, data, self.keyring)
            except (ValueError, KeyError, TypeError, StateRejected) as exc:
                log.warning("prefix store: unreadable index record %s/%s (%s): skipped", scope.index_kind, eid, exc)
        return out

    def _longest(self, model: Model, scope: Scope, tokens: list[int], full: str
                 ) -> tuple[_Entry, State, torch.Tensor | None] | None:
        """The longest stored prefix of `tokens` (whose own entry is `full`) in `scope`, loaded
        (None: none is stored)."""
        got = self._from_ram(full)  # the whole prefix, held in memory: nothing to read
        if got is not None:
            return got
        index = self._index(scope)
        lengths = sorted({e.tokens for e in index.values() if 0 < e.tokens <= len(tokens)}, reverse=True)
        for n in lengths:
            eid = full if n == len(tokens) else self.entry_id(model, scope, tokens[:n])
            entry = index.get(eid)
            if entry is not None and entry.tokens == n:
                got = self._load(model, entry)
                if got is not None:
                    return got
        return None

    def _from_ram(self, eid: str) -> tuple[_Entry, State, torch.Tensor | None] | None:
        with self._guard:
            hit = self._ram.get(eid)
            if hit is None:
                return None
            self._ram.move_to_end(eid)
        entry, state, logits = hit[2], hit[0], hit[1]
        self._touch(entry)
        return entry, state, logits

    def _load(self, model: Model, entry: _Entry | None) -> tuple[_Entry, State, torch.Tensor | None] | None:
        """An entry's state and logits, checked as a checkpoint is; None if it is gone (evicted
        meanwhile) or unreadable (then it is removed)."""
        if entry is None:
            return None
        got = self._from_ram(entry.id)
        if got is not None:
            return got
        r, key = entry.receipt, entry.scope.key(entry.id)
        if (r.arithmetic is None or r.arithmetic.id != model.arithmetic().id or r.stream_id != key
                or r.state_key != key or r.position != entry.tokens or r.principal != entry.scope.principal):
            # the entry id names the arithmetic, the scope and the tokens; a record that says
            # otherwise is not this entry's
            log.warning("prefix store: index record %s does not describe its entry: not served", entry.id)
            return None
        principal, owner = entry.scope.principal, entry.scope.owner
        try:
            blob = self.store.get(key=entry.key, owner=owner, legacy=principal)
            if blob is None:
                return None
            state = unseal(blob, entry.receipt, self.keyring, model=model, principal=principal,
                           segments=self.segments.reader(principal, entry.key))
            out = self.store.get(key=entry.key + ".out", owner=owner, legacy=principal)
            logits = None if out is None else torch.frombuffer(bytearray(open_bytes(
                out, binding=f"{principal}|{entry.key}.out", keyring=self.keyring)), dtype=torch.float32)
        except (StateRejected, ValueError) as exc:
            log.warning("prefix store: entry %s unreadable (%s): removed", entry.id, exc)
            self._remove(entry, "unreadable")
            return None
        self._remember(entry, state, logits)
        self._touch(entry)
        return entry, state, logits

    def _remember(self, entry: _Entry, state: State, logits: torch.Tensor | None) -> None:
        size = entry.receipt.state_bytes
        if size > self.ram_bytes:
            return
        with self._guard:
            if entry.id in self._ram:
                return
            self._ram[entry.id] = (state, logits, entry)
            self._ram_used += size
            while self._ram_used > self.ram_bytes:
                _, (_, _, old) = self._ram.popitem(last=False)
                self._ram_used -= old.receipt.state_bytes

    def _forget(self, eid: str) -> None:
        with self._guard:
            hit = self._ram.pop(eid, None)
            if hit is not None:
                self._ram_used -= hit[2].receipt.state_bytes

    def _touch(self, entry: _Entry) -> None:
        """Write the entry's last use back (at most every TOUCH_S), for the LRU bound."""
        now = self.clock()
        with self._guard:
            if now - self._touched.get(entry.id, entry.used) < TOUCH_S:
                return
            self._touched[entry.id] = now
        try:
            self.store.put_meta(kind=entry.scope.index_kind, name=entry.id,
                                data=replace(entry, used=now).seal(self.keyring))
        except StoreError as exc:  # recency is advisory: a failed write costs the LRU order only
            log.warning("prefix store: could not record a use of %s: %s", entry.id, exc)

    def _fill(self, model: Model, scope: Scope, eid: str, tokens: list[int], state: State,
              logits: torch.Tensor | None, path: str, held: _Held) -> _Entry | None:
        """Seal and store `tokens`' state in `scope` (every write fenced by the fill lease `held`),
        then keep the scope within its bound. None if nothing was stored: the entry would not fit
        its scope, or the lease was lost (taken over by another worker, which stores it)."""
        if model.schema.state_bytes + 4 * model.vocab_size > self.max_bytes:
            # one entry would not fit its scope's bound: the principal's prefix_bytes quota
            self.metrics.quota_refusals.add(1, {"quota": "prefix_bytes"})
            return None
        key = scope.key(eid)
        segments, written, kv_bytes = None, None, 0
        if self.segments.segmented(model):  # a hybrid's KV segments first, shared with its streams
            segments = self.segments.split(model, state, scope.principal, None)
            written = self.segments.write(model, segments, scope.principal)
            # the rows its segments hold count against the scope's bound, as the tail does
            rows = len(segments) * (segment_rows(model.schema) or 0)
            kv_bytes = model.schema.bytes_at(rows) - model.schema.bytes_at(0)
        # sealed for the entry itself (its receipt's stream id is the key, bound into the blob): an
        # index record that names another entry's blob, even of the same scope and length, is refused
        receipt, blob = seal(model, state, stream_id=key, principal=scope.principal, chunk_seq=0,
                             epoch=0, keyring=self.keyring, state_key=key, backend=model.ran(path),
                             arithmetic=continue_arithmetic(None, model.arithmetic(path)), segments=segments)
        out = None if logits is None else seal_bytes(logits.to(torch.float32).contiguous().numpy().tobytes(),
                                                     binding=f"{scope.principal}|{key}.out", keyring=self.keyring)
        size = len(blob) + (len(out) if out is not None else 0) + kv_bytes
        now = self.clock()
        entry = _Entry(eid, scope, len(tokens), size, now, now, receipt, held.generation)
        self.store.put_meta_if_absent(kind=SCOPES_KIND, name=scope.tag, data=seal_bytes(
            json.dumps({"principal": scope.principal, "scope": scope.kind}).encode(),
            binding=_scope_binding(scope.tag), keyring=self.keyring))
        fence = held.fence
        try:
            if self.store.put_if_absent(key=key, data=blob, stream_id=scope.stream_id, owner=scope.owner,
                                        fence=fence):
                self.metrics.prefix_bytes.add(size, {"model": model.model_id, "scope": scope.kind})
            if out is not None:
                self.store.put_if_absent(key=key + ".out", data=out, stream_id=scope.stream_id, owner=scope.owner,
                                         fence=fence)
            if written is not None:
                self.segments.hold(scope.principal, scope.stream_id, key, written)
            # the index record last: an entry is served only once its blobs are there
            self.store.put_meta(kind=scope.index_kind, name=eid, data=entry.seal(self.keyring), fence=fence)
        except LeaseLost as exc:
            # another worker took the lease over (this one stalled past it) and stores the entry
            # itself; what this one wrote before is swept as an incomplete fill if no record names it
            self.metrics.prefix_leases_lost.add(1, {"model": model.model_id, "scope": scope.kind})
            log.warning("prefix store: %s: not stored by this worker (%s)", eid, exc)
            return None
        self._remember(entry, state, logits)
        self._bound(scope, keep=eid)
        return entry

    def _remove(self, entry: _Entry, why: str) -> None:
        """An entry out of the store: its index record first (no reader finds it after), then its blobs."""
        self.store.delete_meta(kind=entry.scope.index_kind, name=entry.id)
        for key in (entry.key, entry.key + ".out"):
            self._delete(entry.scope, key)
        self.segments.release(entry.scope.principal, entry.scope.stream_id, entry.key)
        self._forget(entry.id)
        self.metrics.prefix_evictions.add(1, {"why": why, "scope": entry.scope.kind})

    def _delete(self, scope: Scope, key: str) -> None:
        self.store.delete(key=key, stream_id=scope.stream_id, owner=scope.owner, legacy=scope.principal)

    def _bound(self, scope: Scope, keep: str | None = None, index: dict[str, _Entry] | None = None
               ) -> tuple[int, int, int]:
        """Remove the scope's least recently used entries until its bytes are within `max_bytes`
        (`index`: the scope's index, when the caller has just read it); (entries, bytes) left and
        how many were removed."""
        index = self._index(scope) if index is None else index
        total = sum(e.bytes for e in index.values())
        removed = 0
        for entry in sorted(index.values(), key=lambda e: (e.used, e.made, e.id)):
            if total <= self.max_bytes:
                break
            if entry.id == keep:
                continue
            self._remove(entry, "lru")
            total -= entry.bytes
            removed += 1
        return len(index) - removed, total, removed

    # --- the sweep -----------------------------------------------------------------------------

    def _scopes(self) -> Iterator[Scope]:
        """The scopes that hold entries (`SCOPES_KIND`; a record written in clear before records
        were sealed is read too), an unreadable record skipped."""
        for tag, data in self.store.read_meta(kind=SCOPES_KIND).items():
            try:
                obj = json.loads(data if _in_clear(data) else open_bytes(data, binding=_scope_binding(tag),
                                                                          keyring=self.keyring))
                yield self._scope(obj["scope"], obj["principal"], tag)
            except (ValueError, KeyError, TypeError, StateRejected) as exc:
                log.warning("prefix store: unreadable scope record %s (%s): skipped", tag, exc)

    def sweep(self, *, grace_s: float = 3600.0) -> PrefixSweep:
        """Every scope within its bound; blobs no index record names (a fill that died between its
        blob and its record) older than `grace_s` deleted, records whose blob is gone, and fill
        leases left stale by a worker that died. The store's prefix bytes go to the
        `prefix_store_bytes` gauge."""
        rep = PrefixSweep()
        now = self.clock()
        for scope in self._scopes():
            rep.scopes += 1
            index = self._index(scope)
            named = {k for e in index.values() for k in (e.key, e.key + ".out")}
            stored = set(self.store.list_stream(stream_id=scope.stream_id))
            for entry in [e for e in index.values() if e.key not in stored]:
                self.store.delete_meta(kind=scope.index_kind, name=entry.id)
                self._forget(entry.id)
                del index[entry.id]
            seen_kind = f"prefix-seen.{scope.tag}"
            seen = self.store.read_meta(kind=seen_kind)
            loose = {key.removesuffix(".out") for key in stored - named}
            for base in sorted(loose):
                name = base.rsplit(".", 1)[-1]
                since = _since(seen.get(name))
                if since is None:  # first seen unindexed now: a fill may still be on its way
                    self.store.put_meta_if_absent(kind=seen_kind, name=name, data=since_record(now))
                    continue
                if now - since < grace_s:
                    continue
                for key in (base, base + ".out"):
                    self._delete(scope, key)
                self.segments.release(scope.principal, scope.stream_id, base)
                self.store.delete_meta(kind=seen_kind, name=name)
                rep.incomplete += 1
                self.metrics.prefix_evictions.add(1, {"why": "incomplete", "scope": scope.kind})
            for name in set(seen) - {b.rsplit(".", 1)[-1] for b in loose}:  # indexed or gone since
                self.store.delete_meta(kind=seen_kind, name=name)
            for eid, data in self.store.read_meta(kind=scope.lease_kind).items():
                since = _lease_since(data)
                if since is None or now - since >= self.lease_s:  # its worker died mid-fill
                    # only the record read: a worker that took the lease over since keeps it
                    self.store.swap_meta(kind=scope.lease_kind, name=eid, expect=data, data=None)
            entries, size, removed = self._bound(scope, index=index)
            rep.entries += entries
            rep.bytes += size
            rep.evicted += removed
        self.metrics.prefix_store_bytes.set(rep.bytes)
        return rep

    def rekey(self) -> int:
        """Seal the scope and index records written in clear before records were sealed; how many.
        Each is rewritten only if it is still what was read (a compare-and-set), so a fill or a
        use recorded meanwhile is not undone."""
        n = 0
        for tag, data in self.store.read_meta(kind=SCOPES_KIND).items():
            if _in_clear(data):
                sealed = seal_bytes(bytes(data), binding=_scope_binding(tag), keyring=self.keyring)
                n += self.store.swap_meta(kind=SCOPES_KIND, name=tag, expect=data, data=sealed)
        for scope in self._scopes():
            for eid, data in self.store.read_meta(kind=scope.index_kind).items():
                if not _in_clear(data):
                    continue
                try:
                    entry = _Entry.open(eid, scope, data, self.keyring)
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("prefix store: unreadable index record %s/%s (%s): left", scope.index_kind, eid, exc)
                    continue
                n += self.store.swap_meta(kind=scope.index_kind, name=eid, expect=data, data=entry.seal(self.keyring))
        return n

    def usage(self) -> PrefixSweep:
        """Scopes, entries and bytes held (read from the index; nothing changed)."""
        rep = PrefixSweep()
        for scope in self._scopes():
            index = self._index(scope)
            rep.scopes += 1
            rep.entries += len(index)
            rep.bytes += sum(e.bytes for e in index.values())
        return rep



def _tokens_hash(tokens: Sequence[int]) -> str:
    """An unkeyed digest of token ids, only ever hashed again under a key (`PrefixStore.entry_id`):
    the digest receipts once carried, so entries stored before digests were keyed keep their ids."""
    return "sha256:" + hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()


def _since(data: bytes | None) -> float | None:
    """A sighting's time; None for none, or an unreadable one (recorded anew)."""
    try:
        return since_of(data)
    except StoreCorrupt:
        return None
