"""TokenPublisher: a streaming generate's tokens, published to its stream's token log as they are
sampled.

The engine thread hands each sampled token over (`ChunkTokens.push`, no waiting); the worker's
event loop sends what has gathered as one `publish_tokens` update of the stream's workflow, and
the next batch when that one is answered and `MIN_INTERVAL_S` has passed. One update in flight
per chunk: a batch is whatever was sampled meanwhile, so a fast decode costs few updates and the
first token goes out at once. An update (not a signal) because its workflow task goes straight to
matching, with no transfer-queue read, and a refused one (a retried attempt's repeats) costs no
history.

Presentation only: the chunk commits once, whole, by the commit protocol; the workflow's last
entry of the chunk (`done`) completes or corrects what was published. A failed publish is logged
and the rest of the chunk is left to that last entry.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from workflows._models import PublishTokensRequest, PublishTokensResult

__all__ = ["ChunkTokens", "TokenPublisher"]

log = logging.getLogger(__name__)

_PUBLISH = "publish_tokens"
#: the least time between two publishes of one chunk after its first. Each publish is a workflow
#: task on the worker that runs the kernel (and a reader's poll another), and each one measured
#: about 12 ms of a generate's time on 2 cores (bench/bench_temporal.py: 128 tokens took 563 ms
#: published every 25 ms, 370 ms every 100 ms, 330 ms with the first token and the rest at the end).
#: The first token goes at once.
MIN_INTERVAL_S = 0.1


class TokenPublisher:
    """Publishes through `client` (the worker's: its codec encrypts the tokens under the stream's
    principal's key) from `loop` (the worker's event loop)."""

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.loop = loop

    def chunk(self, stream_id: str, chunk_seq: int, decode: Callable[[list[int]], str] | None) -> ChunkTokens:
        return ChunkTokens(self, stream_id, chunk_seq, decode)


class ChunkTokens:
    """The tokens of one streaming generate chunk, on their way to the log."""

    def __init__(self, publisher: TokenPublisher, stream_id: str, chunk_seq: int,
                 decode: Callable[[list[int]], str] | None) -> None:
        self._pub = publisher
        self._handle = publisher.client.get_workflow_handle(stream_id)
        self.chunk_seq = chunk_seq
        self._decode = decode
        self._lock = threading.Lock()  # the engine thread appends, the loop reads
        self._tokens: list[int] = []
        self._sent = 0  # tokens of the chunk in the log
        self._text_sent = ""  # their text, as published
        self._busy = False
        self._closed = False
        self.updates = 0  # publishes answered (for the benches)

    def push(self, token: int) -> None:
        """A sampled token (called from the engine thread; never waits)."""
        with self._lock:
            self._tokens.append(token)
            start = not self._busy and not self._closed
            if start:
                self._busy = True
        if start:
            self._pub.loop.call_soon_threadsafe(self._start)

    def close(self) -> None:
        """The chunk is done: nothing more is published (its last entry comes from the workflow)."""
        with self._lock:
            self._closed = True

    def _start(self) -> None:
        asyncio.ensure_future(self._flush())

    def _stable_text(self, tokens: list[int]) -> str | None:
        """The tokens' text, less a trailing incomplete character (its bytes are still coming)."""
        if self._decode is None:
            return None
        return self._decode(tokens).rstrip("\ufffd")

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        last = None
        try:
            while True:
                if last is not None:
                    await asyncio.sleep(max(0.0, last + MIN_INTERVAL_S - loop.time()))
                with self._lock:
                    n, index = len(self._tokens), self._sent
                    if self._closed or n <= index:
                        self._busy = False
                        return
                    tokens = list(self._tokens[:n])
                text = self._stable_text(tokens)
                delta = None
                if text is not None:
                    delta = text[len(self._text_sent):] if text.startswith(self._text_sent) else ""
                req = PublishTokensRequest(chunk_seq=self.chunk_seq, index=index, tokens=tokens[index:], text=delta)
                last = loop.time()
                try:
                    out = await self._handle.execute_update(_PUBLISH, req, result_type=PublishTokensResult,
                                                            id=f"tokens-{self.chunk_seq}-{index}-{n}")
                except WorkflowUpdateFailedError as err:
                    published = _published(err.cause)
                    if published is None or published <= index:
                        self._stop(f"refused: {err.cause}")
                        return
                    # an earlier attempt of this chunk published these: go on from where it ended
                    with self._lock:
                        self._sent = published
                        self._text_sent = self._stable_text(self._tokens[:published]) or ""
                    continue
                self.updates += 1
                self._sent = out.published
                self._text_sent += delta or ""
        except Exception as exc:  # noqa: BLE001 - presentation: the chunk's last entry has the tokens
            self._stop(repr(exc))

    def _stop(self, why: str) -> None:
        log.debug("stopped publishing chunk %d of %s: %s", self.chunk_seq, self._handle.id, why)
        with self._lock:
            self._closed = True
            self._busy = False


def _published(cause: Any) -> int | None:
    if isinstance(cause, ApplicationError) and cause.type == "TokensOutOfOrder" and cause.details:
        detail = cause.details[0]
        if isinstance(detail, dict) and isinstance(detail.get("published"), int):
            return detail["published"]
    return None
