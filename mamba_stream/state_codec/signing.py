"""Signed requests: Ed25519 signatures that bind a request to its principal and its stream.

A client holding a principal's private key signs each request it sends (`RequestSigner`); a
worker configured with the principals' public keys (`PrincipalKeys`) verifies the signature in
the activity, before the request touches any state. The signed bytes are

    mamba-stream/request/v1 \\n {"claims": ..., "kind": ..., "stream_id": ...}

(canonical JSON: sorted keys, no spaces), where `claims` is the request's own fields but the
signature. So a tampered field, a request replayed to another stream and a request of another
kind all fail, and since `chunk_seq` is a claim, replaying a chunk to the same stream is the
idempotent repeat of that chunk, never a second advance. Ed25519 signatures are deterministic:
a client that re-sends a request signs it to the same bytes, which keeps update ids stable.

Key formats (all base64 of the raw 32-byte keys):
    principals' public keys: {"alice": "<public key>", ...} as JSON, or a file holding it
    a signing key: "<principal>:<private key>", or a 0600 file holding it
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from mamba_stream.state_codec._errors import BadSignature, UnknownSigner, UnsignedRequest

__all__ = ["DOMAIN", "PrincipalKeys", "RequestSigner", "signing_bytes"]

DOMAIN = b"mamba-stream/request/v1"

#: request kinds; part of the signed bytes, so a signature for one kind never passes as another
KINDS = frozenset({"open", "advance", "generate", "reset", "checkpoint", "cancel", "rewind", "release"})


def signing_bytes(kind: str, stream_id: str, claims: Mapping[str, Any]) -> bytes:
    """The exact bytes signed for a request of `kind` to `stream_id` with these `claims`."""
    if kind not in KINDS:
        raise ValueError(f"unknown request kind {kind!r}")
    body = json.dumps({"claims": dict(claims), "kind": kind, "stream_id": stream_id}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return DOMAIN + b"\n" + body.encode("utf-8")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, size: int, what: str) -> bytes:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what} is not base64") from exc
    if len(raw) != size:
        raise ValueError(f"{what} must be {size} bytes, got {len(raw)}")
    return raw


class RequestSigner:
    """Signs requests for one principal with its Ed25519 private key."""

    def __init__(self, principal: str, private_key: Ed25519PrivateKey) -> None:
        self.principal = principal
        self._key = private_key

    @classmethod
    def generate(cls, principal: str) -> RequestSigner:
        return cls(principal, Ed25519PrivateKey.generate())

    @classmethod
    def from_spec(cls, spec: str) -> RequestSigner:
        """`<principal>:<base64 private key>`, or the path of a file holding that."""
        text = spec.strip()
        if ":" not in text or os.path.exists(text):
            path = Path(text)
            if path.stat().st_mode & 0o077:
                raise PermissionError(f"{path} is readable by others; chmod 600 it")
            text = path.read_text().strip()
        principal, _, key = text.partition(":")
        if not principal or not key:
            raise ValueError("a signing key is '<principal>:<base64 private key>'")
        return cls(principal, Ed25519PrivateKey.from_private_bytes(_unb64(key, 32, "the private key")))

    def spec(self) -> str:
        """`<principal>:<base64 private key>` (secret: store it 0600)."""
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        raw = self._key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return f"{self.principal}:{_b64(raw)}"

    @property
    def public_key(self) -> str:
        """Base64 of the raw public key, for the workers' `PrincipalKeys`."""
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return _b64(self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))

    def sign(self, kind: str, stream_id: str, claims: Mapping[str, Any]) -> str:
        """Base64 signature of `signing_bytes(kind, stream_id, claims)`."""
        if claims.get("principal") != self.principal:
            raise ValueError(f"this key signs for {self.principal!r}, not {claims.get('principal')!r}")
        return _b64(self._key.sign(signing_bytes(kind, stream_id, claims)))


class PrincipalKeys:
    """The principals' public keys a worker trusts; with any configured, every request must be signed."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey]) -> None:
        self._keys = dict(keys)

    @classmethod
    def from_mapping(cls, entries: Mapping[str, str]) -> PrincipalKeys:
        return cls({p: Ed25519PublicKey.from_public_bytes(_unb64(k, 32, f"the public key of {p!r}"))
                    for p, k in entries.items()})

    @classmethod
    def from_spec(cls, spec: str) -> PrincipalKeys:
        """JSON `{"principal": "<base64 public key>", ...}`, or the path of a file holding it."""
        text = spec.strip()
        if not text.startswith("{"):
            text = Path(text).read_text()
        entries = json.loads(text)
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise ValueError('principal keys are a JSON object {"principal": "<base64 public key>"}')
        return cls.from_mapping(entries)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, principal: object) -> bool:
        return principal in self._keys

    def verify(self, kind: str, stream_id: str, claims: Mapping[str, Any], signature: str | None) -> None:
        """Raises UnsignedRequest, UnknownSigner or BadSignature unless `signature` is the principal's.

        The principal is the one named in the claims: a request signed by another principal's key
        fails as BadSignature.
        """
        principal = claims.get("principal")
        if not signature:
            raise UnsignedRequest(f"{kind} request for stream {stream_id} is not signed", field="signature",
                                  expected="an Ed25519 signature", actual=None)
        key = self._keys.get(principal) if isinstance(principal, str) else None
        if key is None:
            raise UnknownSigner(f"no public key for principal {principal!r}", field="principal",
                                expected=sorted(self._keys), actual=principal)
        try:
            raw = _unb64(signature, 64, "the signature")
            key.verify(raw, signing_bytes(kind, stream_id, claims))
        except (ValueError, InvalidSignature):
            raise BadSignature(f"the signature of this {kind} request does not verify for principal "
                               f"{principal!r} and stream {stream_id}", field="signature",
                               expected=f"signed by {principal!r} for {stream_id}", actual=signature[:24]) from None
