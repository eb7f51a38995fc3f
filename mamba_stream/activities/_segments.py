"""KV segments in the store: written before the checkpoint that names them, shared, swept by reference.

A hybrid stream's checkpoint names its KV segments (`state_codec.codec`: rows jR..(j+1)R-1 of
every attention tensor, sealed once). Here they meet the store:

- **Where.** An owner's segments live under a stream id of their own, `seg.<owner tag>` (no
  stream may take one, and the orphan sweep never takes one for a stream), keyed by
  `segment_key`: two streams of one principal with the same rows (forks, rewinds, prefix states,
  resumes) share one object; another principal's never do.
- **References.** Beside them, each checkpoint that names segments has a small sealed *refs*
  object (`r-<HMAC of its stream and key>`): which checkpoint (stream id, key) names which
  segments. A refs object is live while its checkpoint is in the store.
- **Commit order.** Each segment the state has that the state it continues did not (`split`):
  its sighting cleared, then put-if-absent; then the checkpoint; then the refs object (its
  sighting cleared, then put). A commit slower than half the grace clears and puts its new
  segments again once its refs object is written (`hold`).
- **Deletion.** `sweep` reads the sightings, then lists each owner's refs and segments. A refs
  object whose checkpoint is gone (a dropped or revoked checkpoint whose refs delete did not run,
  a stream cancelled or swept whole) and a segment no live refs names are *sighted* (a metadata
  record: a random token, then the time); one that was already sighted `grace_s` before, and is
  still unreferenced, is deleted under a fence on that sighting (`StateStore.delete(fence=)`),
  atomically with the check. A commit clears a segment's sighting (compare-and-set) before it
  relies on the segment, so the fence fails for a segment a commit has taken since the sweep
  looked; a segment deleted just before the clearing is written again by the put that follows it.
  Whatever a crash leaves (segments without a checkpoint, a checkpoint without refs for the
  moment, refs without a checkpoint), the next attempt finishes it or two sweeps remove it.

Drops, cancel and revocation delete checkpoints (and their refs) at once; the segments no other
checkpoint names follow at the next two sweeps.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack

from mamba_stream.activities._store import Fence, StateStore, StoreCorrupt
from mamba_stream.scan import Model, State
from mamba_stream.state_codec import StateRejected
from mamba_stream.state_codec.codec import (
    Keyring,
    Segment,
    SegmentFetch,
    SegmentRef,
    open_bytes,
    seal_bytes,
    seal_segment,
    segment_key,
    segment_rows,
    split_state,
)

__all__ = ["SEGMENT_STREAM_PREFIX", "KVSegments", "SegmentSweep", "is_segment_stream"]

log = logging.getLogger(__name__)

#: the stream ids of an owner's segments and refs objects start with this
SEGMENT_STREAM_PREFIX = "seg."
#: the metadata kind of the sweep's sightings (name: the object's key)
SEEN_KIND = "kv-seen"
_REFS_PREFIX = "r-"
_REFS_LABEL = "mamba-stream/kv-refs-key/v1"
#: checkpoints whose segment digests are kept in memory (a commit continuing one hashes only new rows)
_KNOWN_ENTRIES = 1024


def is_segment_stream(stream_id: str) -> bool:
    """Whether `stream_id` is an owner's segment namespace (no stream may take such an id)."""
    return stream_id.startswith(SEGMENT_STREAM_PREFIX)


@dataclass
class SegmentSweep:
    """What a sweep of the KV segments did."""

    owners: int = 0
    segments: int = 0  # segments in the store, before the sweep
    live: int = 0  # of those, named by a live refs object
    refs: int = 0  # refs objects in the store
    orphan_refs: int = 0  # refs objects whose checkpoint is gone
    sighted: int = 0  # unreferenced objects seen for the first time
    deleted: int = 0  # objects deleted (segments and refs)
    unreadable: list[str] = field(default_factory=list)  # refs objects that did not open: their owner is left alone


@dataclass(frozen=True)
class Written:
    """The segments a commit wrote (or found) for a state: all of them, in order, and the new
    ones' keys and sealed blobs (those the state it continues did not have)."""

    refs: tuple[SegmentRef, ...]
    new: tuple[tuple[str, bytes], ...]
    started: float
    bytes: int


