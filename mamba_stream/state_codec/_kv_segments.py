"""KV segments: a hybrid stream's attention rows, cut at fixed positions and sealed once.

A state whose schema has growing tensors (an attention layer's k and v, `TensorSpec.rows`
"position") and `HybridLayers.kv_segment_rows` R is stored in two parts:

- **segments**: rows jR..(j+1)R-1 of every growing tensor (schema order), for each block j that
  the position has filled. A segment's plaintext is those rows' raw bytes, tensor after tensor;
  its digest is BLAKE3 of a label, the schema fingerprint, its first position and the plaintext
  (`segment_digest`). The cuts are at positions, not at chunk boundaries, so the same tokens give
  the same segments whatever the chunking, the batching, a rewind or a fork. A segment is sealed
  on its own (`seal_segment`), stored under a key keyed by the workers' key over the owner's tag,
  the fingerprint, the first position and the digest (`segment_key`): the same rows of two
  streams of one owner share it, another owner's never do, and a reader of the store cannot test
  a guess of the rows against the key.
- **the checkpoint**: the fixed tensors, the growing tensors' tail (rows nR..P-1, n = P // R), and
  in its plaintext header the n segment digests in order. Its BLAKE3 (the receipt's checksum) so
  covers every row: the segments through their digests. Its bytes are the Mamba states plus at
  most R - 1 rows: flat in the position.

Sealing, opening and joining segments is the codec's (`state_codec.codec`); the store is the
caller's (a segment is read through a `SegmentFetch`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import blake3
import torch

from mamba_stream.state_codec._schema import StateSchema, TensorSpec
from mamba_stream.state_codec.keyring import Keyring

__all__ = [
    "SEGMENT_KEY_PREFIX",
    "Segment",
    "SegmentFetch",
    "SegmentRef",
    "growing_specs",
    "segment_digest",
    "segment_key",
    "segment_rows",
    "split_state",
]

#: what a segment's digest starts with (then the fingerprint, `|`, its first position as u64 LE)
_DIGEST_LABEL = b"mamba-stream/kv-segment/v1|"
#: what keys a segment's store key (`Keyring.subkey`)
_KEY_LABEL = "mamba-stream/kv-segment-key/v1"
#: store keys of segments start with this
SEGMENT_KEY_PREFIX = "s-"


@dataclass(frozen=True)
class SegmentRef:
    """A segment as a checkpoint names it: its first position, its digest, and its store key."""

    first: int
    digest: bytes
    key: str


@dataclass(frozen=True)
class Segment:
    """A segment of a state being sealed: what a checkpoint names, and its plaintext where this
    writer has it at hand (`pieces`, views of the state's rows; None: a segment the caller already
    knows is stored, named by its digest only)."""

    first: int
    digest: bytes
    pieces: tuple[memoryview, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.pieces) if self.pieces is not None else 0


#: reads a segment's sealed blob from the store (None: the store does not hold it)
SegmentFetch = Callable[[SegmentRef], "bytes | bytearray | memoryview | None"]


def segment_rows(schema: StateSchema) -> int | None:
    """R: the rows of a segment, where the schema's state has growing tensors (None: it has none,
    and its checkpoints are whole)."""
    if schema.layers is None or not growing_specs(schema):
        return None
    return schema.layers.kv_segment_rows


def growing_specs(schema: StateSchema) -> list[TensorSpec]:
    """The schema's tensors whose rows grow with the position, in schema order."""
    return [t for t in schema.tensors if t.rows == "position"]


def segment_digest(fingerprint: str, first: int, pieces: Sequence[memoryview | bytes]) -> bytes:
    """The 32-byte digest of a segment: BLAKE3 of the label, the schema `fingerprint`, `first`
    (u64 LE) and the plaintext `pieces`."""
    h = blake3.blake3(_DIGEST_LABEL + fingerprint.encode() + b"|" + struct.pack("<Q", first))
    for p in pieces:
        h.update(p)
    return h.digest()


def segment_key(keyring: Keyring, owner: str, fingerprint: str, first: int, digest: bytes) -> str:
    """The store key of a segment of `owner` (its principal's keyed tag): an HMAC under the
    workers' key, so equal rows of one owner share a key and nothing in it can be tested."""
    mac = hmac.new(keyring.subkey(_KEY_LABEL), f"{owner}|{fingerprint}|{first}|".encode() + digest, hashlib.sha256)
    return SEGMENT_KEY_PREFIX + mac.hexdigest()[:40]


def _rows_view(t: torch.Tensor, first: int, rows: int) -> memoryview:
    part = t[first : first + rows]
    if not part.is_contiguous():
        part = part.contiguous()
    return memoryview(part.reshape(-1).view(torch.uint8).numpy())


def split_state(schema: StateSchema, tensors: Mapping[str, torch.Tensor], position: int,
                known: Sequence[bytes] = ()) -> tuple[dict[str, torch.Tensor], list[Segment]]:
    """The checkpoint's tensors (fixed tensors whole, growing ones cut to their tail) and the
    segments of a state at `position`, in order. `known`: the digests of the first segments, as
    the caller knows them for these rows (the state this one continues): those are not hashed
    again, and carry no plaintext."""
    rows = segment_rows(schema)
    if rows is None:
        return dict(tensors), []
    grow = growing_specs(schema)
    n = position // rows
    fp = schema.fingerprint()
    segments = []
    for j in range(n):
        first = j * rows
        if j < len(known):
            segments.append(Segment(first, known[j]))
            continue
        pieces = tuple(_rows_view(tensors[t.name], first, rows) for t in grow)
        segments.append(Segment(first, segment_digest(fp, first, pieces), pieces))
    names = {t.name for t in grow}
    body = {name: (t[n * rows : position] if name in names else t) for name, t in tensors.items()}
    return body, segments
