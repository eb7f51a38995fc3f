"""ModelStream inside a workflow of the tests' own (tests/workflows/_owner.py), against the real
dev server: through continue-as-new, a reset and cancellation, the state equals a local scan of
the same tokens; the recorded histories replay (the stack's replay at exit)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowFailureError

from mamba_stream.state_codec.codec import plaintext_checksum
from mamba_stream.workflows import TokenEvent
from tests.workflows._owner import OwnerInput, TestOwner
from tests.workflows.conftest import FAST, eventually, histories, make_stack
from tests.workflows.test_stream_workflow import local

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_stream_owned_by_a_workflow_moves_resets_and_is_disposed(can_env, tmp_path, monkeypatch):
    s = await make_stack(can_env, tmp_path, owners=(TestOwner,))
    async with s.exits:
        chunks = [[(7 * i + j) % 200 + 1 for j in range(3 + i % 4)] for i in range(12)]
        sid = s.streams.new_id("alice")
        handle = await s.client.start_workflow(
            # regular activities: each chunk grows the history, so the server suggests continue-as-new
            TestOwner.run, OwnerInput(principal="alice", model_id="tiny-mamba2", chunks=chunks,
                                        options=FAST.model_copy(update={"local_chunks": False}),
                                        reset_before=4, generate=5), id=sid, task_queue=s.queue)

        async def asked(query) -> bool:
            try:
                return await handle.query(query)
            except Exception:  # noqa: BLE001 - between runs (continue-as-new)
                return False
        await eventually(lambda: asked(TestOwner.all_fed), timeout=90)

        # a reader on the last run, then the generate, which the owner runs outside any update: the
        # reader learns of it from the run's history (a completed workflow task) and reads the log
        shown: list[TokenEvent] = []
        reads = 0
        real_read = s.streams.read_tokens

        async def counted(*a, **kw):
            nonlocal reads
            reads += 1
            return await real_read(*a, **kw)
        monkeypatch.setattr(s.streams, "read_tokens", counted)

        async def follow() -> None:
            async for ev in s.streams.tokens(sid):
                shown.append(ev)
        reader = asyncio.create_task(follow())

        async def attached() -> bool:  # the reader read the log once: what comes next comes by history
            return reads >= 1
        await eventually(attached)
        await handle.signal(TestOwner.generate_now)
        await eventually(lambda: asked(TestOwner.done), timeout=90)
        runs = await histories(s.client, s.queue)
        assert len(runs) >= 2  # the server suggested continue-as-new after 24 events: it moved

        model = local("tiny-mamba2")
        fed = [t for c in chunks[4:] for t in c]  # the reset before chunk 5 began a new epoch
        batch = await s.streams.read_tokens(sid)
        [generated] = [e for e in batch.events if e.done]
        assert generated.chunk_seq == 13 and len(generated.tokens) == 5

        async def read_out() -> bool:  # generated in `run`, outside any update: the reader has it too
            return any(e.done for e in shown)
        await eventually(read_out)
        reader.cancel()
        assert [(e.chunk_seq, e.tokens) for e in shown if e.done] == [(13, generated.tokens)]
        out, greedy = model.advance(model.initial_state(), fed), []  # temperature 0: each token the argmax
        for _ in range(5):
            greedy.append(int(out.logits[-1].argmax()))
            out = model.advance(out.state, greedy[-1:])
        assert generated.tokens == greedy
        truth = model.advance(model.initial_state(), fed + generated.tokens)
        receipt = await s.streams.receipt(sid)
        assert receipt.epoch == 1 and receipt.chunk_seq == 13 and receipt.position == len(fed) + 5
        assert receipt.checksum == plaintext_checksum(truth.state.tensors)
        stats = await s.streams.stats(sid)
        assert stats.resets == 1 and stats.chunks == 13 and stats.tokens == sum(map(len, chunks))

        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()

        async def disposed() -> bool:
            return s.acts.store.list_stream(stream_id=sid) == []
        await eventually(disposed)


def test_every_patch_is_decided_by_one_start_marker_and_their_ids_are_the_recorded_ones():
    from mamba_stream.workflows._model_stream import START_MARKERS
    from tests.workflows.conftest import PATCH_IDS

    listed = [p for patches in START_MARKERS.values() for p in patches]
    assert len(listed) == len(set(listed)) and not set(listed) & set(START_MARKERS)
    # the ids are history's format: the recorded histories' check (`sdk_bookkeeping`) knows them all
    assert set(START_MARKERS) | set(listed) == PATCH_IDS
