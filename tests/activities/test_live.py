"""A streaming generate's live tokens (`LiveTokens`): bounded heartbeats, stable text, paced from the
activity's own thread, never the engine's."""

from __future__ import annotations

import threading

import torch

from mamba_stream.activities._engine import WAIT_S, SeededSampler, StreamEngine
from mamba_stream.activities._live import LiveTokens
from mamba_stream.workflows import TokenProgress
from tests.scan._helpers import model_for, tokens

BASE = TokenProgress(chunk_seq=3, epoch=1, update_id="generate-3-e1-abc", offset=7, attempt=2)


def _utf8(toks: list[int]) -> str:
    return bytes(toks).decode("utf-8", errors="replace")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_progress_holds_the_newest_tokens_and_text_that_fit_its_budget():
    sent: list[TokenProgress] = []
    live = LiveTokens(BASE, _utf8, send=sent.append, budget=4096)
    text = "".join(f"line {i}: caf\u00e9 \u2603\n" for i in range(2000))
    for t in text.encode():
        live.take(t)
    n = len(text.encode())
    p = live.progress(n)
    assert len(p.model_dump_json().encode()) <= 4096
    # the newest tokens, and where they start in the chunk
    assert p.start > 0 and p.start + len(p.tokens) == n and p.tokens == list(text.encode())[p.start:]
    # the newest text, and where it starts in the chunk's text
    assert p.text and p.text_start > 0 and text[p.text_start:] == p.text
    assert (p.chunk_seq, p.epoch, p.update_id, p.offset, p.attempt) == (3, 1, "generate-3-e1-abc", 7, 2)
    # a short chunk fits whole
    small = live.progress(40)
    assert small.start == 0 and small.tokens == list(text.encode())[:40]
    assert small.text_start == 0 and small.text == _utf8(list(text.encode())[:40]).rstrip("\ufffd")


def test_the_text_holds_back_an_incomplete_character():
    live = LiveTokens(BASE, _utf8, send=lambda *a: None)
    for t in "a\u00e9".encode():  # 0x61 0xc3 0xa9
        live.take(t)
    assert live.progress(2).text == "a"  # 0xc3 alone: the character's second byte is still coming
    assert live.progress(3).text == "a\u00e9"
    none = LiveTokens(BASE, None, send=lambda *a: None)
    none.take(5)
    assert none.progress(1).text is None and none.progress(1).tokens == [5]


def test_heartbeats_go_at_once_then_at_most_every_interval_and_repeat_when_idle():
    sent: list[tuple] = []
    clock = Clock()
    live = LiveTokens(BASE, _utf8, send=lambda *a: sent.append(a), interval=0.1, clock=clock)
    assert live.on_wait() is None and sent == [()]  # nothing sampled yet: a bare heartbeat (liveness, cancellation)
    clock.now += WAIT_S / 2
    assert live.on_wait() is None and sent == [()]  # not again within the second
    live.take(104)
    assert live.on_wait() == 0.1  # the first token goes at once; then a pause
    assert sent[-1][0].tokens == [104]
    live.take(105)
    clock.now += 0.04
    due = live.on_wait()
    assert due is not None and abs(due - 0.06) < 1e-9 and len(sent) == 2  # not yet
    clock.now += 0.06
    assert live.on_wait() == 0.1 and sent[-1][0].tokens == [104, 105]
    clock.now += 0.5
    assert live.on_wait() is None and len(sent) == 3  # no new token: nothing until the next second
    clock.now += WAIT_S
    live.on_wait()
    assert len(sent) == 4 and sent[-1] == sent[-2]  # the same progress again, not an empty one


def test_an_engine_generate_heartbeats_from_the_waiting_thread_as_tokens_come():
    model = model_for("tiny-mamba2")
    engine = StreamEngine(model, capacity=2, max_wait_s=0.0)
    try:
        start = model.advance(model.initial_state(), tokens(6, 3))
        engine.put("a", start.state, epoch=0, state_key="a0", logits=start.logits[-1])
        beats: list[tuple[str, TokenProgress]] = []
        live = LiveTokens(BASE, None, send=lambda p=None: beats.append((threading.current_thread().name, p)),
                          interval=0.01)
        slow = threading.Event()

        def taken(tok: int) -> None:
            live.take(tok)
            slow.wait(0.005)  # a few ms a token: several heartbeats in the chunk

        sampler = SeededSampler(1.0, 0, torch.Generator().manual_seed(5), taken=taken)
        out = engine.generate("a", sampler, 60, expected_key="a0", epoch=0, load=lambda: None,
                              on_wait=live.on_wait, wake=live.wake)
        me = threading.current_thread().name
        assert len(beats) >= 3 and {who for who, _ in beats} == {me}  # never the engine thread
        shown = [p.tokens for _, p in beats]
        assert all(out.tokens[: len(s)] == s for s in shown)  # each a prefix of the chunk's tokens
        assert [len(s) for s in shown] == sorted(len(s) for s in shown) and shown[0] == out.tokens[:1]
    finally:
        engine.close()
