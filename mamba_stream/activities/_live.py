"""LiveTokens: a streaming generate's newest tokens, heartbeated by its activity while it runs.

Readers see a generate's tokens before it commits through its activity's heartbeat details
(`workflows.TokenProgress`), which the server keeps with the pending activity and returns to
`describe`: no update, no signal, no history event, and nothing a caller other than the worker
running the chunk can write. The engine thread hands each sampled token over (`take`: an
append and an event, never a wait); the activity's own thread, waiting for the chunk
(`StreamEngine.generate(..., on_wait=live.on_wait, wake=live.wake)`), heartbeats the newest
progress as soon as a token arrives and then at most every `PROGRESS_INTERVAL_S`. The SDK's
heartbeat waits for the worker's event loop, so it is never called from the engine thread.

Each heartbeat holds the newest tokens and stable text that fit `PROGRESS_BYTES` (a generate may
be up to 2**20 tokens); building one costs a decode of the chunk's tokens so far, so a chunk
whose decode grows slow heartbeats less often (at most a tenth of the thread's time goes there).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from temporalio import activity

from mamba_stream.activities._engine import WAIT_S
from mamba_stream.workflows import PROGRESS_BYTES, PROGRESS_INTERVAL_S, TokenProgress

__all__ = ["LiveTokens"]

#: bytes of a progress's JSON that are not its tokens or text (field names, ids, numbers)
_OVERHEAD = 512


class LiveTokens:
    """The tokens of one streaming generate chunk, on their way to its heartbeats.

    Args:
        base: the progress's fixed fields (chunk, epoch, update id, log offset, attempt).
        decode: the model's detokenizer, or None (no text).
        send: how a progress is sent (the activity's heartbeat).
        interval, budget: the least seconds between two progresses, and the most JSON bytes of one.
        clock: seconds, monotonic.
    """

    def __init__(self, base: TokenProgress, decode: Callable[[list[int]], str] | None, *,
                 send: Callable[..., None] | None = None, interval: float = PROGRESS_INTERVAL_S,
                 budget: int = PROGRESS_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self._base = base
        self._decode = decode
        self._send = send or activity.heartbeat
        self._interval = interval
        self._budget = budget
        self._clock = clock
        self._tokens: list[int] = []  # appended by the engine thread only
        self.wake = threading.Event()
        self._shown = 0  # tokens in the last progress sent
        self._last = float("-inf")  # when it was sent (monotonic)
        self._cost = 0.0  # seconds the last progress took to build
        self._progress: TokenProgress | None = None
        self.beats = 0  # progresses sent (for the tests and benches)

    def take(self, token: int) -> None:
        """A sampled token (the engine thread; never waits)."""
        self._tokens.append(token)
        self.wake.set()

    def on_wait(self) -> float | None:
        """Called by the waiting activity thread: heartbeat the newest progress when there is one
        and its pace allows; returns how long to pause before the next call (None: until a token)."""
        now = self._clock()
        n = len(self._tokens)
        if n > self._shown:
            due = self._last + max(self._interval, 10 * self._cost) - now
            if due > 0:
                return due
            t0 = time.perf_counter()
            self._progress = self.progress(n)
            self._cost = time.perf_counter() - t0
            self._shown = n
            self._beat(now)
            return self._interval  # what is sampled meanwhile goes in the next one
        if now - self._last >= WAIT_S:
            self._beat(now)  # no new token: the same progress again (liveness, and cancellation)
        return None

    def _beat(self, now: float) -> None:
        self._last = now
        self.beats += 1
        if self._progress is None:
            self._send()
        else:
            self._send(self._progress)

    def progress(self, n: int) -> TokenProgress:
        """The first `n` tokens' progress: the newest tokens and stable text that fit the budget."""
        tokens = self._tokens[:n]
        room = self._budget - _OVERHEAD
        if self._decode is not None:
            room //= 2
        start, used = n, 0
        while start > 0 and used + len(str(tokens[start - 1])) + 1 <= room:
            start -= 1
            used += len(str(tokens[start])) + 1
        text, text_start = None, 0
        if self._decode is not None:
            # no trailing incomplete character: its bytes are still coming
            whole = self._decode(tokens).rstrip("\ufffd")
            text = _tail(whole, self._budget - _OVERHEAD - used)
            text_start = len(whole) - len(text)
        return self._base.model_copy(update={"start": start, "tokens": tokens[start:], "text_start": text_start,
                                             "text": text})


def _json_bytes(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False).encode()) - 2


def _tail(text: str, budget: int) -> str:
    """An end of `text` whose JSON fits `budget` bytes (about the longest one)."""
    k = min(len(text), max(budget, 0))
    while k > 0:
        size = _json_bytes(text[-k:])
        if size <= budget:
            return text[-k:]
        k = min(k - 1, k * budget // size)
    return ""
