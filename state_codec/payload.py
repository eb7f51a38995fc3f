"""Temporal payload codec: every payload in history encrypted with the keyring (worker side).

Encoded payloads carry `encoding: binary/encrypted` and the key id; their data is the 12-byte
nonce followed by the AES-256-GCM ciphertext of the original serialized payload. Payloads
without that encoding (plain JSON typed into the Temporal CLI, say) pass through decoding as
they are, so operators can still signal and query with the stock CLI.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

from state_codec.codec import Keyring

__all__ = ["ENCRYPTED_ENCODING", "EncryptionCodec"]

ENCRYPTED_ENCODING = b"binary/encrypted"
_AAD = b"mamba-stream/payload/v1"


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM over whole payloads, with the keyring's active key; any known key decrypts."""

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring
        self._ciphers: dict[str, AESGCM] = {}

    def _cipher(self, kid: str) -> AESGCM:
        c = self._ciphers.get(kid)
        if c is None:
            c = self._ciphers[kid] = AESGCM(self._keyring.key(kid))
        return c

    def encrypt(self, payload: Payload) -> Payload:
        kid = self._keyring.active_id
        nonce = os.urandom(12)
        data = nonce + self._cipher(kid).encrypt(nonce, payload.SerializeToString(), _AAD)
        return Payload(metadata={"encoding": ENCRYPTED_ENCODING, "encryption-key-id": kid.encode()}, data=data)

    def decrypt(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCRYPTED_ENCODING:
            return payload
        kid = payload.metadata.get("encryption-key-id", b"").decode()
        try:
            plain = self._cipher(kid).decrypt(payload.data[:12], payload.data[12:], _AAD)
        except InvalidTag:
            raise ValueError(f"payload under key {kid!r} fails authentication") from None
        return Payload.FromString(plain)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]
