"""The stream workflow's token log and recent results, without a server (workflows._records)."""

from __future__ import annotations

import pytest

from mamba_stream.state_codec import Receipt
from mamba_stream.workflows import AdvanceResult, TokenEvent
from mamba_stream.workflows._models import ReadTokensRequest, RecentResult
from mamba_stream.workflows._records import LOG_BYTES, READ_BYTES, RecentResults, TokenLog, chunk_seq_of


def _ev(seq: int, n: int = 3, text: str | None = None, update_id: str | None = None) -> TokenEvent:
    return TokenEvent(chunk_seq=seq, tokens=list(range(n)), text=text, done=True, finish_reason="length",
                      update_id=update_id)


def test_entries_are_numbered_from_the_streams_first_and_the_oldest_leave_past_the_count():
    log = TokenLog(max_events=3)
    got = [log.append(_ev(s)) for s in range(1, 6)]
    assert [e.offset for e in got] == [0, 1, 2, 3, 4]
    assert (log.base, log.end) == (2, 5)
    batch = log.read(ReadTokensRequest(from_offset=0))
    # a reader behind the base gets what is left, and learns where the log now starts
    assert [e.chunk_seq for e in batch.events] == [3, 4, 5] and batch.base_offset == 2
    assert batch.next_offset == 5 and not batch.more and not batch.closed
    # a reader behind the base whose read is cut at its count goes on after the last entry it got
    # (docs/mutants/31-2: counting from the request's offset would read entries 2 and 3 again)
    cut = log.read(ReadTokensRequest(from_offset=0, max_events=2))
    assert [e.offset for e in cut.events] == [2, 3] and cut.more and cut.next_offset == 4
    assert log.read(ReadTokensRequest(from_offset=5)).events == []
    assert log.read(ReadTokensRequest(from_offset=5), closed=True).closed
    assert not log.read(ReadTokensRequest(from_offset=4), closed=True).closed  # closed only once read out