class KVSegments:
    """The store half of KV segments: writing, holding, reading, releasing and sweeping them.

    Args:
        store, keyring: where segments go, and the keys that seal and name them.
        grace_s: the sweep's grace as the workers run it (lowered to the shortest one this keeper
            sweeps with): a commit that took longer than half of it re-asserts its new segments
            after its refs object is written.
    """

    def __init__(self, store: StateStore, keyring: Keyring, *, grace_s: float = 3600.0) -> None:
        self.store = store
        self.keyring = keyring
        self.grace_s = grace_s
        self._refs_secret = keyring.subkey(_REFS_LABEL)
        self._known: OrderedDict[str, tuple[bytes, ...]] = OrderedDict()
        self._lock = threading.Lock()

    # --- names ---------------------------------------------------------------------------------

    def owner(self, principal: str) -> str:
        return self.keyring.principal_tag(principal)

    def namespace(self, principal: str) -> str:
        """The stream id of `principal`'s segments and refs objects."""
        return SEGMENT_STREAM_PREFIX + self.owner(principal)

    def refs_key(self, stream_id: str, state_key: str) -> str:
        """The key of the refs object of checkpoint `state_key` of `stream_id`."""
        return _REFS_PREFIX + hmac.new(self._refs_secret, f"{stream_id}|{state_key}".encode(),
                                       hashlib.sha256).hexdigest()[:40]

    # --- digests known per checkpoint --------------------------------------------------------------

    def known(self, state_key: str | None) -> tuple[bytes, ...]:
        """The segment digests of checkpoint `state_key`, if this worker has seen them."""
        if state_key is None:
            return ()
        with self._lock:
            got = self._known.get(state_key)
            if got is not None:
                self._known.move_to_end(state_key)
            return got or ()

    def remember(self, state_key: str, refs: Sequence[SegmentRef]) -> None:
        with self._lock:
            self._known[state_key] = tuple(r.digest for r in refs)
            self._known.move_to_end(state_key)
            while len(self._known) > _KNOWN_ENTRIES:
                self._known.popitem(last=False)

    # --- writing ---------------------------------------------------------------------------------

    @staticmethod
    def segmented(model: Model) -> bool:
        return segment_rows(model.schema) is not None

    def split(self, model: Model, state: State, principal: str, continues: str | None) -> list[Segment]:
        """The segments of `state`; those of the checkpoint `continues` (the state it continues, when
        this worker knows its digests) are not hashed again and count as already held."""
        known = self.known(continues)[: state.position // (segment_rows(model.schema) or 1)]
        return split_state(model.schema, state.tensors, state.position, known)[1]

    def write(self, model: Model, segments: Sequence[Segment], principal: str) -> Written:
        """Put the segments that are new to this commit (those with plaintext), each after its
        sighting is cleared; returns every segment's reference."""
        owner, fp, ns = self.owner(principal), model.schema.fingerprint(), self.namespace(principal)
        refs, new, nbytes = [], [], 0
        started = time.monotonic()
        for seg in segments:
            key = segment_key(self.keyring, owner, fp, seg.first, seg.digest)
            refs.append(SegmentRef(seg.first, seg.digest, key))
            if seg.pieces is None:
                continue
            blob = seal_segment(seg, key, self.keyring)
            self._claim(key)
            if self.store.put_if_absent(key=key, data=blob, stream_id=ns, owner=owner):
                nbytes += len(blob)
            new.append((key, blob))
        return Written(tuple(refs), tuple(new), started, nbytes)

    def hold(self, principal: str, stream_id: str, state_key: str, written: Written) -> None:
        """After checkpoint `state_key` of `stream_id` is in the store: its refs object, written
        (its sighting cleared first); then, for a commit slower than half the grace, its new
        segments claimed and put again."""
        self.remember(state_key, written.refs)
        if not written.refs:
            return
        owner, ns = self.owner(principal), self.namespace(principal)
        key = self.refs_key(stream_id, state_key)
        body = msgpack.packb({"stream_id": stream_id, "state_key": state_key,
                              "segments": [r.key for r in written.refs]})
        self._claim(key)
        self.store.put_if_absent(key=key, stream_id=ns, owner=owner,
                                 data=seal_bytes(body, binding=self._binding(owner, key), keyring=self.keyring))
        if time.monotonic() - written.started >= self.grace_s / 2:
            log.warning("a commit of %s took %.1f s, half the segments' grace or more: its %d new segments are "
                        "claimed again", stream_id, time.monotonic() - written.started, len(written.new))
            for seg_key, blob in written.new:
                self._claim(seg_key)
                self.store.put_if_absent(key=seg_key, data=blob, stream_id=ns, owner=owner)

    def release(self, principal: str, stream_id: str, state_key: str) -> None:
        """Checkpoint `state_key` of `stream_id` was deleted: its refs object goes too (its
        segments, where nothing else names them, at the next sweeps)."""
        self.store.delete(key=self.refs_key(stream_id, state_key), stream_id=self.namespace(principal),
                          owner=self.owner(principal))

    def _claim(self, key: str) -> None:
        """Clear a sweep's sighting of `key` (compare-and-set), so that its fenced delete fails."""
        seen = self.store.get_meta(kind=SEEN_KIND, name=key)
        if seen is not None:
            self.store.swap_meta(kind=SEEN_KIND, name=key, expect=seen, data=None)

    @staticmethod
    def _binding(owner: str, key: str) -> str:
        return f"kv-refs|{owner}|{key}"

    # --- reading ---------------------------------------------------------------------------------

    def reader(self, principal: str, state_key: str | None = None) -> SegmentFetch:
        """Reads `principal`'s segments for `state_codec.codec.open_state`; with `state_key`, the
        digests it was asked for (from the authenticated checkpoint) are remembered as that
        checkpoint's."""
        owner = self.owner(principal)
        asked: list[SegmentRef] = []

        def fetch(ref: SegmentRef) -> bytes | None:
            if state_key is not None:
                asked.append(ref)
                self.remember(state_key, asked)
            return self.store.get(key=ref.key, owner=owner)

        return fetch

    # --- sweeping --------------------------------------------------------------------------------

    def sweep(self, *, grace_s: float | None = None, exists: Callable[[str, str], bool] | None = None) -> SegmentSweep:
        """Delete the refs objects whose checkpoint is gone and the segments no live refs object
        names, each once a sighting of it is `grace_s` old (default: this keeper's grace).
        `exists(stream_id, key)`: whether a checkpoint is in the store (default: the store's listing)."""
        grace = self.grace_s if grace_s is None else grace_s
        # this worker's commits re-assert their segments after half of the shortest grace it sweeps
        # with (workers that share a store sweep with one grace: MAMBA_STREAM_ORPHAN_GRACE_S)
        self.grace_s = min(self.grace_s, grace)
        report = SegmentSweep()
        now = time.time()
        seen = self.store.read_meta(kind=SEEN_KIND)  # before the listings: see the module docstring
        listings: dict[str, set[str]] = {}

        def in_store(stream_id: str, key: str) -> bool:
            if exists is not None:
                return exists(stream_id, key)
            if stream_id not in listings:
                listings[stream_id] = set(self.store.list_stream(stream_id=stream_id))
            return key in listings[stream_id]

        present: set[str] = set()
        for ns in self.store.stream_ids():
            if not is_segment_stream(ns):
                continue
            report.owners += 1
            owner = ns[len(SEGMENT_STREAM_PREFIX):]
            keys = self.store.list_stream(stream_id=ns)
            present.update(keys)
            live: set[str] = set()
            unreferenced: list[str] = []
            readable = True
            for key in keys:
                if not key.startswith(_REFS_PREFIX):
                    continue
                report.refs += 1
                blob = self.store.get(key=key, owner=owner)
                if blob is None:
                    continue  # deleted since the listing
                try:
                    body = msgpack.unpackb(open_bytes(blob, binding=self._binding(owner, key), keyring=self.keyring),
                                           raw=False)
                    stream_id, state_key, names = body["stream_id"], body["state_key"], list(body["segments"])
                except (StateRejected, KeyError, TypeError, ValueError) as exc:
                    log.error("KV segments of owner %s: refs object %s does not open (%s); none of the owner's "
                              "segments is deleted", owner, key, exc)
                    report.unreadable.append(key)
                    readable = False
                    continue
                if in_store(stream_id, state_key):
                    live.update(names)
                else:
                    report.orphan_refs += 1
                    unreferenced.append(key)
            for key in keys:
                if key.startswith(_REFS_PREFIX):
                    continue
                report.segments += 1
                if key in live:
                    report.live += 1
                elif readable:
                    unreferenced.append(key)
            for key in keys:  # taken again: a later absence starts afresh
                if key in seen and key not in unreferenced and (key in live or key.startswith(_REFS_PREFIX)):
                    self.store.swap_meta(kind=SEEN_KIND, name=key, expect=seen[key], data=None)
            for key in unreferenced:
                record = seen.get(key)
                if record is None:
                    if self.store.put_meta_if_absent(kind=SEEN_KIND, name=key, data=_sighting(now)):
                        report.sighted += 1
                    continue
                since = _since(record)
                if now - since < grace:
                    continue
                token = record.split(b" ", 1)[0]
                if self.store.delete(key=key, stream_id=ns, owner=owner, fence=Fence(SEEN_KIND, key, token + b" ")):
                    report.deleted += 1
                self.store.swap_meta(kind=SEEN_KIND, name=key, expect=record, data=None)
        for key, record in seen.items():  # sightings of objects gone since (deleted, or their owner's cancelled)
            if key not in present:
                self.store.swap_meta(kind=SEEN_KIND, name=key, expect=record, data=None)
        if report.deleted or report.sighted:
            log.info("KV segments swept: %s", report)
        return report


def _sighting(now: float) -> bytes:
    """A sighting record: a random token (the fence of the delete that may follow), then the time."""
    return os.urandom(8).hex().encode() + b" " + repr(now).encode()


def _since(record: bytes) -> float:
    try:
        return float(record.split(b" ", 1)[1])
    except (IndexError, ValueError):
        raise StoreCorrupt(f"unreadable sighting record {record[:40]!r}") from None
