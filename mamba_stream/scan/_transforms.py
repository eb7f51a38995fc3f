"""Input transforms: text <-> token ids, each with an id and a revision.

A stream is bound to one transform: the same text under another tokenizer is another token
sequence, so receipts record `transform_id` and `revision` and resume checks both.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["ByteTransform", "HFTokenizerTransform", "InputTransform"]


@runtime_checkable
class InputTransform(Protocol):
    transform_id: str
    revision: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTransform:
    """UTF-8 bytes as token ids 0..255 (the presets' vocabulary)."""

    transform_id = "bytes"
    revision = "utf-8/v1"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTransform()"


class HFTokenizerTransform:
    """A Hugging Face `tokenizers` tokenizer.json; revision = sha256 of the file.

    `eos_token_id`: the tokenizer's end-of-sequence token, where the files beside tokenizer.json
    name one (tokenizer_config.json's or special_tokens_map.json's `eos_token`, a token of the
    tokenizer's vocabulary); else None. tokenizer.json alone does not say which token ends a text.
    """

    transform_id = "hf-tokenizers"
    #: files beside tokenizer.json that may name its end-of-sequence token, first found wins
    EOS_FILES = ("tokenizer_config.json", "special_tokens_map.json")

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("HFTokenizerTransform needs the 'tokenizers' package") from exc
        self.path = Path(path)
        data = self.path.read_bytes()
        self.revision = "sha256:" + hashlib.sha256(data).hexdigest()
        self._tok = Tokenizer.from_str(data.decode("utf-8"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id: int | None = self._eos_token_id()

    def _eos_token_id(self) -> int | None:
        for name in self.EOS_FILES:
            f = self.path.parent / name
            if not f.is_file():
                continue
            try:
                eos = json.loads(f.read_text()).get("eos_token")
            except (OSError, ValueError, AttributeError):
                continue  # unreadable, or not a JSON object: it names no token, and the next may
            if isinstance(eos, dict):  # an AddedToken written out: {"content": "</s>", ...}
                eos = eos.get("content")
            if isinstance(eos, str):
                return self._tok.token_to_id(eos)
        return None

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizerTransform({str(self.path)!r}, revision={self.revision[:19]}...)"