def test_the_oldest_leave_past_the_byte_bound_but_the_newest_always_stays():
    log = TokenLog(max_events=1000)
    big = "x" * (LOG_BYTES // 3)
    for s in range(1, 5):
        log.append(_ev(s, text=big))
    assert log.end == 4 and log.base == 2  # two of a third each fit, three do not
    huge = "y" * (LOG_BYTES + 10)
    log.append(_ev(5, text=huge))
    assert (log.base, log.end) == (4, 5)  # alone past the bound: kept
    assert log.read(ReadTokensRequest()).events[0].text == huge


def test_a_read_holds_back_past_its_count_or_bytes_and_says_where_to_go_on():
    log = TokenLog(max_events=1000)
    for s in range(1, 11):
        log.append(_ev(s, update_id="u-even" if s % 2 == 0 else "u-odd"))
    first = log.read(ReadTokensRequest(max_events=4))
    assert [e.offset for e in first.events] == [0, 1, 2, 3] and first.more and first.next_offset == 4
    rest = log.read(ReadTokensRequest(from_offset=first.next_offset, max_events=100))
    assert [e.offset for e in rest.events] == [4, 5, 6, 7, 8, 9] and not rest.more and rest.next_offset == 10
    # one chunk's or one update's entries only
    assert [e.chunk_seq for e in log.read(ReadTokensRequest(chunk_seq=7)).events] == [7]
    assert [e.chunk_seq for e in log.read(ReadTokensRequest(update_id="u-even")).events] == [2, 4, 6, 8, 10]
    # bytes: at least one entry, however large, then as many as fit READ_BYTES
    wide = TokenLog(max_events=1000)
    for s in range(1, 4):
        wide.append(_ev(s, text="z" * (READ_BYTES // 2 + 1)))
    one = wide.read(ReadTokensRequest())
    assert [e.offset for e in one.events] == [0] and one.more and one.next_offset == 1


def test_what_is_carried_is_the_newest_entries_that_fit_and_a_new_log_continues_them():
    log = TokenLog(max_events=100)
    for s in range(1, 9):
        log.append(_ev(s))
    size = len(log.read(ReadTokensRequest()).events[0].model_dump_json())
    entries, base = log.carried(3 * size)
    assert [e.offset for e in entries] == [5, 6, 7] and base == 5
    again = TokenLog(max_events=100, base=base, entries=entries)
    assert (again.base, again.end) == (5, 8)
    assert again.append(_ev(9)).offset == 8
    assert log.carried(0) == ([], 8)


def _result(seq: int, epoch: int = 0, tokens: int = 1) -> AdvanceResult:
    zero = "sha256:" + "0" * 64
    receipt = Receipt(stream_id="ms.t.1", principal="alice", model_id="m", model_revision=zero, code_revision="c",
                      input_transform="bytes", input_transform_revision="1", schema_fingerprint=zero, schema_version=1,
                      architecture="mamba2", dtype="float32", n_layer=1, d_state=1, state_bytes=4,
                      position=seq * tokens, chunk_seq=seq, epoch=epoch, state_key=f"k-{epoch}-{seq}",
                      checksum=zero, backend="exact")
    return AdvanceResult(stream_id="ms.t.1", chunk_seq=seq, n_tokens=tokens, position=seq * tokens, receipt=receipt,
                         top_k=[], output_digest="d", backend="exact")


def _rec(uid: str, seq: int, epoch: int = 0, digest: str = "d") -> RecentResult:
    return RecentResult(update_id=uid, digest=digest, advance=_result(seq, epoch))


def test_recent_results_are_found_by_id_and_by_chunk_and_the_oldest_leave_past_the_limit():
    recent = RecentResults(limit=3)
    for s in range(1, 6):
        recent.remember(_rec(f"u{s}", s))
    assert len(recent) == 3
    assert recent.by_id("u1") is None and recent.by_seq(2) is None
    assert recent.by_id("u5").advance.chunk_seq == 5 and recent.by_seq(4).update_id == "u4"
    # the same chunk again under another id: both ids answer, the chunk maps to the newest; when
    # the older id leaves, the chunk still maps to the newer
    recent.remember(_rec("u5-again", 5))
    assert recent.by_id("u5") is not None and recent.by_seq(5).update_id == "u5-again"
    recent.remember(_rec("u6", 6))
    recent.remember(_rec("u7", 7))
    # u5 left first: chunk 5 still maps to u5-again, which is still there
    assert recent.by_id("u5") is None and recent.by_seq(5).update_id == "u5-again"
    recent.remember(_rec("u8", 8))
    assert recent.by_id("u5-again") is None and recent.by_seq(5) is None  # both of chunk 5's ids left
    assert [chunk_seq_of(recent.by_id(u)) for u in ("u6", "u7", "u8")] == [6, 7, 8]


def test_a_rewind_forgets_the_results_after_its_target():
    recent = RecentResults(limit=10, entries=[_rec("a", 1), _rec("b", 2), _rec("c", 3), _rec("d", 1, epoch=1)])
    recent.up_to(0, 2)
    assert [recent.by_id(u) is not None for u in "abcd"] == [True, True, False, False]
    assert recent.by_seq(3) is None and recent.by_seq(1).update_id == "a"


def test_the_carry_keeps_the_newest_results_whole_then_digests_within_its_budget():
    recs = [_rec(f"u{s}", s) for s in range(1, 7)]
    recent = RecentResults(limit=10, entries=recs)
    whole = len(recs[0].model_dump_json())
    carried = recent.carried(2 * whole + 10)
    # the two newest whole, older ones as digests (chunk and state key kept), oldest first
    assert [r.update_id for r in carried][-2:] == ["u5", "u6"]
    assert all(r.advance is not None for r in carried[-2:])
    digests = carried[:-2]
    assert digests and all(r.advance is None and r.state_key == f"k-0-{r.chunk_seq}" for r in digests)
    assert sum(len(r.model_dump_json()) for r in digests) <= 2 * whole + 10
    # a carried entry answers in the next run, by id and by chunk
    nxt = RecentResults(limit=10, entries=carried)
    assert nxt.by_id("u6").advance is not None and nxt.by_seq(digests[0].chunk_seq) is not None
    assert RecentResults(limit=10, entries=recs).carried(0) == []


@pytest.mark.parametrize("limit", [1, 2])
def test_the_carry_never_holds_more_than_the_limit(limit: int):
    recent = RecentResults(limit=limit, entries=[_rec(f"u{s}", s) for s in range(1, 6)])
    assert [r.update_id for r in recent.carried(10**6)] == [f"u{s}" for s in range(6 - limit, 6)]
