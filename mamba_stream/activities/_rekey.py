"""Rekeying a store written before its owners were tagged: nothing in clear left at rest.

A store written by an earlier version names each object's principal in clear (the file store's
object header, the PostgreSQL store's `principal` column), keeps a sha256 of each, writes every
checkpoint's bound fields (principal, stream, position...) in clear in the blob's envelope, and
keeps the prefix store's index and scope records as clear JSON (a receipt with the state's
checksum: a guessed prompt could be confirmed against it offline). Such a store is still read as
before; `rekey_store` rewrites what it holds so that it says nothing:

    legacy object       -> owned by the principal's keyed tag, no digest (`StateStore.rewrite`)
    its checkpoint blob -> envelope version 2: the same plaintext, header sealed (`codec.reseal`)
    clear index/scope   -> sealed records (`PrefixStore.rekey`)

Every step is conditional on the object or record still being what was read, so it runs beside
live workers; and it is idempotent: run again it finds nothing. Every worker's sweep runs it, and
`mamba-stream rekey-store` runs it at once.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from mamba_stream.activities._prefix import PrefixStore
from mamba_stream.activities._store import StateStore
from mamba_stream.state_codec import StateRejected
from mamba_stream.state_codec.codec import Keyring, is_clear_header, reseal

__all__ = ["RekeyReport", "rekey_store"]

log = logging.getLogger(__name__)


@dataclass
class RekeyReport:
    """What a rekey did."""

    objects: int = 0  # legacy objects rewritten owned by a tag
    resealed: int = 0  # of them, checkpoints whose envelope was rewritten with its header sealed
    records: int = 0  # prefix index and scope records sealed
    unreadable: int = 0  # legacy checkpoints left as they are: they did not authenticate under this keyring


def rekey_store(store: StateStore, keyring: Keyring, prefixes: PrefixStore | None = None) -> RekeyReport:
    """Rewrite every legacy object and clear record of `store` keyed (see the module docstring).

    Args:
        keyring: the workers' master keyring (the one that sealed the store's checkpoints).
        prefixes: the worker's prefix store (default: one over `store` and `keyring`).
    """
    rep = RekeyReport()
    for obj in store.legacy_objects():
        owner = keyring.principal_tag(obj.principal)
        data = store.get(key=obj.key, owner=owner, legacy=obj.principal)
        if data is None:  # deleted, or rewritten by another worker, meanwhile
            continue
        sealed = False
        if is_clear_header(data):
            try:
                data, sealed = reseal(data, keyring), True
            except StateRejected as exc:
                # not ours to read: rewriting it would lose nothing but would hide what it is
                log.warning("rekey: %s does not authenticate under this keyring (%s): left as it is", obj.key, exc)
                rep.unreadable += 1
                continue
        if store.rewrite(key=obj.key, data=data, owner=owner, legacy=obj.principal):
            rep.objects += 1
            rep.resealed += sealed
    with contextlib.suppress(NotImplementedError):  # a store that keeps no metadata holds no prefix records
        rep.records = (prefixes or PrefixStore(store, keyring)).rekey()
    if rep.objects or rep.records or rep.unreadable:
        log.info("rekeyed %s: %d objects (%d checkpoints resealed), %d prefix records; %d unreadable left",
                 store.url, rep.objects, rep.resealed, rep.records, rep.unreadable)
    return rep
