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
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import tempfile
from collections.abc import Mapping
from pathlib import Path

from state_codec._errors import UnknownKeyId

__all__ = ["KEYRING_FILE", "Keyring", "KeyringError", "KeyringNotFound", "default_home", "find_keyring"]

_KEY_BYTES = 32
#: the keyring's file name under the home
KEYRING_FILE = "keyring.json"


class KeyringError(Exception):
    """A keyring file or variable is missing, malformed or readable by others."""


class KeyringNotFound(KeyringError):
    """No keyring where a client looks; the message names the places and the settings."""

    reason = "KeyringNotFound"


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

    def __init__(self, keys: Mapping[str, bytes], active: str) -> None:
        if active not in keys:
            raise KeyringError(f"active key {active!r} is not in the keyring")
        for kid, key in keys.items():
            if not isinstance(key, (bytes, bytearray)) or len(key) != _KEY_BYTES:
                raise KeyringError(f"key {kid!r} must be {_KEY_BYTES} bytes")
        self._keys = {k: bytes(v) for k, v in keys.items()}
        self._active = active

    @staticmethod
    def _new_id() -> str:
        return "k" + secrets.token_hex(6)

    @classmethod
    def generate(cls) -> Keyring:
        kid = cls._new_id()
        return cls({kid: secrets.token_bytes(_KEY_BYTES)}, kid)

    def rotate(self) -> Keyring:
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
        return json.dumps({"active": self._active,
                           "keys": {k: base64.b64encode(v).decode() for k, v in self._keys.items()}})

    @classmethod
    def from_json(cls, text: str) -> Keyring:
        try:
            data = json.loads(text)
            keys = {k: base64.b64decode(v, validate=True) for k, v in data["keys"].items()}
            return cls(keys, data["active"])
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
        return f"Keyring(active={self._active!r}, ids={self.ids})"


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
