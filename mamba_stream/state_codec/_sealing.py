"""Who sealed a request: the key that opened a payload, as the workers' codec saw it.

Anyone who reaches the Temporal frontend can send any workflow an update, a signal or a start
input. What a request says about itself (its `principal` field) proves nothing; the key that
encrypted it does. The workers' payload codec (`state_codec.payload.EncryptionCodec`) writes, on
every payload it decodes, which key opened it, under `SEALER_KEY` in the decoded payload's
metadata, overwriting whatever the sender put there:

    <32 hex digits>   the history key of the principal with that tag (`state_codec.keyring`)
    "master"          the workers' own key: the operator (the codec server's operator token, or
                      a master keyring encoding for no stream)
    "clear"           nobody's: the payload was not encrypted

The payload converter copies it onto the request model it decodes (`SEALED_ATTR`, a private
attribute, never serialized), and the stream workflow compares it with the tag its own id names
(`stream_tag`): a stream tagged for bob acts only on what bob's key or the workers' sealed.

Standard library only: the workflow sandbox imports this.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["CLEAR", "FAILURE_SEALER_ATTR", "MASTER", "SEALED_ATTR", "SEALER_KEY", "TAG", "StateKey",
           "format_state_key", "parse_state_key", "record_key", "sealer_of", "stream_id_head", "stream_tag"]

#: the metadata key the workers' codec writes on each payload it decodes
SEALER_KEY = "mamba-stream-sealer"
#: sealed under the workers' master key: the operator's act
MASTER = "master"
#: not encrypted at all
CLEAR = "clear"
#: the private attribute of a request model that holds its sealer
SEALED_ATTR = "_sealer"
#: the attribute of a failure's exception that holds who sealed the failure (its encoded attributes):
#: a stream's activity can be failed by its id from outside, with a failure of the caller's own
FAILURE_SEALER_ATTR = "mamba_stream_sealer"
#: a principal's tag: 32 hex digits (`state_codec.keyring`)
TAG = re.compile(r"^[0-9a-f]{32}$")


def stream_id_head(tag: str) -> str:
    """What every stream id of principal tag `tag` begins with: `ms.<tag>.` (then 32 hex digits)."""
    return f"ms.{tag}."


@functools.lru_cache(maxsize=4096)  # the codec asks for every payload of a stream, with the same id
def stream_tag(workflow_id: str) -> str | None:
    """The principal tag a stream id names (`ms.<tag>.<32 hex>`, `workflows.new_stream_id`), or None
    (an id of another form: its payloads are under the master key)."""
    parts = workflow_id.split(".")
    if len(parts) == 3 and parts[0] == "ms" and TAG.match(parts[1]) and len(parts[2]) == 32:
        return parts[1]
    return None


def sealer_of(value: Any) -> str | None:
    """Who sealed `value` (a tag, `MASTER` or `CLEAR`): a request or an activity's result, as its
    payload converter recorded; a failure's exception, as the failure converter did. None for one
    that did not come through the workers' codec (built in code, a failure with no encoded
    attributes)."""
    if isinstance(value, BaseException):
        found = getattr(value, FAILURE_SEALER_ATTR, None)
    else:
        found = (getattr(value, "__pydantic_private__", None) or {}).get(SEALED_ATTR)
    return found if isinstance(found, str) else None


#: every checkpoint key, the open, reset and chunk states' alike (`format_state_key`):
#: `<stream id>.e<epoch>.c<chunk seq>.<32 hex>`. Keys written before the digest was keyed may end
#: in an empty one (`<stream id>.e0.c0.`): they still parse, so a revoke or a sweep finds them.
_STATE_KEY = re.compile(r"^(?P<stream>.+)\.e(?P<epoch>\d+)\.c(?P<seq>\d+)\.(?P<digest>[0-9a-f]{32}|)$")
_DIGEST = re.compile(r"[0-9a-f]{32}")
#: a result record's key is its checkpoint's key + this
_RECORD = ".out"


@dataclass(frozen=True)
class StateKey:
    """A checkpoint key, parsed (`parse_state_key`)."""

    stream_id: str
    epoch: int
    chunk_seq: int


def format_state_key(stream_id: str, epoch: int, chunk_seq: int, digest: str) -> str:
    """The key of the stream's checkpoint at (`epoch`, `chunk_seq`): the one format every
    checkpoint key has, open, reset and chunk states alike; `digest` is 32 lowercase hex digits
    (a keyed digest of what the state is). Anything else is a ValueError: a key this refuses is
    one that `parse_state_key`, and so a revoke, a retention drop and a sweep, would not find."""
    if not stream_id or type(epoch) is not int or type(chunk_seq) is not int or epoch < 0 or chunk_seq < 0:
        raise ValueError(f"no checkpoint key for stream {stream_id!r}, epoch {epoch!r}, chunk {chunk_seq!r}")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"a checkpoint key's digest is 32 lowercase hex digits, not {digest!r}")
    key = f"{stream_id}.e{epoch}.c{chunk_seq}.{digest}"
    if parse_state_key(key) != StateKey(stream_id, epoch, chunk_seq):  # e.g. a line break in the id
        raise ValueError(f"stream id {stream_id!r} makes a key the parser does not read back")
    return key


def record_key(state_key: str) -> str:
    """Where the result of the chunk that committed `state_key` is recorded."""
    return state_key + _RECORD


def parse_state_key(key: str, *, records: bool = False) -> StateKey | None:
    """The stream, epoch and chunk a checkpoint key names; None for any other key. With
    `records`, a result record's key (`record_key`) parses too, as its checkpoint's."""
    if records and key.endswith(_RECORD):
        key = key[: -len(_RECORD)]
    m = _STATE_KEY.match(key)
    return StateKey(m.group("stream"), int(m.group("epoch")), int(m.group("seq"))) if m else None
