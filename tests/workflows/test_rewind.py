"""Rewind (Issue 15, finding 1; Issue 26): the stream's principal (or the operator) sends the
sealed `rewind` update, and the stream continues, in a new run, from the chunk it goes back to,
bit for bit as a fresh stream fed the same tokens; past the window of kept checkpoints it is
refused, typed, with nothing changed. A raw Temporal reset (an operator's, which Temporal's own
authorization decides) past the window: the next chunk says so, typed, and a reset signal starts
the stream afresh."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess

import pytest
import torch
from temporalio.client import WorkflowUpdateFailedError

from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.worker import temporal_binary
from mamba_stream.workflows import RewindPastWindow, StreamOptions
from tests.workflows.conftest import FAST, Stack, address, eventually

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHUNKS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]


def reason(exc: BaseException) -> str | None:
    return getattr(getattr(exc, "cause", None), "type", None)


def digest(logits: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(logits.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


_TRUTH = {}


def truth(tokens: list[int]):
    if "m" not in _TRUTH:
        _TRUTH["m"] = load_model("tiny-mamba2", backend="reference")
    m = _TRUTH["m"]
    return m.advance(m.initial_state(), tokens)


async def _fed(stack: Stack, kept: int) -> str:
    sid = await stack.streams.open("alice", "tiny-mamba2", options=StreamOptions(
        **{**FAST.model_dump(), "checkpoints_kept": kept}))
    for c in CHUNKS:
        await stack.streams.advance(sid, "alice", tokens=c)
    return sid


async def _continues_like_a_fresh_stream(stack: Stack, sid: str, kept_tokens: list[int], seq: int) -> None:
    stats = await eventually(lambda: _at(stack, sid, seq))
    assert stats.position == len(kept_tokens)
    # a different next chunk than before the rewind ("undo a tool call"), then one more
    a = await stack.streams.advance(sid, "alice", tokens=[200, 201])
    b = await stack.streams.advance(sid, "alice", tokens=[202])
    assert (a.chunk_seq, b.chunk_seq) == (seq + 1, seq + 2)
    full = truth([*kept_tokens, 200, 201, 202])
    n = len(kept_tokens)
    assert a.output_digest == digest(full.logits[n:n + 2]) and b.output_digest == digest(full.logits[n + 2:])
    assert b.receipt.checksum == plaintext_checksum(full.state.tensors) and b.position == n + 3


async def _at(stack: Stack, sid: str, seq: int):
    try:
        s = await stack.streams.stats(sid)
    except Exception:  # noqa: BLE001 - the new run's first task may still be on its way
        return None
    return s if s.chunk_seq == seq else None


async def test_rewind_within_the_window_continues_bit_for_bit(stack: Stack):
    sid = await _fed(stack, kept=4)
    first_run = (await stack.streams.handle(sid).describe()).run_id
    run = await stack.streams.rewind(sid, 2)
    assert run != first_run
    await _continues_like_a_fresh_stream(stack, sid, [*CHUNKS[0], *CHUNKS[1]], 2)


async def test_rewind_to_the_opened_state(stack: Stack):
    sid = await _fed(stack, kept=8)
    await stack.streams.rewind(sid, 0)
    await _continues_like_a_fresh_stream(stack, sid, [], 0)


async def test_a_raw_temporal_reset_to_the_same_event_continues_bit_for_bit(stack: Stack):
    sid = await _fed(stack, kept=4)
    run_id, event = await stack.streams.rewind_point(sid, 3)
    assert event is not None
    out = await asyncio.to_thread(subprocess.run, [
        temporal_binary(), "workflow", "reset", "--workflow-id", sid, "--run-id", run_id, "--event-id", str(event),
        "--reason", "test", "--address", address(stack.env), "--namespace", "default", "--yes"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # the CLI reapplies the later updates by default: they re-run from chunk 3's checkpoint and,
    # being the same chunks on the same state, find their recorded results; either way the stream
    # continues from a state that equals the tokens it reports
    stats = await eventually(lambda: _settled(stack, sid))
    kept = [t for c in CHUNKS[: stats.chunk_seq] for t in c]
    assert stats.chunk_seq in (3, 5), stats
    await _continues_like_a_fresh_stream(stack, sid, kept, stats.chunk_seq)


async def _settled(stack: Stack, sid: str):
    try:
        s = await stack.streams.stats(sid)
        desc = await stack.streams.handle(sid).describe()
    except Exception:  # noqa: BLE001
        return None
    pending = (desc.raw_description.pending_activities
               or desc.raw_description.pending_workflow_task.scheduled_time.seconds)
    return None if pending else s


async def test_a_rewind_past_the_window_is_typed_and_a_reset_starts_afresh(stack: Stack):
    sid = await _fed(stack, kept=2)
    run = (await stack.streams.handle(sid).describe()).run_id
    # the client refuses a chunk outside the window before it resets anything
    with pytest.raises(RewindPastWindow):
        await stack.streams.rewind(sid, 3)
    assert (await stack.streams.handle(sid).describe()).run_id == run
    assert (await stack.streams.stats(sid)).chunk_seq == 5
    # a raw Temporal reset there (an operator's, around the client): the next chunk says so, typed
    await _raw_reset(stack, sid, 1)
    await eventually(lambda: _at(stack, sid, 1))
    await _past_the_window(stack, sid, 1, 3)
    await stack.streams.reset(sid, "alice")
    await eventually(lambda: _epoch(stack, sid, 1))
    # the same chunk again, in the fresh epoch: a new update id, from the initial state
    a = await stack.streams.advance(sid, "alice", tokens=[50])
    full = truth([50])
    assert a.chunk_seq == 2 and a.position == 1 and a.receipt.epoch == 1
    assert a.receipt.checksum == plaintext_checksum(full.state.tensors) and a.output_digest == digest(full.logits)


async def _past_the_window(stack: Stack, sid: str, seq: int, position: int) -> None:
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await stack.streams.advance(sid, "alice", tokens=[50])
    assert reason(err.value) == "RewindPastWindow" and err.value.cause.non_retryable
    stats = await stack.streams.stats(sid)
    assert (stats.chunk_seq, stats.position) == (seq, position)  # nothing advanced


async def _raw_reset(stack: Stack, sid: str, seq: int) -> None:
    run_id, event = await stack.streams.rewind_point(sid, seq)
    out = await asyncio.to_thread(subprocess.run, [
        temporal_binary(), "workflow", "reset", "--workflow-id", sid, "--run-id", run_id, "--event-id", str(event),
        "--reapply-exclude", "All", "--reason", "test", "--address", address(stack.env), "--namespace", "default",
        "--yes"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _tokens(chunks: list[list[int]]) -> list[int]:
    return [t for c in chunks for t in c]


async def test_a_rewind_after_a_rewind_reaches_any_chunk_of_its_window(stack: Stack):
    """Issue 25: window 4, six chunks, rewind to 3, one chunk, rewind to 2: refused
    `RewindPastWindow`, because the undone chunks 5 and 6 had deleted chunks 1 and 2 on their way."""
    chunks = [*CHUNKS, [13, 14]]
    sid = await stack.streams.open("alice", "tiny-mamba2", options=StreamOptions(
        **{**FAST.model_dump(), "checkpoints_kept": 4}))
    for c in chunks:
        await stack.streams.advance(sid, "alice", tokens=c)
    await stack.streams.rewind(sid, 3)
    await eventually(lambda: _at(stack, sid, 3))
    other = await stack.streams.advance(sid, "alice", tokens=[30, 31])
    assert other.chunk_seq == 4
    await stack.streams.rewind(sid, 2)
    await _continues_like_a_fresh_stream(stack, sid, _tokens(chunks[:2]), 2)


async def test_a_chain_of_rewinds_lands_only_on_stored_checkpoints(stack: Stack):
    """Window 2: the store holds the line's last 3 checkpoints. Each rewind reaches its own
    window, and deletes the chunks it undoes; one step further back than the store holds is
    refused, typed, before anything changes (a raw Temporal reset there would leave a stream whose
    next chunk is refused)."""
    chunks = [*CHUNKS, [13, 14]]
    sid = await stack.streams.open("alice", "tiny-mamba2", options=StreamOptions(
        **{**FAST.model_dump(), "checkpoints_kept": 2}))
    for c in chunks:
        await stack.streams.advance(sid, "alice", tokens=c)

    def held() -> list[str]:
        return sorted(k.split(".")[-2] for k in stack.acts.store.list_stream(stream_id=sid) if not k.endswith(".out"))

    assert held() == ["c4", "c5", "c6"]  # 2 x 2 - 1 of the line
    with pytest.raises(RewindPastWindow):
        await stack.streams.rewind(sid, 4)  # out of the window (5, 6): refused before anything changes
    assert (await stack.streams.stats(sid)).chunk_seq == 6
    await stack.streams.rewind(sid, 5)
    await eventually(lambda: _at(stack, sid, 5))
    assert held() == ["c4", "c5"]  # chunk 6 undone, and gone
    await stack.streams.rewind(sid, 4)
    await eventually(lambda: _at(stack, sid, 4))
    with pytest.raises(RewindPastWindow):  # chunk 3 left the store long ago
        await stack.streams.rewind(sid, 3)
    stats = await stack.streams.stats(sid)
    assert (stats.chunk_seq, stats.position, stats.rewinds) == (4, len(_tokens(chunks[:4])), 2)
    await _continues_like_a_fresh_stream(stack, sid, _tokens(chunks[:4]), 4)


async def _epoch(stack: Stack, sid: str, epoch: int):
    s = await stack.streams.stats(sid)
    return s if s.epoch == epoch else None


async def test_the_rewind_command_names_where_it_went(stack: Stack, tmp_path):
    from tests.workflows.test_worker_cli import _cli

    sid = await _fed(stack, kept=4)
    keyfile = tmp_path / "keys.json"
    stack.keyring.save(keyfile)
    out = await _cli(stack, keyfile, "rewind", sid, "--to-seq", "4")
    assert (out["chunk_seq"], out["position"]) == (4, sum(len(c) for c in CHUNKS[:4]))
    await _continues_like_a_fresh_stream(stack, sid, [t for c in CHUNKS[:4] for t in c], 4)
    with pytest.raises(AssertionError, match="RewindUnavailable"):
        await _cli(stack, keyfile, "rewind", sid, "--to-seq", "9")


async def test_a_reset_to_the_first_workflow_task_leaves_a_stream_that_works(stack: Stack):
    """Finding 1: reapplied updates were refused `StreamOpening`, the stream was at position 0, and
    every later chunk got an untyped gRPC `Internal` error."""
    sid = await _fed(stack, kept=4)
    out = await asyncio.to_thread(subprocess.run, [
        temporal_binary(), "workflow", "reset", "--workflow-id", sid, "--type", "FirstWorkflowTask",
        "--reason", "test", "--address", address(stack.env), "--namespace", "default", "--yes"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    stats = await eventually(lambda: _settled(stack, sid))
    kept = [t for c in CHUNKS[: stats.chunk_seq] for t in c]
    assert stats.position == len(kept)
    await _continues_like_a_fresh_stream(stack, sid, kept, stats.chunk_seq)


async def test_after_a_rewind_another_chunk_at_the_same_seq_gets_its_own_result(stack: Stack):
    """Issue 19, mutant 3: chunk 2 commits, the rewind makes the workflow forget it (so it no
    longer refuses other content at seq 2 as `ConflictingChunk`), while the store still holds
    chunk 2's checkpoint and result record. Another chunk 2, from the same input state, must be
    advanced on its own, not answered with the stale record."""
    sid = await stack.streams.open("alice", "tiny-mamba2", options=StreamOptions(
        **{**FAST.model_dump(), "checkpoints_kept": 8}))
    await stack.streams.advance(sid, "alice", tokens=[1, 2, 3])
    lost = await stack.streams.advance(sid, "alice", tokens=[4, 5, 6])
    await stack.streams.checkpoint(sid, "alice")  # handed out: the rewind keeps it in the store
    await stack.streams.rewind(sid, 1)
    await eventually(lambda: _at(stack, sid, 1))
    # the lost chunk's record is still there to be (wrongly) found
    assert stack.acts.commits.prior(lost.receipt.state_key, "alice") is not None

    mine = await stack.streams.advance(sid, "alice", tokens=[40, 41])
    fresh = await stack.streams.open("alice", "tiny-mamba2")
    await stack.streams.advance(fresh, "alice", tokens=[1, 2, 3])
    twin = await stack.streams.advance(fresh, "alice", tokens=[40, 41])
    full = truth([1, 2, 3, 40, 41])
    assert (mine.chunk_seq, mine.n_tokens, mine.position) == (2, 2, 5) and not mine.duplicate
    assert mine.output_digest == digest(full.logits[3:]) == twin.output_digest
    assert mine.receipt.checksum == plaintext_checksum(full.state.tensors) == twin.receipt.checksum
    assert mine.receipt.state_key != lost.receipt.state_key
    stats = await stack.streams.stats(sid)
    assert (stats.chunk_seq, stats.position) == (2, 5)
    # and the stream goes on from its own chunk 2
    nxt = await stack.streams.advance(sid, "alice", tokens=[42])
    full = truth([1, 2, 3, 40, 41, 42])
    assert nxt.receipt.checksum == plaintext_checksum(full.state.tensors)
    assert nxt.output_digest == digest(full.logits[5:])


async def test_a_rewind_to_before_a_reset_does_not_reapply_the_reset(stack: Stack):
    """Chunks 1-3, a reset (a signal), chunk 4, rewind to 2: the stream is back at epoch 0 and
    chunk 2's position, as a fresh stream fed chunks 1-2; the reset, sent after the rewind point,
    is not applied again (nor counted), and the chunks after continue the old epoch's state."""
    sid = await stack.streams.open("alice", "tiny-mamba2", options=StreamOptions(
        **{**FAST.model_dump(), "checkpoints_kept": 8}))
    for c in CHUNKS[:3]:
        await stack.streams.advance(sid, "alice", tokens=c)
    await stack.streams.reset(sid, "alice")
    await eventually(lambda: _epoch(stack, sid, 1))
    four = await stack.streams.advance(sid, "alice", tokens=CHUNKS[3])
    assert (four.receipt.epoch, four.position, four.chunk_seq) == (1, len(CHUNKS[3]), 4)
    before = await stack.streams.stats(sid)
    await stack.streams.rewind(sid, 2)
    stats = await eventually(lambda: _at(stack, sid, 2))
    assert (stats.epoch, stats.position, stats.chunk_seq) == (0, len(CHUNKS[0]) + len(CHUNKS[1]), 2)
    assert stats.resets == before.resets and stats.rewinds == before.rewinds + 1
    assert (await stack.streams.receipt(sid)).epoch == 0
    await _continues_like_a_fresh_stream(stack, sid, [*CHUNKS[0], *CHUNKS[1]], 2)
    after = await stack.streams.stats(sid)
    assert after.epoch == 0 and after.resets == before.resets


async def _epoch(stack: Stack, sid: str, epoch: int):
    s = await stack.streams.stats(sid)
    return s if s.epoch == epoch else None
