"""The keyring: AES-256 keys by id (standard library only, so clients load it without the codec).

Workers make keys; clients only find them. `find_keyring` is the one place both look:

    MAMBA_STREAM_KEYRING   keyring JSON, or the path of a 0600 keyring file
    $MAMBA_STREAM_HOME/keyring.json
                           otherwise; the home defaults to the per-user data directory
                           ($XDG_DATA_HOME/mamba-stream, else ~/.local/share/mamba-stream),
                           never the current directory

A worker (`python worker.py`) creates the home's keyring on first use (`create=True`); a client
that finds none raises `KeyringNotFound`, naming where it looked and what to set, instead of
making a keyring the workers do not hold (its payloads would be unreadable to them).

Two kinds of keyring. The workers' master keyring holds the keys themselves. A principal's
keyring (`Keyring.for_principal`, exported by `mamba-stream export-keys`) holds, for each master
key id, only the history key of that principal, derived from the master key through the
principal's tag, a keyed hash that names the principal in stream ids and payloads without
saying who it is:

    tag (principal)       = HMAC-SHA256(HMAC-SHA256("mamba-stream/principal-tag/v1", oldest master key),
                                        principal)[:16], in hex
    history key (kid, tag) = HMAC-SHA256(HMAC-SHA256("mamba-stream/history-key/v1", master[kid]),
                                         tag || 0x01)                   (HKDF-SHA256, one block)

A stream's payloads are encrypted under its principal's history key (state_codec.payload), so a
client provisioned with alice's keyring reads alice's streams and no one else's; the workers
derive every principal's key from the master. Rotating the master keeps old payloads readable:
an export carries the derived key of every master key id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from collections.abc import Mapping
from pathlib import Path

from mamba_stream.failures import Failure
from mamba_stream.state_codec._errors import UnknownKeyId
from mamba_stream.state_codec._sealing import TAG

__all__ = ["KEYRING_FILE", "Keyring", "KeyringError", "KeyringNotFound", "default_home", "find_keyring"]

_KEY_BYTES = 32
#: the keyring's file name under the home
KEYRING_FILE = "keyring.json"
_HISTORY_SALT = b"mamba-stream/history-key/v1"
_TAG_SALT = b"mamba-stream/principal-tag/v1"
_SUBKEY_SALT = b"mamba-stream/worker-subkey/v1"
_ID_SALT = b"mamba-stream/update-id/v1"


def history_key(master: bytes, tag: str) -> bytes:
    """The history key of the principal with `tag`, under one master key (HKDF-SHA256, one block)."""
    prk = hmac.new(_HISTORY_SALT, master, hashlib.sha256).digest()
    return hmac.new(prk, tag.encode() + b"\x01", hashlib.sha256).digest()


class KeyringError(Failure):
    """A keyring file or variable is missing, malformed or readable by others."""


class KeyringNotFound(KeyringError):
    """No keyring where a client looks; the message names the places and the settings."""


def default_home() -> Path:
    """$MAMBA_STREAM_HOME, else the per-user data directory (absolute: never the working directory)."""
    if os.environ.get("MAMBA_STREAM_HOME"):
        return Path(os.environ["MAMBA_STREAM_HOME"]).expanduser().resolve()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return (Path(base).expanduser() / "mamba-stream").resolve()


class Keyring:
    """AES-256 keys by id: one active key for writing, older ones kept for reading.

    Keys never live in source code: a keyring is generated (`Keyring.generate()`), loaded from a
    file readable by its owner only (`Keyring.from_file`) or from an environment variable holding
    the same JSON (`Keyring.from_env`). `rotate()` returns a keyring with a new active key that
    still reads every older one.
    """

    def __init__(self, keys: Mapping[str, bytes], active: str, *, principal: str | None = None,
                 tag: str | None = None) -> None:
        if (principal is None) != (tag is None) or (tag is not None and not TAG.match(tag)):
            raise KeyringError("a principal's keyring names its principal and its 32-hex-digit tag")
        self.principal = principal  # None: the master keyring
        self.tag = tag
        if active not in keys:
            raise KeyringError(f"active key {active!r} is not in the keyring")
        for kid, key in keys.items():
            if not isinstance(key, (bytes, bytearray)) or len(key) != _KEY_BYTES:
                raise KeyringError(f"key {kid!r} must be {_KEY_BYTES} bytes")
        self._keys = {k: bytes(v) for k, v in keys.items()}
        self._active = active
        # derived once per principal / stream tag: a chunk names its principal's tag and its
        # stream's id key several times (two HMACs each); the keys they come from never change
        self._tags: dict[str, str] = {}
        self._id_keys: dict[str | None, bytes] = {}

    @staticmethod
    def _new_id() -> str:
        return "k" + secrets.token_hex(6)

    @classmethod
    def generate(cls) -> Keyring:
        kid = cls._new_id()
        return cls({kid: secrets.token_bytes(_KEY_BYTES)}, kid)

    def principal_tag(self, principal: str) -> str:
        """The tag of `principal` (see the module docstring): computed from the master keyring's
        oldest key, so rotation keeps it; a principal's keyring knows its own only."""
        if self.principal is not None:
            if principal != self.principal:
                raise KeyringError(f"this keyring is {self.principal!r}'s; it knows no other principal's tag")
            assert self.tag is not None
            return self.tag
        tag = self._tags.get(principal)
        if tag is None:
            oldest = next(iter(self._keys.values()))
            secret = hmac.new(_TAG_SALT, oldest, hashlib.sha256).digest()
            tag = hmac.new(secret, principal.encode(), hashlib.sha256).hexdigest()[:32]
            if len(self._tags) < 4096:  # bounded: a worker sees many principals over its life
                self._tags[principal] = tag
        return tag

    def subkey(self, label: str) -> bytes:
        """A 32-byte key for one purpose (`label`), derived from the master keyring's oldest key:
        the same on every worker that holds the keyring, before and after rotation. Workers key
        what must be deterministic yet unguessable with it (state keys, carry seals)."""
        if self.principal is not None:
            raise KeyringError(f"only the master keyring derives the workers' keys (this one is {self.principal!r}'s)")
        oldest = next(iter(self._keys.values()))
        return hmac.new(hmac.new(_SUBKEY_SALT, oldest, hashlib.sha256).digest(), label.encode(),
                        hashlib.sha256).digest()

    def id_key(self, tag: str | None) -> bytes:
        """The key of the update ids of a stream whose id names `tag` (None: a stream under the
        master key): from that principal's history key under the oldest key id, so the principal's
        own keyring and the master derive the same, before and after a rotation."""
        found = self._id_keys.get(tag)
        if found is not None:
            return found
        kid = self.ids[0]
        if tag is None:
            if self.principal is not None:
                raise UnknownKeyId("a principal's keyring holds no key for a stream under the master key",
                                   field="tag", expected=self.tag, actual=None)
            base = self.key(kid)
        else:
            base = self.history_key(kid, tag)
        found = hmac.new(base, _ID_SALT, hashlib.sha256).digest()
        if len(self._id_keys) < 4096:
            self._id_keys[tag] = found
        return found

    def for_principal(self, principal: str) -> Keyring:
        """The keyring of one principal: its history key under every master key id, nothing else."""
        if self.principal is not None:
            raise KeyringError(f"only the master keyring derives principals' keys (this one is {self.principal!r}'s)")
        tag = self.principal_tag(principal)
        return Keyring({kid: history_key(k, tag) for kid, k in self._keys.items()}, self._active,
                       principal=principal, tag=tag)

    def history_key(self, kid: str, tag: str) -> bytes:
        """The history key under master key `kid` of the principal with `tag`: derived from the
        master, or (a principal's keyring) its own. UnknownKeyId for one this keyring cannot have."""
        if self.principal is None:
            return history_key(self.key(kid), tag)
        if tag != self.tag:
            raise UnknownKeyId(f"the payload is encrypted under another principal's history key; this keyring "
                               f"holds {self.principal!r}'s only", field="tag", expected=self.tag, actual=tag)
        return self.key(kid)

    def rotate(self) -> Keyring:
        if self.principal is not None:
            raise KeyringError("a principal's keyring is exported from the master keyring, not rotated")
        kid = self._new_id()
        return Keyring({**self._keys, kid: secrets.token_bytes(_KEY_BYTES)}, kid)

    @property
    def active_id(self) -> str:
        return self._active

    @property
    def ids(self) -> list[str]:
        return list(self._keys)

    def key(self, kid: str) -> bytes:
        try:
            return self._keys[kid]
        except KeyError:
            raise UnknownKeyId(f"key id {kid!r} is not in this keyring", field="kid",
                               expected=sorted(self._keys), actual=kid) from None

    def to_json(self) -> str:
        data = {"active": self._active, "keys": {k: base64.b64encode(v).decode() for k, v in self._keys.items()}}
        if self.principal is not None:
            data["principal"], data["tag"] = self.principal, self.tag
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> Keyring:
        try:
            data = json.loads(text)
            keys = {k: base64.b64decode(v, validate=True) for k, v in data["keys"].items()}
            return cls(keys, data["active"], principal=data.get("principal"), tag=data.get("tag"))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KeyringError(f"malformed keyring: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> Keyring:
        p = Path(path)
        try:
            mode = p.stat().st_mode
        except FileNotFoundError:
            raise KeyringError(f"no keyring at {p}") from None
        if mode & 0o077:
            raise KeyringError(f"{p} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
        return cls.from_json(p.read_text())

    @classmethod
    def from_env(cls, var: str = "MAMBA_STREAM_KEYRING") -> Keyring:
        text = os.environ.get(var)
        if not text:
            raise KeyringError(f"${var} is not set")
        return cls.from_json(text)

    @classmethod
    def from_spec(cls, spec: str) -> Keyring:
        """`spec` is keyring JSON, or the path of a keyring file (what MAMBA_STREAM_KEYRING holds)."""
        text = spec.strip()
        return cls.from_json(text) if text.startswith("{") else cls.from_file(Path(text).expanduser())

    def save(self, path: str | Path) -> None:
        """Write atomically with mode 0600 (its directory 0700 when this creates it)."""
        p = Path(path)
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".keyring-")
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(self.to_json())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load_or_generate(cls, path: str | Path) -> Keyring:
        """The keyring at `path`, created (0600) on first use: for workers, never for clients."""
        p = Path(path)
        if p.exists():
            return cls.from_file(p)
        ring = cls.generate()
        ring.save(p)
        return ring

    def __repr__(self) -> str:
        who = "" if self.principal is None else f", principal={self.principal!r}"
        return f"Keyring(active={self._active!r}, ids={self.ids}{who})"


def find_keyring(spec: str | None = None, home: str | Path | None = None, *, create: bool = False) -> Keyring:
    """The keyring a process should use.

    Args:
        spec: keyring JSON or a file path (default $MAMBA_STREAM_KEYRING).
        home: where `keyring.json` lives otherwise (default `default_home()`).
        create: make the home's keyring when there is none. Workers only: a client that made
            its own keyring would encrypt what no worker can read.

    Raises:
        KeyringNotFound: neither `spec` nor the home's keyring exists, and not `create`.
        KeyringError: what was found is malformed or readable by others.
    """
    spec = spec or os.environ.get("MAMBA_STREAM_KEYRING")
    if spec:
        return Keyring.from_spec(spec)
    path = (Path(home).expanduser().resolve() if home is not None else default_home()) / KEYRING_FILE
    if path.exists():
        return Keyring.from_file(path)
    if create:
        return Keyring.load_or_generate(path)
    raise KeyringNotFound(
        f"no keyring: MAMBA_STREAM_KEYRING is unset and {path} does not exist; set MAMBA_STREAM_KEYRING "
        f"(the workers' keyring JSON or file) or MAMBA_STREAM_HOME (the workers' home directory), "
        f"or start `python worker.py` first, which creates {KEYRING_FILE} in its home")
