"""What a stream workflow remembers besides its receipt: the token log and the recent results.

Both are plain, deterministic classes (no Temporal API): the workflow holds one of each, carries
part of each across continue-as-new, and tests exercise them without a server
(tests/workflows/test_records.py).

Sandbox-safe: the standard library, pydantic and the workflow's models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mamba_stream.state_codec import parse_state_key
from mamba_stream.workflows._models import ReadTokensRequest, RecentResult, TokenBatch, TokenEvent

__all__ = ["LOG_BYTES", "READ_BYTES", "RecentResults", "TokenLog", "chunk_seq_of"]

#: the most a token read returns, in JSON bytes, past its first entry (a query's answer is one payload)
READ_BYTES = 512 * 1024
#: the most the token log holds, in JSON bytes, past its newest entry (it is workflow memory, on
#: every worker that caches the stream)
LOG_BYTES = 2 * 1024 * 1024


class TokenLog:
    """A stream's token log: each finished generate's tokens and text, and each failed generate's
    end, for readers (the `read_tokens` query). Kept in memory and carried across continue-as-new
    in part, never in history. Entries are numbered by offset from the stream's first; the oldest
    leave past `max_events` entries or `LOG_BYTES` bytes (the newest always stays), and `base`
    is the offset of the oldest still kept."""

    def __init__(self, max_events: int, base: int = 0, entries: Iterable[TokenEvent] = ()) -> None:
        """`entries`: a carry's (their offsets set, the first at `base`)."""
        self._max_events = max_events
        self._events: list[TokenEvent] = []
        self._sizes: list[int] = []  # each entry's JSON bytes
        self._base = base
        for ev in entries:
            self._keep(ev)

    @property
    def base(self) -> int:
        """The offset of the oldest entry kept (older ones were dropped)."""
        return self._base

    @property
    def end(self) -> int:
        """Where the log ends: a reader that starts here gets what comes next."""
        return self._base + len(self._events)

    def append(self, ev: TokenEvent) -> TokenEvent:
        """Add an entry at the end (its offset set: returned), dropping the oldest past the bounds."""
        ev = ev.model_copy(update={"offset": self.end})
        self._keep(ev)
        return ev

    def _keep(self, ev: TokenEvent) -> None:
        self._events.append(ev)
        self._sizes.append(len(ev.model_dump_json()))
        excess = max(len(self._events) - self._max_events, 0)
        total = sum(self._sizes[excess:])
        while excess < len(self._events) - 1 and total > LOG_BYTES:
            total -= self._sizes[excess]
            excess += 1
        if excess > 0:
            del self._events[:excess], self._sizes[:excess]
            self._base += excess

    def read(self, req: ReadTokensRequest, *, closed: bool = False) -> TokenBatch:
        """The entries a read gets: at least one if there are any, then as many as `max_events`
        and `READ_BYTES` allow; the next read starts after the last one returned, or at the log's
        end when none were held back. `closed`: the stream takes nothing more (said when the
        read found nothing)."""
        events: list[TokenEvent] = []
        size, full = 0, False
        for ev, n in self._entries(req, req.max_events):
            size += n
            if events and size > READ_BYTES:
                full = True
                break
            events.append(ev)
        full = full or len(events) == req.max_events
        nxt = events[-1].offset + 1 if full else max(req.from_offset, self.end)
        return TokenBatch(events=events, next_offset=nxt, base_offset=self._base, closed=closed and not events,
                          more=full)

    def _entries(self, req: ReadTokensRequest, limit: int) -> list[tuple[TokenEvent, int]]:
        start = max(req.from_offset - self._base, 0)
        out = []
        for ev, n in zip(self._events[start:], self._sizes[start:], strict=True):
            if (req.chunk_seq is None or ev.chunk_seq == req.chunk_seq) and \
                    (req.update_id is None or ev.update_id == req.update_id):
                out.append((ev, n))
                if len(out) >= limit:
                    break
        return out

    def carried(self, room: int) -> tuple[list[TokenEvent], int]:
        """The newest entries whose JSON fits `room` bytes, oldest first, and the offset of the first
        (what continue-as-new carries: `StreamCarry.token_log`, `token_base`)."""
        out: list[TokenEvent] = []
        for ev, size in zip(reversed(self._events), reversed(self._sizes), strict=True):
            room -= size
            if room < 0:
                break
            out.append(ev)
        return out[::-1], self.end - len(out)


