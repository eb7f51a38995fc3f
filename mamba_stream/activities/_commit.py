"""The commit protocol of a chunk, shared by advance and generate: a chunk is never applied twice.

A chunk's new state is committed under a key derived from (input state key, chunk digest, chunk
sequence), so every attempt of the same chunk derives the same key:

    1. prior(key)      an earlier attempt recorded a result under `<key>.out`: return it, done
    2. (compute)       the caller advances the state
    3. seal + put      a hybrid's new KV segments first (`KVSegments`), then the state sealed for
                       (principal, stream), stored put-if-absent; when an earlier attempt already
                       wrote the key, its bytes are adopted (what it wrote is what a reader of that
                       key will see), the receipt's checksum with them; then the checkpoint's
                       refs object, which keeps its segments from the sweep
    4. record          a small sealed record of the result under `<key>.out`, put-if-absent
    5. drops           older checkpoints that left the retention window, deleted

The edges between these steps are seams for the crash tests (`edge(name, stream_id, chunk_seq)`):

    admitted -> (kernel) -> computed -> (segments) -> segments-written -> (write) -> written
             -> (record) -> recorded

A crash at any edge leaves the store in a state the next attempt finishes from: before `written`
nothing of this chunk is visible (segments written without their checkpoint are found again by
the retry, which derives the same keys, or swept); between `written` and `recorded` the
checkpoint exists and the retry recomputes the same key, adopts the stored bytes (its segments
read back and checked) and writes the record; after `recorded` the retry returns the record (and
redoes the drops).

No Temporal, no engine: the caller passes what to do with the committed state. Tested against an
in-memory store (tests/activities/test_commit.py) and through `ActivityEnvironment`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from mamba_stream.activities._metrics import StreamMetrics
from mamba_stream.activities._segments import KVSegments
from mamba_stream.activities._store import StateStore
from mamba_stream.scan import Model, State
from mamba_stream.state_codec import (
    CheckpointNotFound,
    Origin,
    Receipt,
    SegmentMissing,
    arithmetic_moved,
    continue_arithmetic,
    format_state_key,
    parse_state_key,
    record_key,
)
from mamba_stream.state_codec.codec import Keyring, open_bytes, open_state, seal, seal_bytes, unseal
from mamba_stream.workflows import RewindPastWindow

__all__ = ["ChunkCommit", "Committed", "Completed", "Prior"]

log = logging.getLogger(__name__)

#: what keys a state key's digest (`Keyring.subkey`)
_KEY_LABEL = "mamba-stream/state-key/v1"


@dataclass(frozen=True)
class Prior:
    """The recorded result of an earlier attempt (JSON) and its next-token logits."""

    result: dict[str, Any]
    logits: torch.Tensor | None


@dataclass(frozen=True)
class Committed:
    """A committed state: its receipt, the state as stored (ours, or the earlier attempt's that
    was adopted), and whether it was adopted."""

    receipt: Receipt
    state: State
    adopted: bool


@dataclass(frozen=True)
class Completed:
    """A computed chunk, committed: what was stored, and the result recorded for it."""

    committed: Committed
    result: Any


def _no_edge(name: str, stream_id: str, chunk_seq: int) -> None:
    return None


class ChunkCommit:
    """The store half of a stream's chunks: derived keys, seal, put-if-absent, adoption, result
    records and drops.

    Args:
        store, keyring: where sealed states and records go, and the keys that seal them.
        metrics: commits, arithmetic changes and commit times are counted here.
        edge: called at each commit edge (see the module docstring); tests crash there.
    """

    def __init__(self, store: StateStore, keyring: Keyring, metrics: StreamMetrics | None = None,
                 edge: Callable[[str, str, int], None] = _no_edge) -> None:
        self.store = store
        self.keyring = keyring
        self.metrics = metrics or StreamMetrics()
        self.edge = edge
        self._key_secret = keyring.subkey(_KEY_LABEL)
        self.segments = KVSegments(store, keyring)

    # --- keys ----------------------------------------------------------------------------------

    def owner(self, principal: str) -> str:
        """Who owns `principal`'s objects in the store: its keyed tag, never its name."""
        return self.keyring.principal_tag(principal)

    def state_key(self, stream_id: str, epoch: int, chunk_seq: int, what: str) -> str:
        """The key of the state `what` describes (its input and chunk, or "open|..."/"reset|..."):
        deterministic, so every attempt derives the same key and put-if-absent makes it exactly
        once; keyed (HMAC under a workers' key), so the key says nothing of the content, and no
        one without the keyring can name another stream's checkpoint."""
        digest = hmac.new(self._key_secret, f"{stream_id}|{epoch}|{chunk_seq}|{what}".encode(),
                          hashlib.sha256).hexdigest()[:32]
        return format_state_key(stream_id, epoch, chunk_seq, digest)

    def chunk_key(self, stream_id: str, receipt: Receipt, chunk_seq: int, chunk_digest: str) -> str:
        """The key of a chunk's new state, from its input state and its content: another chunk
        (other content, another input state) derives another."""
        return self.state_key(stream_id, receipt.epoch, chunk_seq, f"{receipt.state_key}|{chunk_digest}")

    # --- records -------------------------------------------------------------------------------

    def write_record(self, receipt: Receipt, result: dict[str, Any], last_logits: torch.Tensor | None) -> None:
        key = record_key(receipt.state_key)
        payload = msgpack.packb({
            "result": json.dumps(result),
            "logits": b"" if last_logits is None else last_logits.to(torch.float32).contiguous().numpy().tobytes(),
            "committed_at": self.metrics.committed_at(receipt.state_key) or time.time(),
        })
        blob = seal_bytes(payload, binding=f"{receipt.principal}|{key}", keyring=self.keyring)
        self.store.put_if_absent(key=key, data=blob, stream_id=receipt.stream_id, owner=self.owner(receipt.principal))

    def prior(self, state_key: str, principal: str) -> Prior | None:
        """The result recorded for the chunk that committed `state_key`, if one was."""
        key = record_key(state_key)
        blob = self.store.get(key=key, owner=self.owner(principal), legacy=principal)
        if blob is None:
            return None
        data = msgpack.unpackb(open_bytes(blob, binding=f"{principal}|{key}", keyring=self.keyring), raw=False)
        logits = torch.frombuffer(bytearray(data["logits"]), dtype=torch.float32) if data["logits"] else None
        if data.get("committed_at") is not None:
            self.metrics.note_commit(state_key, float(data["committed_at"]))
        return Prior(json.loads(data["result"]), logits)

    # --- states --------------------------------------------------------------------------------

    def fetch(self, model: Model, receipt: Receipt, principal: str) -> tuple[State, torch.Tensor | None, int]:
        """A committed state, its next-token logits (if recorded) and its blob's size, fully checked."""
        blob = self.store.get(key=receipt.state_key, owner=self.owner(principal), legacy=principal)
        if blob is None:
            raise CheckpointNotFound(f"no checkpoint {receipt.state_key} for this principal in {self.store.url}",
                                     field="state_key", expected=receipt.state_key, actual=None)
        state = unseal(blob, receipt, self.keyring, model=model, principal=principal,
                       segments=self.segments.reader(principal, receipt.state_key))
        rec = self.prior(receipt.state_key, principal)
        return state, rec.logits if rec else None, len(blob)

    def fetch_current(self, model: Model, receipt: Receipt, principal: str) -> tuple[State, torch.Tensor | None, int]:
        """`fetch` for the stream's own current receipt: a checkpoint that is gone while later
        chunks of the stream are still stored means the stream was rewound (a Temporal reset)
        further back than its window of kept checkpoints: `RewindPastWindow`, not a lost blob."""
        try:
            return self.fetch(model, receipt, principal)
        except CheckpointNotFound:
            later = self.later_chunks(receipt)
            if later:
                raise RewindPastWindow(
                    f"the stream was rewound to chunk {receipt.chunk_seq}, whose checkpoint left the window of kept "
                    f"checkpoints (chunks up to {max(later)[1]} are stored); send a reset to start a fresh epoch",
                    chunk_seq=receipt.chunk_seq, epoch=receipt.epoch, latest_stored=max(later)[1]) from None
            raise

    def _checkpoints(self, stream_id: str) -> list[tuple[str, int, int]]:
        """(key, epoch, chunk_seq) of every checkpoint the store holds for the stream: open, reset
        and chunk states alike."""
        out = []
        for key in self.store.list_stream(stream_id=stream_id):
            parsed = parse_state_key(key)
            if parsed is not None and parsed.stream_id == stream_id:
                out.append((key, parsed.epoch, parsed.chunk_seq))
        return out

    def later_chunks(self, receipt: Receipt) -> list[tuple[int, int]]:
        """(epoch, chunk_seq) of the stream's stored checkpoints that come after `receipt`'s."""
        return [(e, c) for _, e, c in self._checkpoints(receipt.stream_id)
                if (e, c) > (receipt.epoch, receipt.chunk_seq)]

    def revoke_before(self, stream_id: str, principal: str, epoch: int, model: Model | None = None) -> int:
        """Delete every stored checkpoint and result record of the stream from an epoch before
        `epoch`: open, reset, chunk and pinned ones alike, and a record whose checkpoint is already
        gone (a drop interrupted between the two deletes); how many checkpoints."""
        old = [key for key, e, _ in self._checkpoints(stream_id) if e < epoch]
        self.drop(old, stream_id=stream_id, principal=principal, model=model)
        for key in self.store.list_stream(stream_id=stream_id):
            parsed = parse_state_key(key, records=True)
            if parsed is not None and parsed.stream_id == stream_id and parsed.epoch < epoch:
                self.store.delete(key=key, stream_id=stream_id, owner=self.owner(principal), legacy=principal)
        return len(old)

    def commit(self, model: Model, state: State, *, stream_id: str, principal: str, chunk_seq: int, epoch: int,
               key: str, backend: str, before: Receipt | None, path: str | None = None,
               origin: Origin | None = None) -> Committed:
        """Seal `state` and store it put-if-absent under `key`; if an earlier attempt committed
        this key, adopt its bytes (and say so when its arithmetic gave other bits).

        `before`: the receipt whose state this one continues (None: a state of its own, the
        initial one); `path`: the path that computed it; `origin`: where the epoch's first state
        came from (its receipt and every later one of the epoch name it).
        """
        arithmetic = continue_arithmetic(before, model.arithmetic(path))
        segments, written = None, None
        if self.segments.segmented(model):
            segments = self.segments.split(model, state, principal, before.state_key if before else None)
            written = self.segments.write(model, segments, principal)
            self.edge("segments-written", stream_id, chunk_seq)
        receipt, blob = seal(model, state, stream_id=stream_id, principal=principal, chunk_seq=chunk_seq,
                             epoch=epoch, keyring=self.keyring, state_key=key, backend=backend, arithmetic=arithmetic,
                             origin=origin, segments=segments)
        adopted = False
        if self.store.put_if_absent(key=key, data=blob, stream_id=stream_id, owner=self.owner(principal)):
            self.metrics.committed(key, len(blob) + (written.bytes if written else 0), model.model_id)
        else:
            existing = self.store.get(key=key, owner=self.owner(principal), legacy=principal)
            opened = None
            if existing is not None:
                try:
                    opened = open_state(existing, receipt, self.keyring, segments=self.segments.reader(principal))
                except SegmentMissing:
                    # an earlier attempt died between its checkpoint and its refs object, long enough
                    # ago that its segments were swept: no result was recorded for it (the record comes
                    # after the refs), so nothing has seen it; ours takes its place
                    log.warning("stream %s chunk %d: an earlier attempt's checkpoint lost its KV segments; "
                                "replaced by this attempt's", stream_id, chunk_seq)
                    self.store.delete(key=key, stream_id=stream_id, owner=self.owner(principal))
            if opened is not None:
                tensors, checksum = opened.tensors, opened.checksum
                if checksum != receipt.checksum and state.position > 0:
                    # another attempt's arithmetic made these bits: ours only computes from here on
                    log.warning("stream %s chunk %d: adopted an earlier attempt's state with other bits",
                                stream_id, chunk_seq)
                    arithmetic = {**arithmetic, "arithmetic_since": state.position,
                                  "arithmetic_changes": (before.arithmetic_changes if before else 0) + 1}
                receipt = receipt.model_copy(update={"checksum": checksum, **arithmetic})
                state = State(state.position, tensors, model.schema.fingerprint())
                adopted = True
                if written is not None and opened.segments != written.refs:
                    # its segments are other bits than ours (they were just read whole): claimed from
                    # a sweep's sightings and put back where one was deleted since, as new ones are
                    written = self.segments.write(model, self.segments.split(model, state, principal, None), principal)
            elif self.store.put_if_absent(key=key, data=blob, stream_id=stream_id, owner=self.owner(principal)):
                # deleted between the two calls: ours is as good
                self.metrics.committed(key, len(blob) + (written.bytes if written else 0), model.model_id)
        if written is not None:
            self.segments.hold(principal, stream_id, key, written)
        if arithmetic_moved(before, receipt):
            self.metrics.arithmetic_changes.add(1, {"model": model.model_id, "backend": model.backend})
            log.info("stream %s continues at position %d under another arithmetic: %s", stream_id,
                     receipt.arithmetic_since, receipt.arithmetic.id if receipt.arithmetic else None)
        return Committed(receipt, state, adopted)

    def complete(self, model: Model, state: State, *, stream_id: str, principal: str, before: Receipt,
                 chunk_seq: int, key: str, path: str, last: torch.Tensor | None,
                 make_result: Callable[[Receipt], Any], drop_keys: list[str]) -> Completed:
        """Steps 3-5 of a computed chunk: checkpoint, then result record, then drops. Returns what
        was committed and `make_result(receipt)` (a pydantic model, recorded as JSON); the caller
        brings its cache in line with `committed` (the state stored may be an earlier attempt's)."""
        self.edge("computed", stream_id, chunk_seq)
        done = self.commit(model, state, stream_id=stream_id, principal=principal, chunk_seq=chunk_seq,
                           epoch=before.epoch, key=key, backend=model.ran(path), before=before, path=path,
                           origin=before.origin)
        result = make_result(done.receipt)
        self.edge("written", stream_id, chunk_seq)
        self.write_record(done.receipt, result.model_dump(mode="json"), last)
        self.edge("recorded", stream_id, chunk_seq)
        self.drop(drop_keys, stream_id=stream_id, principal=principal, model=model)
        return Completed(done, result)

    def drop(self, keys: list[str], *, stream_id: str, principal: str, model: Model | None = None) -> None:
        """Delete checkpoints (and their records, and a hybrid's refs objects: `model` None, a model
        not known, counts as one) of the stream that left the retention window. Only the stream's
        own: a key that names another stream is skipped, and the store deletes nothing of another
        stream or principal whatever the key says."""
        refs = model is None or self.segments.segmented(model)
        for k in keys:
            parsed = parse_state_key(k)
            if parsed is None or parsed.stream_id != stream_id:
                log.warning("stream %s: not dropping %r, which is not one of its checkpoints", stream_id, k)
                continue
            self.store.delete(key=k, stream_id=stream_id, owner=self.owner(principal), legacy=principal)
            self.store.delete(key=record_key(k), stream_id=stream_id, owner=self.owner(principal), legacy=principal)
            if refs:  # after the checkpoint: a refs object never outlives nothing but a crash
                self.segments.release(principal, stream_id, k)
