"""What a store written before owners were tagged holds, byte for byte as that version wrote it
(envelope version 1, the file store's `MSSB\\x01` objects, the PostgreSQL store's table with
`principal` and `sha256` columns, prefix index and scope records in clear JSON), for the tests that
open an old-format store. Kept apart from the library, which only reads these formats."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from mamba_stream.state_codec import Receipt
from mamba_stream.state_codec.codec import DIGEST, Keyring, _pieces

__all__ = ["downgrade_file_store", "downgrade_meta", "downgrade_pg_rows", "legacy_blob", "legacy_file_object",
           "legacy_pg_row", "legacy_pg_table", "to_version_1"]


def legacy_blob(tensors: Mapping[str, torch.Tensor], receipt: Receipt, keyring: Keyring,
                schema_json: str = "") -> bytes:
    """A version-1 checkpoint of `tensors` for `receipt`: `bound` and `schema` in clear in the map,
    the associated data every byte before the ciphertext."""
    pieces, _ = _pieces(tensors, DIGEST)
    import blake3

    plain = b"".join(bytes(p) for p in pieces)
    plain += blake3.blake3(plain).digest()
    kid, nonce = keyring.active_id, os.urandom(12)
    ct_len = len(plain) + 16
    prefix = b"\x87" + b"".join(
        msgpack.packb(k) + msgpack.packb(v)
        for k, v in (("v", 1), ("alg", "AES-256-GCM"), ("kid", kid), ("nonce", nonce),
                     ("bound", receipt.bound()), ("schema", schema_json))
    ) + msgpack.packb("ct") + b"\xc6" + struct.pack(">I", ct_len)
    return prefix + AESGCM(keyring.key(kid)).encrypt(nonce, plain, prefix)


def legacy_file_object(root: Path, *, key: str, data: bytes, stream_id: str, principal: str) -> None:
    """An object as the file store wrote it: header {key, stream_id, principal, size, sha256}."""
    shard = hashlib.sha256(key.encode()).hexdigest()[:2]
    header = json.dumps({"key": key, "stream_id": stream_id, "principal": principal, "size": len(data),
                         "sha256": hashlib.sha256(data).hexdigest()}).encode()
    path = root / "objects" / shard / key
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(b"MSSB\x01" + struct.pack("<I", len(header)) + header + data)
    os.chmod(path, 0o600)
    marker = root / "streams" / stream_id / key
    marker.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    marker.touch(mode=0o600)


def legacy_pg_table(conn: Any, table: str) -> None:
    """The blob and metadata tables as the PostgreSQL store created them."""
    conn.execute(f"CREATE TABLE {table} (key text PRIMARY KEY, stream_id text NOT NULL, principal text NOT NULL,"
                 " data bytea NOT NULL, sha256 bytea NOT NULL, size bigint NOT NULL,"
                 " created_at timestamptz NOT NULL DEFAULT now())")
    conn.execute(f"CREATE INDEX {table}_stream ON {table} (stream_id)")
    conn.execute(f"CREATE TABLE {table}_meta (kind text NOT NULL, name text NOT NULL, data bytea NOT NULL,"
                 " created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (kind, name))")


def legacy_pg_row(conn: Any, table: str, *, key: str, data: bytes, stream_id: str, principal: str) -> None:
    conn.execute(f"INSERT INTO {table} (key, stream_id, principal, data, sha256, size) VALUES (%s, %s, %s, %s, %s, %s)",
                 (key, stream_id, principal, data, hashlib.sha256(data).digest(), len(data)))


def to_version_1(blob: bytes, keyring: Keyring) -> bytes:
    """A version-2 checkpoint rewritten as the version before it wrote it (the same plaintext, its
    bound fields and schema in clear); anything else returned as it is."""
    from mamba_stream.state_codec.codec import _decrypt_body, _header, _open_envelope

    try:
        env = _open_envelope(blob)
        version, bound, schema_json = _header(env, keyring)
    except Exception:  # noqa: BLE001 - a record, not a checkpoint
        return blob
    if version != 2:
        return blob
    buf, length = _decrypt_body(env, keyring.key(env.fields["kid"]))
    plain = bytes(buf.numpy()[:length])
    kid, nonce = keyring.active_id, os.urandom(12)
    prefix = b"\x87" + b"".join(
        msgpack.packb(k) + msgpack.packb(v)
        for k, v in (("v", 1), ("alg", "AES-256-GCM"), ("kid", kid), ("nonce", nonce), ("bound", bound),
                     ("schema", schema_json))
    ) + msgpack.packb("ct") + b"\xc6" + struct.pack(">I", len(plain) + 16)
    return prefix + AESGCM(keyring.key(kid)).encrypt(nonce, plain, prefix)


def downgrade_meta(store: Any, keyring: Keyring) -> None:
    """The prefix store's scope and index records as the version before wrote them: clear JSON."""
    from mamba_stream.state_codec.codec import open_bytes

    for tag, data in store.read_meta(kind="prefix-scopes").items():
        store.put_meta(kind="prefix-scopes", name=tag, data=open_bytes(data, binding=f"prefix-scope|{tag}",
                                                                      keyring=keyring))
        kind = f"prefix.{tag}"
        for eid, rec in store.read_meta(kind=kind).items():
            obj = json.loads(open_bytes(rec, binding=f"prefix-index|{kind}|{eid}", keyring=keyring))
            obj.pop("generation", None)
            obj["v"] = 1
            store.put_meta(kind=kind, name=eid, data=json.dumps(obj, separators=(",", ":")).encode())


def downgrade_file_store(root: Path, keyring: Keyring, names: list[str]) -> int:
    """Every object of a file store as the version before wrote it; how many."""
    by_tag = {keyring.principal_tag(n): n for n in names}
    n = 0
    for path in sorted((root / "objects").rglob("*")):
        if not path.is_file():
            continue
        raw = path.read_bytes()
        assert raw[:5] == b"MSSB\x02"
        (hlen,) = struct.unpack_from("<I", raw, 5)
        header = json.loads(raw[9 : 9 + hlen])
        legacy_file_object(root, key=path.name, data=to_version_1(raw[9 + hlen :], keyring),
                           stream_id=header["stream_id"], principal=by_tag[header["owner"]])
        n += 1
    return n


def downgrade_pg_rows(conn: Any, table: str, keyring: Keyring, names: list[str]) -> int:
    """Every row of a legacy-layout table as the version before wrote it; how many."""
    by_tag = {keyring.principal_tag(n): n for n in names}
    rows = conn.execute(f"SELECT key, principal, data FROM {table}").fetchall()
    for key, owner, data in rows:
        old = to_version_1(bytes(data), keyring)
        conn.execute(f"UPDATE {table} SET principal = %s, data = %s, sha256 = %s, size = %s WHERE key = %s",
                     (by_tag[owner], old, hashlib.sha256(old).digest(), len(old), key))
    return len(rows)