def chunk_seq_of(rec: RecentResult) -> int:
    """The chunk a recent result is for (-1: an entry that names none)."""
    if rec.chunk_seq is not None:
        return rec.chunk_seq
    res = rec.advance or rec.generate
    return res.chunk_seq if res is not None else -1


def _line(rec: RecentResult) -> tuple[int, int]:
    """(epoch, chunk_seq) of the chunk a recent result is for."""
    res = rec.advance or rec.generate
    if res is not None:
        return res.receipt.epoch, res.chunk_seq
    parsed = parse_state_key(rec.state_key) if rec.state_key else None
    return (parsed.epoch if parsed else 0), chunk_seq_of(rec)


def _digest_only(rec: RecentResult) -> RecentResult:
    """`rec` without its result: the id, digest, sequence and where the result is recorded."""
    res = rec.advance or rec.generate
    assert res is not None
    return RecentResult(update_id=rec.update_id, digest=rec.digest, kind="advance" if rec.advance else "generate",
                        chunk_seq=res.chunk_seq, state_key=res.receipt.state_key)


class RecentResults:
    """The results of a stream's newest committed chunks, by update id and by chunk sequence: a
    repeated update id, or the same chunk sent again under another id, is answered with the
    first result instead of running again. Bounded by `limit` entries, oldest out first."""

    def __init__(self, limit: int, entries: Iterable[RecentResult] = ()) -> None:
        """`entries`: a carry's, oldest first (kept whole: the run that carried them bounded them)."""
        self._limit = limit
        self._by_id: dict[str, RecentResult] = {r.update_id: r for r in entries}
        self._by_seq: dict[int, RecentResult] = {chunk_seq_of(r): r for r in self._by_id.values()}

    def __len__(self) -> int:
        return len(self._by_id)

    def by_id(self, update_id: str) -> RecentResult | None:
        return self._by_id.get(update_id)

    def by_seq(self, chunk_seq: int) -> RecentResult | None:
        """The newest result remembered for chunk `chunk_seq`."""
        return self._by_seq.get(chunk_seq)

    def remember(self, rec: RecentResult) -> None:
        self._by_id[rec.update_id] = rec
        self._by_seq[chunk_seq_of(rec)] = rec
        while len(self._by_id) > self._limit:
            old = self._by_id.pop(next(iter(self._by_id)))
            if self._by_seq.get(chunk_seq_of(old)) is old:
                del self._by_seq[chunk_seq_of(old)]

    def keep_only(self, keep: Callable[[RecentResult], bool]) -> None:
        """Forget every entry `keep` refuses."""
        self._by_id = {u: r for u, r in self._by_id.items() if keep(r)}
        self._by_seq = {chunk_seq_of(r): r for r in self._by_id.values()}

    def up_to(self, epoch: int, chunk_seq: int) -> None:
        """Forget the results of chunks after (epoch, chunk_seq): a rewind's line keeps its own."""
        self.keep_only(lambda r: _line(r) <= (epoch, chunk_seq))

    def carried(self, budget: int) -> list[RecentResult]:
        """What crosses continue-as-new, oldest first, bounded by bytes: the newest results in full
        while they fit `budget`, older ones (up to `limit` in all) as digests, answered from the
        store's records, while those fit another `budget`: at most twice `budget` of results,
        whatever the chunks' sizes."""
        full, digests = budget, budget
        kept: list[RecentResult] = []
        for rec in reversed(list(self._by_id.values())[-self._limit :]):
            if rec.advance is not None or rec.generate is not None:
                size = len(rec.model_dump_json())
                if size <= full:
                    full -= size
                    kept.append(rec)
                    continue
                rec = _digest_only(rec)
            digests -= len(rec.model_dump_json())
            if digests < 0:
                break
            kept.append(rec)
        return kept[::-1]
