"""The checkpoint codec (worker side): tensors <-> encrypted, authenticated, checksummed bytes.

Blob layout (envelope version 2): one msgpack map, keys in this order

    v       envelope version (2)
    alg     "AES-256-GCM"
    kid     key id in the keyring
    nonce   12 random bytes, fresh for every write
    head    the sealed header: 12 random bytes of its own nonce, then AES-256-GCM (same key) of
            {bound: {stream_id, principal, model_revision, schema_fingerprint, position, chunk_seq,
            epoch}, schema: the writer's StateSchema as canonical JSON}, padded to a multiple of
            256 bytes so that its length says nothing of a principal's name
    ct      ciphertext of the plaintext, then the 16-byte GCM tag

Nothing in it is in clear but the version, the algorithm, the key id and the nonces: whoever
reads the store without the keys learns no principal, stream, position or checksum from a blob,
only its size. The associated data of the body is every byte of the blob before the ciphertext,
sealed header included, so the header, the bound fields and the schema are authenticated with
the state: a blob moved to another stream, tenant, model, schema, position, chunk or epoch
fails, and the bound fields (read from the header with the key) let us say which.

Envelope version 1 (written before the header was sealed: `bound` and `schema` in clear in the
map, six entries before `ct`) is still read, and `reseal` rewrites such a blob as version 2 with
the same plaintext (so the same checksum, the same receipt).

Plaintext: u32 little-endian header length, a msgpack header
{byteorder, digest, tensors: [[name, dtype, shape, offset, nbytes], ...]}, each tensor's raw bytes
at a 64-byte aligned offset, and last the 32-byte digest of everything before it, BLAKE3 (`digest`
names it; a header without one is from before BLAKE3, and its digest is SHA-256): that digest is
the receipt's `checksum`, tagged by its algorithm (`blake3:<hex>`, `sha256:<hex>`).

A hybrid's KV at rest (`state_codec._kv_segments`): the growing tensors' full blocks of R rows are
sealed apart as *segments* (`seal_segment`: a sealed record bound to the segment's store key), and
the checkpoint's plaintext holds the growing tensors' tail only, with the segments' BLAKE3 digests
in order in its header (`segments`): its checksum covers every row. Opening it reads each segment
through the caller's `SegmentFetch` and checks it against its digest (`open_state`). Being inside
the ciphertext, it is authenticated by the GCM tag, so decoding
checks the receipt against it without hashing the state again (GCM already proves the bytes are
the ones the writer hashed); `decode_checkpoint(..., rehash=True)` recomputes it for audits.

Encoding reads each tensor in place: a helper thread hashes while AES-GCM encrypts straight into
the output buffer, so a state costs one BLAKE3 pass, and the only copy is the cipher's output.
(SHA-256 ran at about 2 GB/s here and capped encoding at a quarter of safetensors' save; BLAKE3
runs at 4-8 GB/s on one thread.)
Decoding decrypts straight into the buffer that the returned tensors view.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import blake3
import msgpack
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mamba_stream.state_codec._errors import (
    ChecksumMismatch,
    ChunkSequenceMismatch,
    CorruptBlob,
    EpochMismatch,
    ModelRevisionMismatch,
    PositionMismatch,
    PrincipalMismatch,
    SchemaMismatch,
    SegmentMissing,
    StateRejected,
    StreamMismatch,
    TruncatedBlob,
    UnsupportedEnvelopeVersion,
    mismatch,
)
from mamba_stream.state_codec._kv_segments import (
    Segment,
    SegmentFetch,
    SegmentRef,
    growing_specs,
    segment_digest,
    segment_key,
    segment_rows,
    split_state,
)
from mamba_stream.state_codec._receipt import ModelIdentity, Origin, Receipt, schema_diff, validate_resume
from mamba_stream.state_codec._schema import StateSchema
from mamba_stream.state_codec._sealing import format_state_key
from mamba_stream.state_codec.keyring import Keyring, KeyringError

__all__ = [
    "ALG",
    "CODE_REVISION",
    "ENVELOPE_VERSION",
    "Keyring",
    "KeyringError",
    "Opened",
    "Segment",
    "SegmentFetch",
    "SegmentRef",
    "decode_checkpoint",
    "default_state_key",
    "encode_checkpoint",
    "envelope_schema",
    "is_clear_header",
    "open_bytes",
    "open_checkpoint",
    "open_segment",
    "open_state",
    "plaintext_checksum",
    "reseal",
    "seal",
    "seal_bytes",
    "seal_segment",
    "segment_key",
    "segment_refs",
    "segment_rows",
    "split_state",
    "unseal",
]

ENVELOPE_VERSION = 2
#: the envelope written before the header was sealed: still read, rewritten by `reseal`
_CLEAR_HEADER_VERSION = 1
ALG = "AES-256-GCM"
_NONCE = 12
_TAG = 16
_ALIGN = 64
_DIGEST = 32
#: the sealed header's plaintext is padded to a multiple of this (its length hides a principal's)
_HEAD_PAD = 256
#: what the sealed header's own associated data starts with (then the key id)
_HEAD_AAD = b"mamba-stream/checkpoint-head/v2|"
# below this many bytes a helper thread costs more than it saves
_PARALLEL_HASH_BYTES = 1 << 20

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_BOUND_ERRORS: dict[str, type[StateRejected]] = {
    "stream_id": StreamMismatch,
    "principal": PrincipalMismatch,
    "model_revision": ModelRevisionMismatch,
    "schema_fingerprint": SchemaMismatch,
    "position": PositionMismatch,
    "chunk_seq": ChunkSequenceMismatch,
    "epoch": EpochMismatch,
}


def _code_revision() -> str:
    try:
        return f"mamba-stream-state {metadata.version('mamba-stream-state')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "mamba-stream-state unknown"


#: recorded in every receipt: which code wrote the state
CODE_REVISION = _code_revision()

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("state_codec.codec stores little-endian tensor bytes; this host is big-endian")


# --- plaintext framing --------------------------------------------------------------------------


#: the digest new checkpoints carry, and the ones a checkpoint may carry (by the header's name)
DIGEST = "blake3"
_HASHES = {"blake3": blake3.blake3, "sha256": hashlib.sha256}


def _pieces(tensors: Mapping[str, torch.Tensor], digest: str,
            segments: Sequence[Segment] | None = None) -> tuple[list[memoryview | bytes], int]:
    """The plaintext (before its digest) as pieces that view the tensors in place; its length.
    `digest`: the algorithm the header names ("sha256" writes the header of before BLAKE3);
    `segments`: a segmented state's KV segments, named in the header by their digests in order
    (`tensors` then hold the growing tensors' tails only)."""
    entries, views = [], []
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported by the codec")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # a view, also for bfloat16
        views.append(memoryview(raw))
        entries.append([name, _NAMES[t.dtype], list(t.shape), 0, raw.nbytes])
    head: dict[str, Any] = {"byteorder": "little", "tensors": entries}
    if digest != "sha256":
        head["digest"] = digest
    if segments is not None:
        head["segments"] = [seg.digest for seg in segments]
    header = msgpack.packb(head)
    # offsets depend on the header's length, which depends on how the offsets encode: repeat
    # until the layout is stable (twice at most in practice)
    while True:
        offset = _round_up(4 + len(header), _ALIGN)
        for e in entries:
            e[3] = offset
            offset = _round_up(offset + e[4], _ALIGN)
        again = msgpack.packb(head)
        if again == header:
            break
        header = again
    pieces: list[memoryview | bytes] = [struct.pack("<I", len(header)) + header]
    pos = len(pieces[0])
    for e, v in zip(entries, views, strict=True):
        if e[3] > pos:
            pieces.append(bytes(e[3] - pos))
        pieces.append(v)
        pos = e[3] + e[4]
    return pieces, pos


def plaintext_checksum(tensors: Mapping[str, torch.Tensor], digest: str | None = None, *,
                       schema: StateSchema | None = None) -> str:
    """The `checksum` a receipt for these tensors carries: `<digest>:<hex>` of the plaintext
    (`digest` default: `DIGEST`, what a checkpoint sealed now carries). `schema`: the state's, where
    it may cut the KV into segments (the checksum then covers the segments through their digests)."""
    digest = digest or DIGEST
    segments = None
    if schema is not None and segment_rows(schema) is not None:
        tensors, segments = split_state(schema, tensors, _rows_of(schema, tensors))
    h = _HASHES[digest]()
    for piece in _pieces(tensors, digest, segments)[0]:
        h.update(piece)
    return f"{digest}:{h.hexdigest()}"


def _rows_of(schema: StateSchema, tensors: Mapping[str, torch.Tensor]) -> int:
    """The position of a segmented state: its growing tensors' rows."""
    return int(tensors[growing_specs(schema)[0].name].shape[0])


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _parse_plaintext(buf: torch.Tensor, length: int) -> tuple[dict[str, torch.Tensor], str, list[bytes] | None]:
    """Tensors viewing `buf` (uint8, holding the plaintext without its digest), the name of the
    digest that follows it, and the digests of the KV segments it names (None: a whole state)."""
    view = memoryview(buf.numpy())[:length]
    if length < 4:
        raise CorruptBlob("plaintext shorter than its header length", field="plaintext")
    (hlen,) = struct.unpack_from("<I", view, 0)
    if 4 + hlen > length:
        raise CorruptBlob("plaintext header runs past the end", field="plaintext")
    try:
        header = msgpack.unpackb(view[4 : 4 + hlen], raw=False, strict_map_key=True)
        entries = header["tensors"]
        if header.get("byteorder") != "little":
            raise ValueError("byteorder")
        digest = header.get("digest", "sha256")
        if digest not in _HASHES:
            raise ValueError(f"digest {digest!r}")
        segments = header.get("segments")
        if segments is not None and not (isinstance(segments, list)
                                         and all(isinstance(d, bytes) and len(d) == 32 for d in segments)):
            raise ValueError("segments")
    except Exception as exc:  # noqa: BLE001 - anything malformed is a corrupt blob
        raise CorruptBlob(f"unreadable plaintext header: {exc}", field="plaintext") from None
    out: dict[str, torch.Tensor] = {}
    for entry in entries:
        try:
            name, dname, shape, off, nbytes = entry
            dtype = _DTYPES[dname]
            numel = 1
            for d in shape:
                numel *= int(d)
            ok = off >= 4 + hlen and off + nbytes <= length and nbytes == numel * dtype.itemsize
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            raise CorruptBlob(f"tensor entry {entry!r} does not fit the plaintext", field="plaintext")
        out[name] = buf[off : off + nbytes].view(dtype).view(tuple(shape))
    return out, digest, segments


# --- envelope ---------------------------------------------------------------------------------


def _bin_header(n: int) -> bytes:
    return b"\xc6" + struct.pack(">I", n)


def _seal_head(key: bytes, kid: str, bound: dict[str, Any], schema_json: str) -> bytes:
    """The sealed header: its nonce, then AES-256-GCM of {bound, schema}, padded (`_HEAD_PAD`)."""
    body = msgpack.packb({"bound": bound, "schema": schema_json})
    plain = struct.pack("<I", len(body)) + body
    plain += bytes(-len(plain) % _HEAD_PAD)
    nonce = os.urandom(_NONCE)
    return nonce + AESGCM(key).encrypt(nonce, plain, _HEAD_AAD + kid.encode())


def _open_head(key: bytes, kid: str, head: bytes) -> tuple[dict[str, Any], str]:
    """(bound, schema JSON) of a sealed header; CorruptBlob if it does not authenticate or parse."""
    if len(head) < _NONCE + _TAG + 4:
        raise CorruptBlob("sealed header shorter than its nonce and tag", field="head")
    try:
        plain = AESGCM(key).decrypt(head[:_NONCE], head[_NONCE:], _HEAD_AAD + kid.encode())
    except InvalidTag:
        raise CorruptBlob("authentication failed: the blob's header was altered or the key is wrong",
                          field="head") from None
    try:
        (n,) = struct.unpack_from("<I", plain, 0)
        fields = msgpack.unpackb(plain[4 : 4 + n], raw=False, strict_map_key=True)
        bound, schema_json = fields["bound"], fields["schema"]
        if not isinstance(bound, dict) or not isinstance(schema_json, str):
            raise ValueError("malformed bound fields or schema")  # caught: a corrupt blob
    except Exception as exc:  # noqa: BLE001 - anything malformed is a corrupt blob
        raise CorruptBlob(f"unreadable sealed header: {exc}", field="head") from None
    return bound, schema_json


def _envelope_prefix(kid: str, nonce: bytes, head: bytes, ct_len: int) -> bytes:
    """Every byte of a version-2 blob before its ciphertext: the body's associated data."""
    return b"\x86" + b"".join(  # fixmap of 6 entries
        msgpack.packb(k) + msgpack.packb(v)
        for k, v in (("v", ENVELOPE_VERSION), ("alg", ALG), ("kid", kid), ("nonce", nonce), ("head", head))
    ) + msgpack.packb("ct") + _bin_header(ct_len)


def _seal_pieces(pieces: list[memoryview | bytes], total: int, bound: dict[str, Any], schema_json: str,
                 keyring: Keyring, digest: str, value: bytes | None = None) -> tuple[str, bytearray]:
    """A version-2 blob of the plaintext `pieces` (`total` bytes, before its digest), and the
    checksum it carries. The digest is `value` when the caller knows it (a reseal), else computed
    by a helper thread while AES-GCM encrypts each piece in place: one read of each."""
    kid, nonce = keyring.active_id, os.urandom(_NONCE)
    key = keyring.key(kid)
    ct_len = total + _DIGEST + _TAG
    prefix = _envelope_prefix(kid, nonce, _seal_head(key, kid, bound, schema_json), ct_len)
    out = bytearray(len(prefix) + ct_len)
    out[: len(prefix)] = prefix
    mv = memoryview(out)
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(prefix)

    hasher = _HASHES[digest]()

    def hash_all() -> None:
        for piece in pieces:
            hasher.update(piece)  # releases the GIL on large buffers

    helper = None
    if value is None:
        if total >= _PARALLEL_HASH_BYTES:
            helper = threading.Thread(target=hash_all, name="checkpoint-digest")
            helper.start()
        else:
            hash_all()
    pos = len(prefix)
    try:
        for piece in pieces:
            n = len(piece)
            # update_into wants a block of room beyond the data: the digest and tag follow
            enc.update_into(piece, mv[pos : pos + n + 15])
            pos += n
    finally:
        if helper is not None:
            helper.join()
    if value is None:
        value = hasher.digest()
    enc.update_into(value, mv[pos : pos + _DIGEST + 15])
    pos += _DIGEST
    enc.finalize()
    mv[pos : pos + _TAG] = enc.tag
    return f"{digest}:{value.hex()}", out


def _encrypt(tensors: Mapping[str, torch.Tensor], bound: dict[str, Any], schema_json: str,
             keyring: Keyring, segments: Sequence[Segment] | None = None) -> tuple[str, bytearray]:
    """One read of each tensor: hashed by a helper thread while AES-GCM encrypts it in place."""
    pieces, total = _pieces(tensors, DIGEST, segments)
    return _seal_pieces(pieces, total, bound, schema_json, keyring, DIGEST)


def encode_checkpoint(
    state_tensors: Mapping[str, torch.Tensor],
    receipt: Receipt,
    keyring: Keyring,
    *,
    schema: StateSchema | None = None,
) -> bytearray:
    """Encrypt `state_tensors` into a blob bound to `receipt`'s stream, tenant, model and position.

    Args:
        state_tensors: name -> tensor (float32, float64, bfloat16 or float16; any device).
        receipt: the receipt the blob will be stored under; its checksum must be the plaintext's.
        keyring: the active key encrypts.
        schema: the writer's StateSchema, embedded (sealed, authenticated) so that a reader with
            another schema is told which field differs. Must have `receipt.schema_fingerprint`.

    Returns:
        The blob, as a bytearray (bytes-like; returned as is to spare a 19 MB copy).

    Raises:
        ChecksumMismatch: the receipt's checksum is not the plaintext's.
    """
    schema_json = ""
    if schema is not None:
        if schema.fingerprint() != receipt.schema_fingerprint:
            raise mismatch(SchemaMismatch, "schema.fingerprint", receipt.schema_fingerprint, schema.fingerprint())
        schema_json = schema.canonical_json()
    checksum, blob = _encrypt(state_tensors, receipt.bound(), schema_json, keyring)
    if checksum != receipt.checksum:
        raise mismatch(ChecksumMismatch, "checksum", receipt.checksum, checksum)
    return blob


class _Reader:
    """File-like view of a buffer: msgpack reads the small header through it, copying only that."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else self._pos + n
        chunk = bytes(self._view[self._pos : end])
        self._pos += len(chunk)
        return chunk


class _Envelope:
    def __init__(self, fields: dict[str, Any], ct: memoryview, aad: memoryview) -> None:
        self.fields = fields
        self.ct = ct
        self.aad = aad


def _open_envelope(blob: bytes | bytearray | memoryview) -> _Envelope:
    """Parse the header without copying the ciphertext; structural problems -> CorruptBlob."""
    view = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")
    if not len(view):
        raise TruncatedBlob("empty blob", field="blob")
    fields: dict[str, Any] = {}
    try:
        unpacker = msgpack.Unpacker(_Reader(view), raw=False, strict_map_key=True,
                                    max_buffer_size=len(view), read_size=min(4096, len(view)))
        n = unpacker.read_map_header()
        if n not in (6, 7):  # version 2, version 1
            raise ValueError(f"{n} envelope entries, expected 6")
        for i in range(n):
            key = unpacker.unpack()
            if key == "ct":
                if i != n - 1:
                    raise ValueError("ct is not the last entry")
                break
            fields[key] = unpacker.unpack()
        else:
            raise ValueError("no ct entry")
    except msgpack.OutOfData:
        raise TruncatedBlob("blob ends inside its header", field="blob") from None
    except Exception as exc:  # noqa: BLE001 - anything malformed is a corrupt blob
        raise CorruptBlob(f"unreadable envelope: {exc}", field="blob") from None
    pos = unpacker.tell()
    if pos + 5 > len(view):
        raise TruncatedBlob("blob ends before its ciphertext", field="blob")
    if view[pos] != 0xC6:
        raise CorruptBlob("ciphertext is not a bin32 entry", field="ct")
    (length,) = struct.unpack_from(">I", view, pos + 1)
    start, end = pos + 5, pos + 5 + length
    if end > len(view):
        raise TruncatedBlob(f"ciphertext declares {length} bytes, {len(view) - start} present", field="ct",
                            expected=length, actual=len(view) - start)
    if end < len(view):
        raise CorruptBlob(f"{len(view) - end} bytes after the ciphertext", field="blob")
    if length < _TAG:
        raise TruncatedBlob("ciphertext shorter than its tag", field="ct")
    return _Envelope(fields, view[start:end], view[:start])


def _check_header(env: _Envelope) -> int:
    """The envelope's version, once its clear fields are well formed."""
    f = env.fields
    version = f.get("v")
    if version not in (ENVELOPE_VERSION, _CLEAR_HEADER_VERSION):
        raise mismatch(UnsupportedEnvelopeVersion, "v", ENVELOPE_VERSION, version)
    if len(f) != (5 if version == ENVELOPE_VERSION else 6):
        raise CorruptBlob(f"{len(f) + 1} envelope entries for version {version}", field="blob")
    if f.get("alg") != ALG:
        raise mismatch(CorruptBlob, "alg", ALG, f.get("alg"))
    if not isinstance(f.get("kid"), str) or not isinstance(f.get("nonce"), bytes) or len(f["nonce"]) != _NONCE:
        raise CorruptBlob("malformed key id or nonce", field="nonce")
    if version == ENVELOPE_VERSION:
        if not isinstance(f.get("head"), bytes):
            raise CorruptBlob("malformed sealed header", field="head")
    elif not isinstance(f.get("bound"), dict) or not isinstance(f.get("schema"), str):
        raise CorruptBlob("malformed bound fields or schema", field="bound")
    return version


def _header(env: _Envelope, keyring: Keyring) -> tuple[int, dict[str, Any], str]:
    """The envelope's version, bound fields and schema JSON (a version-2 header opened with its key)."""
    version = _check_header(env)
    f = env.fields
    if version == _CLEAR_HEADER_VERSION:
        return version, f["bound"], f["schema"]
    bound, schema_json = _open_head(keyring.key(f["kid"]), f["kid"], f["head"])
    return version, bound, schema_json


def envelope_schema(blob: bytes | bytearray | memoryview, keyring: Keyring) -> StateSchema | None:
    """The writer's schema embedded in a blob (its sealed header opened with `keyring`; the body
    is not authenticated by this)."""
    _, _, schema_json = _header(_open_envelope(blob), keyring)
    if not schema_json:
        return None
    try:
        return StateSchema.model_validate_json(schema_json)
    except Exception as exc:  # noqa: BLE001
        raise CorruptBlob(f"unreadable schema: {exc}", field="schema") from None


def decode_checkpoint(
    blob: bytes | bytearray | memoryview, receipt: Receipt, keyring: Keyring, *, rehash: bool = False,
    segments: SegmentFetch | None = None,
) -> dict[str, torch.Tensor]:
    """Authenticate, decrypt and checksum a blob written for `receipt`; returns its tensors.

    The receipt's checksum is compared with the authenticated digest inside the blob;
    `rehash=True` also recomputes that digest over the decrypted state.

    Raises:
        StateRejected subclasses: UnsupportedEnvelopeVersion, CorruptBlob / TruncatedBlob,
        the bound-field mismatches (StreamMismatch, PrincipalMismatch, ModelRevisionMismatch,
        SchemaMismatch, PositionMismatch, ChunkSequenceMismatch, EpochMismatch), UnknownKeyId,
        ChecksumMismatch; for a segmented checkpoint, SegmentMissing (read through `segments`,
        `open_state`). Nothing else, whatever the bytes.
    """
    tensors, checksum = open_checkpoint(blob, receipt, keyring, rehash=rehash, segments=segments)
    if checksum != receipt.checksum:
        raise mismatch(ChecksumMismatch, "checksum", receipt.checksum, checksum)
    return tensors


def _decrypt_body(env: _Envelope, key: bytes) -> tuple[torch.Tensor, int]:
    """The plaintext of an envelope's body (a buffer holding it, digest last) and its length."""
    length = len(env.ct) - _TAG
    if length < 4 + _DIGEST:
        raise TruncatedBlob("ciphertext shorter than a plaintext", field="ct")
    buf = torch.empty(length + 15, dtype=torch.uint8)  # uninitialized: the cipher fills it
    plain = memoryview(buf.numpy())
    dec = Cipher(algorithms.AES(key), modes.GCM(env.fields["nonce"], bytes(env.ct[length:]))).decryptor()
    dec.authenticate_additional_data(env.aad)
    try:
        dec.update_into(env.ct[:length], plain)
        dec.finalize()
    except InvalidTag:
        raise CorruptBlob("authentication failed: the blob was altered or the key is wrong",
                          field="ct") from None
    return buf, length


@dataclass(frozen=True)
class Opened:
    """A checkpoint opened: its state's tensors (segments read in), its checksum, and the KV
    segments it names, in order (none for a whole state)."""

    tensors: dict[str, torch.Tensor]
    checksum: str
    segments: tuple[SegmentRef, ...] = ()


def open_checkpoint(
    blob: bytes | bytearray | memoryview, receipt: Receipt, keyring: Keyring, *, rehash: bool = False,
    segments: SegmentFetch | None = None,
) -> tuple[dict[str, torch.Tensor], str]:
    """Like `decode_checkpoint`, but returns the blob's checksum instead of requiring the receipt's.

    For adopting a blob that an earlier attempt committed under a key this attempt derived too:
    every bound field is still checked, only the checksum is learned rather than compared.
    `segments`: reads the KV segments a segmented checkpoint names (`open_state`).
    """
    opened = open_state(blob, receipt, keyring, rehash=rehash, segments=segments)
    return opened.tensors, opened.checksum


def open_state(
    blob: bytes | bytearray | memoryview, receipt: Receipt, keyring: Keyring, *, rehash: bool = False,
    segments: SegmentFetch | None = None,
) -> Opened:
    """`open_checkpoint`, with the segments it named. A segmented checkpoint's KV segments are read
    through `segments` (each checked against its digest, which the checksum covers) and joined
    with its tail, so the tensors are the whole state.

    Raises:
        what `decode_checkpoint` raises but ChecksumMismatch for the receipt; SegmentMissing (a
        named segment the store does not hold, or no `segments` to read it with); CorruptBlob or
        ChecksumMismatch for a segment that is not the one named.
    """
    env = _open_envelope(blob)
    _, bound, schema_json = _header(env, keyring)
    for field, expected in receipt.bound().items():
        if bound.get(field) != expected:
            raise mismatch(_BOUND_ERRORS[field], field, expected, bound.get(field))
    if set(bound) != set(_BOUND_ERRORS):
        raise CorruptBlob("unexpected bound fields", field="bound", expected=sorted(_BOUND_ERRORS),
                          actual=sorted(bound))
    buf, length = _decrypt_body(env, keyring.key(env.fields["kid"]))
    plain = memoryview(buf.numpy())
    body = length - _DIGEST
    # the header, and so the digest's name and the segments' digests, is authenticated too
    tensors, digest, digests = _parse_plaintext(buf, body)
    checksum = f"{digest}:{bytes(plain[body:length]).hex()}"  # authenticated by the tag
    if rehash:
        recomputed = f"{digest}:{_HASHES[digest](plain[:body]).hexdigest()}"
        if recomputed != checksum:
            raise mismatch(ChecksumMismatch, "checksum", checksum, recomputed)
    if digests is None:
        return Opened(tensors, checksum)
    try:
        schema = StateSchema.model_validate_json(schema_json)
    except Exception as exc:  # noqa: BLE001
        raise CorruptBlob(f"a segmented checkpoint without a readable schema: {exc}", field="schema") from None
    rows = segment_rows(schema)
    if rows is None or len(digests) != receipt.position // rows:
        raise CorruptBlob(f"{len(digests)} KV segments named at position {receipt.position}", field="segments")
    refs = segment_refs(schema, keyring, bound["principal"], digests)
    return Opened(_assemble(schema, receipt.position, tensors, refs, segments, keyring), checksum, refs)


def segment_refs(schema: StateSchema, keyring: Keyring, principal: str,
                 digests: Sequence[bytes]) -> tuple[SegmentRef, ...]:
    """The store keys of a state's segments (by their digests, in order), for `principal`'s owner tag."""
    rows = segment_rows(schema)
    assert rows is not None
    owner, fp = keyring.principal_tag(principal), schema.fingerprint()
    return tuple(SegmentRef(j * rows, d, segment_key(keyring, owner, fp, j * rows, d)) for j, d in enumerate(digests))


def is_clear_header(blob: bytes | bytearray | memoryview) -> bool:
    """Whether `blob` is a checkpoint written with its header in clear (envelope version 1): one
    `reseal` rewrites. False for a version-2 checkpoint and for anything that is no checkpoint."""
    try:
        return _check_header(_open_envelope(blob)) == _CLEAR_HEADER_VERSION
    except StateRejected:
        return False


def reseal(blob: bytes | bytearray | memoryview, keyring: Keyring) -> bytearray:
    """A version-1 checkpoint (header in clear) rewritten as version 2 (header sealed): the same
    plaintext re-encrypted under the active key, so the same tensors and the same checksum, and
    the same bound fields and schema, sealed. The blob is authenticated first (CorruptBlob if it
    does not); a version-2 blob is returned as it is."""
    env = _open_envelope(blob)
    version, bound, schema_json = _header(env, keyring)
    if version == ENVELOPE_VERSION:
        return bytearray(blob)
    buf, length = _decrypt_body(env, keyring.key(env.fields["kid"]))
    plain = memoryview(buf.numpy())
    body = length - _DIGEST
    _, digest, _ = _parse_plaintext(buf, body)
    _, out = _seal_pieces([plain[:body]], body, bound, schema_json, keyring, digest, bytes(plain[body:length]))
    return out


# --- small sealed records -----------------------------------------------------------------------


def seal_bytes(data: bytes, *, binding: str, keyring: Keyring) -> bytes:
    """Encrypt a small record (AES-256-GCM) bound to `binding` (e.g. its store key)."""
    nonce = os.urandom(_NONCE)
    ct = AESGCM(keyring.key(keyring.active_id)).encrypt(nonce, data, b"record/v1|" + binding.encode())
    return msgpack.packb({"v": 1, "kid": keyring.active_id, "nonce": nonce, "ct": ct})


def open_bytes(blob: bytes | bytearray | memoryview, *, binding: str, keyring: Keyring) -> bytes:
    """Decrypt a record from `seal_bytes`; anything wrong raises a StateRejected subclass."""
    try:
        env = msgpack.unpackb(bytes(blob), raw=False, strict_map_key=True)
        version, kid, nonce, ct = env["v"], env["kid"], env["nonce"], env["ct"]
        if not (isinstance(kid, str) and isinstance(nonce, bytes) and isinstance(ct, bytes)):
            raise ValueError("malformed record")  # caught: a corrupt blob
    except Exception as exc:  # noqa: BLE001 - anything malformed is a corrupt blob
        raise CorruptBlob(f"unreadable record: {exc}", field="record") from None
    if version != 1:
        raise mismatch(UnsupportedEnvelopeVersion, "v", 1, version)
    try:
        return AESGCM(keyring.key(kid)).decrypt(nonce, ct, b"record/v1|" + binding.encode())
    except InvalidTag:
        raise CorruptBlob("record authentication failed", field="record") from None


# --- KV segments ---------------------------------------------------------------------------------


def _segment_binding(key: str) -> str:
    return f"kv-segment/v1|{key}"


def seal_segment(segment: Segment, key: str, keyring: Keyring) -> bytes:
    """A KV segment's sealed blob: its rows as a sealed record (`seal_bytes`), bound to its store `key`."""
    if segment.pieces is None:
        raise ValueError("a segment named by its digest only has no plaintext to seal")
    return seal_bytes(b"".join(segment.pieces), binding=_segment_binding(key), keyring=keyring)


def open_segment(blob: bytes | bytearray | memoryview, ref: SegmentRef, fingerprint: str, keyring: Keyring,
                 nbytes: int) -> bytes:
    """The rows of a sealed KV segment, checked: it authenticates under its key (a segment moved to
    another key fails: CorruptBlob) and hashes to the digest its checkpoint names (ChecksumMismatch)."""
    try:
        plain = open_bytes(blob, binding=_segment_binding(ref.key), keyring=keyring)
    except CorruptBlob as exc:
        raise CorruptBlob(f"KV segment {ref.key} at position {ref.first}: {exc}", field="segment") from None
    if len(plain) != nbytes:
        raise CorruptBlob(f"KV segment {ref.key} holds {len(plain)} bytes, not {nbytes}", field="segment",
                          expected=nbytes, actual=len(plain))
    got = segment_digest(fingerprint, ref.first, [plain])
    if got != ref.digest:
        raise ChecksumMismatch(f"KV segment {ref.key} at position {ref.first} is not the one its checkpoint "
                               "names", field="segment", expected=ref.digest.hex(), actual=got.hex())
    return plain


def _assemble(schema: StateSchema, position: int, body: Mapping[str, torch.Tensor], refs: Sequence[SegmentRef],
             fetch: SegmentFetch | None, keyring: Keyring) -> dict[str, torch.Tensor]:
    """A state's tensors from its checkpoint's (`body`: growing tensors cut to their tail) and its
    segments, read through `fetch` and checked (`open_segment`), in schema order.

    Raises:
        SegmentMissing: a segment the checkpoint names is not in the store (or there is no `fetch`).
        CorruptBlob, ChecksumMismatch: a segment that is not the one named.
    """
    rows = segment_rows(schema)
    if rows is None or not refs:
        return dict(body)
    grow = growing_specs(schema)
    fp = schema.fingerprint()
    out = {t.name: torch.empty(t.shape_at(position), dtype=body[t.name].dtype) for t in grow}
    sizes = [out[t.name][:rows].numel() * out[t.name].element_size() for t in grow]
    for ref in refs:
        blob = None if fetch is None else fetch(ref)
        if blob is None:
            raise SegmentMissing(f"the KV segment at position {ref.first} ({ref.key}) is not in the store",
                                 field="segment", expected=ref.key, actual=None)
        plain = torch.frombuffer(bytearray(open_segment(blob, ref, fp, keyring, sum(sizes))), dtype=torch.uint8)
        off = 0
        for t, size in zip(grow, sizes, strict=True):
            out[t.name][ref.first : ref.first + rows].reshape(-1).view(torch.uint8).copy_(plain[off : off + size])
            off += size
    tail = len(refs) * rows
    for t in grow:
        out[t.name][tail:position].copy_(body[t.name])
    return {name: out.get(name, tensor) for name, tensor in body.items()}


# --- the pair activities use ----------------------------------------------------------------


def default_state_key(stream_id: str, epoch: int, chunk_seq: int, checksum: str) -> str:
    """Content-derived: the same state of the same stream at the same step, the same key (the
    workers derive keyed ones, `activities.ChunkCommit.state_key`; this is for a bare `seal`)."""
    return format_state_key(stream_id, epoch, chunk_seq, hashlib.sha256(checksum.encode()).hexdigest()[:32])


def seal(
    model: Any,
    state: Any,
    *,
    stream_id: str,
    principal: str,
    chunk_seq: int,
    epoch: int,
    keyring: Keyring,
    state_key: str | None = None,
    backend: str | None = None,
    arithmetic: Mapping[str, Any] | None = None,
    origin: Origin | None = None,
    segments: Sequence[Segment] | None = None,
) -> tuple[Receipt, bytearray]:
    """Receipt and encrypted blob for `state` of `model` (a `scan.Model` and `scan.State`).

    The state is validated against the model's schema first. `backend` records what produced
    the state (defaults to the model's backend); `arithmetic`, the receipt's arithmetic fields
    (`continue_arithmetic`; none by default); `origin`, where the epoch's first state came from.

    A model whose state cuts its KV into segments (`segment_rows`) gets a checkpoint of its fixed
    tensors, its KV's tail and its segments' digests: `segments` are the state's (`split_state`;
    the caller stores them, `seal_segment`), computed here when None.
    """
    model.validate_state(state)
    identity: ModelIdentity = model.identity()
    schema = identity.state_schema
    tensors: Mapping[str, torch.Tensor] = state.tensors
    if segment_rows(schema) is not None:
        known = [seg.digest for seg in segments] if segments is not None else ()
        tensors, split = split_state(schema, state.tensors, state.position, known)
        if segments is not None and len(segments) != len(split):
            raise ValueError(f"{len(segments)} segments given for a state with {len(split)}")
        segments = split
    else:
        segments = None
    bound = {
        "stream_id": stream_id, "principal": principal, "model_revision": identity.model_revision,
        "schema_fingerprint": identity.fingerprint, "position": state.position, "chunk_seq": chunk_seq,
        "epoch": epoch,
    }
    checksum, blob = _encrypt(tensors, bound, schema.canonical_json(), keyring, segments)
    receipt = Receipt(
        stream_id=stream_id, principal=principal, model_id=identity.model_id,
        model_revision=identity.model_revision, code_revision=CODE_REVISION,
        input_transform=identity.input_transform, input_transform_revision=identity.input_transform_revision,
        schema_fingerprint=identity.fingerprint, schema_version=schema.schema_version,
        architecture=schema.architecture, dtype=identity.state_dtype, n_layer=schema.n_layer,
        d_state=schema.d_state, state_bytes=schema.state_bytes, position=state.position, chunk_seq=chunk_seq,
        epoch=epoch, state_key=state_key or default_state_key(stream_id, epoch, chunk_seq, checksum),
        checksum=checksum, backend=backend or getattr(model, "backend", "unknown"), origin=origin,
        **(arithmetic or {}),
    )
    return receipt, blob


def unseal(
    blob: bytes | bytearray | memoryview,
    receipt: Receipt,
    keyring: Keyring,
    *,
    model: Any,
    principal: str,
    segments: SegmentFetch | None = None,
) -> Any:
    """The state in `blob`, after every check a resume needs, as `model.restore_state` builds it.

    Validates the receipt against the serving model and the caller's principal
    (`validate_resume`), names the differing schema field if the blob was written under another
    schema, then authenticates, decrypts and checksums. `model` is duck-typed (a `scan.Model`):
    the record stays below the engine and never imports it. `segments` reads a segmented
    checkpoint's KV segments (`open_state`).
    """
    identity: ModelIdentity = model.identity()
    try:
        validate_resume(receipt, identity, principal)
    except SchemaMismatch:
        theirs = _schema_or_none(blob, keyring)
        diff = schema_diff(identity.state_schema, theirs) if theirs is not None else None
        if diff is not None:
            raise mismatch(SchemaMismatch, *diff) from None
        raise
    tensors = decode_checkpoint(blob, receipt, keyring, segments=segments)
    expected = [(t.name, t.shape_at(receipt.position), t.dtype) for t in identity.state_schema.tensors]
    actual = [(n, tuple(t.shape), _NAMES[t.dtype]) for n, t in tensors.items()]
    if expected != actual:
        raise mismatch(SchemaMismatch, "schema.tensors", expected, actual)
    return model.restore_state(receipt.position, tensors)


def _schema_or_none(blob: bytes | bytearray | memoryview, keyring: Keyring) -> StateSchema | None:
    try:
        return envelope_schema(blob, keyring)
    except StateRejected:
        return None
