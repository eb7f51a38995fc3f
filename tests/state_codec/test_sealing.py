"""Checkpoint keys: one format (`format_state_key`), one parser (`parse_state_key`), for the open,
reset and chunk states alike (issue 31: open and reset keys once ended in an empty digest, which the
parser did not read, so a revoking reset left them)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mamba_stream.state_codec import StateKey, format_state_key, parse_state_key, record_key

DIGEST = "0123456789abcdef" * 2


@given(stream=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True),
       epoch=st.integers(0, 2**40), seq=st.integers(0, 2**40),
       digest=st.from_regex(r"[0-9a-f]{32}", fullmatch=True))
def test_every_key_formatted_parses_back_and_its_record_only_with_records(stream: str, epoch: int, seq: int,
                                                                       digest: str):
    key = format_state_key(stream, epoch, seq, digest)
    assert parse_state_key(key) == StateKey(stream, epoch, seq)
    rec = record_key(key)
    assert parse_state_key(rec) is None  # a record is not a checkpoint
    assert parse_state_key(rec, records=True) == StateKey(stream, epoch, seq)


@pytest.mark.parametrize("digest", ["", "0" * 31, "0" * 33, DIGEST.upper(), "sha256:" + DIGEST[:25], "g" * 32])
def test_a_digest_the_parser_would_not_read_is_refused(digest: str):
    with pytest.raises(ValueError):
        format_state_key("s1", 0, 0, digest)


@pytest.mark.parametrize("stream, epoch, seq", [("", 0, 0), ("s1", -1, 0), ("s1", 0, -1), ("s1", True, 0),
                                               ("s\n1", 0, 0)])
def test_a_key_for_no_checkpoint_is_refused(stream: str, epoch: int, seq: int):
    with pytest.raises(ValueError):
        format_state_key(stream, epoch, seq, DIGEST)


def test_keys_written_with_an_empty_digest_still_parse():
    # an earlier version wrote open and reset keys so: a revoke must still find them
    assert parse_state_key("s1.e3.c0.") == StateKey("s1", 3, 0)
    assert parse_state_key("s1.e3.c0..out", records=True) == StateKey("s1", 3, 0)
    assert parse_state_key("s1.e3.c0.x") is None and parse_state_key("s1.e3.c0") is None


def test_a_stream_ids_tag_is_parsed_once_and_its_head_is_what_ids_begin_with():
    """`stream_tag` runs for every payload the codec sees, with the same id: memoized (a mend put
    the cache on its neighbour once). `stream_id_head` is what `new_stream_id` and the stores'
    `streams_of` begin with, and `stream_tag` reads it back."""
    import uuid

    from mamba_stream.state_codec import stream_id_head, stream_tag
    from mamba_stream.workflows import new_stream_id

    tag = uuid.uuid4().hex
    sid = new_stream_id(tag)
    assert sid.startswith(stream_id_head(tag)) and stream_tag(sid) == tag
    before = stream_tag.cache_info().hits
    assert stream_tag(sid) == tag and stream_tag.cache_info().hits == before + 1
    assert stream_tag(stream_id_head(tag) + "x" * 31) is None and stream_tag("ms-" + uuid.uuid4().hex) is None
