"""MambaStreamWorkflow against a real Temporal dev server: chunking, exactly-once, lifecycle."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch
from temporalio.client import WorkflowUpdateFailedError

from mamba_stream.activities import StreamActivities
from mamba_stream.scan import load_model, tolerance
from mamba_stream.state_codec import stream_tag
from mamba_stream.state_codec.codec import plaintext_checksum, unseal
from mamba_stream.workflows import StreamOptions
from mamba_stream.workflows._models import AdvanceRequest
from mamba_stream.workflows._stream import MambaStreamWorkflow
from tests.workflows.conftest import FAST, Stack, eventually, make_stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

_MODELS: dict[tuple[str, str], object] = {}


def local(model_id: str, backend: str = "reference"):
    key = (model_id, backend)
    if key not in _MODELS:
        _MODELS[key] = load_model(model_id, backend=backend)
    return _MODELS[key]


def digest(logits: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(logits.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def chunking(rng: random.Random, n: int) -> list[int]:
    out, total = [], 0
    while total < n:
        c = min(rng.choice([0, 1, 2, 3, 5, 8, 13, 29]), n - total)
        out.append(c)
        total += c
    return out


def reason(exc: BaseException) -> str | None:
    cause = getattr(exc, "cause", None)
    return getattr(cause, "type", None)


async def feed(stack: Stack, sid: str, principal: str, tokens: list[int], chunks: list[int]):
    results, pos = [], 0
    for c in chunks:
        results.append(await stack.streams.advance(sid, principal, tokens=tokens[pos : pos + c]))
        pos += c
    return results


@pytest.mark.parametrize("model_id", ["tiny-mamba1", "tiny-mamba2", "tiny-mamba3"])
async def test_random_chunkings_through_temporal_equal_one_advance(stack: Stack, model_id: str):
    rng = random.Random(model_id)
    tokens = [rng.randrange(256) for _ in range(61)]
    truth = local(model_id).advance(local(model_id).initial_state(), tokens)
    for _ in range(2):
        chunks = chunking(rng, len(tokens))
        sid = await stack.streams.open("alice", model_id)
        results = await feed(stack, sid, "alice", tokens, chunks)
        pos = 0
        for c, r in zip(chunks, results, strict=True):
            assert r.output_digest == digest(truth.logits[pos : pos + c]), (chunks, r.chunk_seq)
            pos += c
        final = results[-1].receipt
        assert final.position == len(tokens) and final.chunk_seq == len(chunks)
        assert final.checksum == plaintext_checksum(truth.state.tensors), chunks
        top = torch.log_softmax(truth.logits[-1].double(), -1).topk(5)
        assert [t.token for t in results[-1].top_k] == top.indices.tolist()


async def test_chunked_backend_through_temporal_within_declared_tolerance(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, backend="chunked")
    async with stack.exits:
        truth_model = load_model("tiny-mamba2", backend="reference", dtype=torch.float64)
        tokens = [random.Random(3).randrange(256) for _ in range(90)]
        truth = truth_model.advance(truth_model.initial_state(), tokens)
        sid = await stack.streams.open("alice", "tiny-mamba2")
        results = await feed(stack, sid, "alice", tokens, [1, 40, 0, 17, 32])
        receipt = results[-1].receipt
        assert receipt.backend.startswith("chunked:")
        blob = stack.acts.store.get(key=receipt.state_key, owner=stack.acts.commits.owner("alice"))
        state = unseal(blob, receipt, stack.keyring, model=local("tiny-mamba2", "chunked"), principal="alice")
        tol = tolerance("mamba2", "chunked", "float32")
        for name, t in state.tensors.items():
            assert tol.state_excess(t, truth.state.tensors[name]) <= 1.0, name
        last = torch.log_softmax(truth.logits[-1].double(), -1)
        for t in results[-1].top_k:
            assert abs(t.logprob - float(last[t.token])) <= 1e-4


async def test_text_chunks_use_the_input_transform(stack: Stack):
    model = local("tiny-mamba2")
    text = "héllo, wörld! chunk boundaries inside UTF-8 are fine"
    sid = await stack.streams.open("alice", "tiny-mamba2")
    for lo, hi in ((0, 2), (2, 9), (9, len(text))):
        r = await stack.streams.advance(sid, "alice", text=text[lo:hi])
    truth = model.advance(model.initial_state(), model.transform.encode(text))
    assert r.receipt.checksum == plaintext_checksum(truth.state.tensors)


class Counting(StreamActivities):
    """Counts engine runs per chunk (the `admitted` edge comes right before the kernel)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.runs: dict[int, int] = {}

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name == "admitted":
            self.runs[chunk_seq] = self.runs.get(chunk_seq, 0) + 1


async def history_updates(stack: Stack, sid: str) -> int:
    events = [e async for e in stack.streams.handle(sid).fetch_history_events()]
    return sum(1 for e in events if e.HasField("workflow_execution_update_accepted_event_attributes"))


async def test_same_update_id_runs_once_and_returns_the_same_result(temporal_env, tmp_path):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=Counting)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba1")
        first = await stack.streams.advance(sid, "alice", tokens=[5, 6, 7], chunk_seq=1)
        again = await stack.streams.advance(sid, "alice", tokens=[5, 6, 7], chunk_seq=1)
        # the same chunk as a next attempt (another id): answered with the first result, not run again
        third = await stack.streams.advance(sid, "alice", tokens=[5, 6, 7], chunk_seq=1, attempt=1)
        assert first == again and third == first.model_copy(update={"duplicate": True})
        # other content under the same sequence: refused typed, never answered with the first result
        with pytest.raises(WorkflowUpdateFailedError) as exc:
            await stack.streams.advance(sid, "alice", tokens=[9, 9], chunk_seq=1)
        assert reason(exc.value) == "ConflictingChunk"
        assert stack.acts.runs == {1: 1}
        assert (await stack.streams.stats(sid)).position == 3


@pytest.mark.parametrize("bad_seq", [1, 3, 0, -4])
async def test_out_of_order_or_skipped_chunks_are_rejected_before_history(stack: Stack, bad_seq: int):
    sid = await stack.streams.open("alice", "tiny-mamba1")
    await stack.streams.advance(sid, "alice", tokens=[1, 2], chunk_seq=1)
    before = await history_updates(stack, sid)
    # built without validation, so the stream's own refusal is what is tested (0 and -4 are not sequences)
    req = AdvanceRequest.model_construct(principal="alice", chunk_seq=bad_seq, tokens=[3], text=None, top_k=5,
                                         signature=None)
    with pytest.raises(WorkflowUpdateFailedError) as exc:
        await stack.streams.handle(sid).execute_update(MambaStreamWorkflow.advance, req, id=f"other-{bad_seq}")
    # 1: committed with other content; 3: skips one; 0 and -4: not sequences at all
    expected = {1: "ConflictingChunk", 3: "ChunkSequenceMismatch"}.get(bad_seq, "InvalidRequest")
    assert reason(exc.value) == expected
    assert exc.value.cause.non_retryable
    assert await history_updates(stack, sid) == before
    stats = await stack.streams.stats(sid)
    assert (stats.position, stats.chunk_seq) == (2, 1)


@pytest.mark.parametrize(
    "req,expected",
    [
        (dict(tokens=[1, 256]), "TokenOutOfRange"),
        (dict(tokens=[-1]), "InvalidRequest"),  # not a token id at all: the request does not validate
        (dict(tokens=list(range(200)) * 3), "ChunkTooLarge"),
        (dict(text="x" * 2000), "ChunkTooLarge"),
    ],
)
async def test_invalid_or_oversized_input_is_rejected_before_history(temporal_env, tmp_path, req, expected):
    stack = await make_stack(temporal_env, tmp_path)
    async with stack.exits:
        opts = StreamOptions(max_chunk_tokens=512, max_text_bytes=1024)
        sid = await stack.streams.open("alice", "tiny-mamba2", options=opts)
        await stack.streams.advance(sid, "alice", tokens=[1], chunk_seq=1)
        before = await history_updates(stack, sid)
        with pytest.raises(WorkflowUpdateFailedError) as exc:
            if expected == "InvalidRequest":  # the client would refuse to build it: sent raw
                raw = AdvanceRequest.model_construct(principal="alice", chunk_seq=2, text=None, top_k=5,
                                                     signature=None, **req)
                await stack.streams.handle(sid).execute_update(MambaStreamWorkflow.advance, raw, id="raw-2")
            else:
                await stack.streams.advance(sid, "alice", chunk_seq=2, **req)
        assert reason(exc.value) == expected and exc.value.cause.non_retryable
        assert await history_updates(stack, sid) == before
        assert (await stack.streams.stats(sid)).position == 1


async def test_duplicate_after_continue_as_new_is_still_deduplicated(can_env, tmp_path):
    stack = await make_stack(can_env, tmp_path, acts_cls=Counting)
    async with stack.exits:
        sid = await stack.streams.open("alice", "tiny-mamba1")
        first_run = (await stack.streams.handle(sid).describe()).run_id
        results = [await stack.streams.advance(sid, "alice", tokens=[i, i + 1]) for i in range(1, 13)]
        stats = await eventually(lambda: _continued(stack, sid))
        assert stats.continued_as_new >= 1
        desc = await stack.streams.handle(sid).describe()
        assert desc.run_id != first_run
        # the next run keeps its principal's fairness key (issue 50): the server carries it over
        assert desc.raw_description.workflow_execution_info.priority.fairness_key == stream_tag(sid)
        again = await stack.streams.advance(sid, "alice", tokens=[2, 3], chunk_seq=2)
        assert again.duplicate and again.model_copy(update={"duplicate": False}) == results[1]
        assert stack.acts.runs[2] == 1
        nxt = await stack.streams.advance(sid, "alice", tokens=[7])
        assert nxt.chunk_seq == 13 and nxt.position == 25
        stats = await stack.streams.stats(sid)
        assert stats.duplicates == 1 and stats.chunks == 13


async def _continued(stack: Stack, sid: str):
    s = await stack.streams.stats(sid)
    return s if s.continued_as_new else None


class FailOnce(StreamActivities):
    """Commits, then fails once at `edge`: the response of that attempt is lost."""

    edge = "recorded"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.failed: set[int] = set()
        self.runs: dict[int, int] = {}

    def _edge(self, name: str, stream_id: str, chunk_seq: int) -> None:
        if name == "admitted":
            self.runs[chunk_seq] = self.runs.get(chunk_seq, 0) + 1
        if name == self.edge and chunk_seq == 2 and chunk_seq not in self.failed and self._fails_here():
            self.failed.add(chunk_seq)
            raise RuntimeError(f"lost response after {name}")

    def _fails_here(self) -> bool:
        return True


class FailAfterWrite(FailOnce):
    edge = "written"


@pytest.mark.parametrize("cls", [FailOnce, FailAfterWrite], ids=["after-record", "after-write"])
async def test_lost_response_advances_exactly_once(temporal_env, tmp_path, cls):
    stack = await make_stack(temporal_env, tmp_path, acts_cls=cls)
    async with stack.exits:
        model = local("tiny-mamba2")
        tokens = list(range(40, 70))
        sid = await stack.streams.open("alice", "tiny-mamba2", options=FAST)
        results = await feed(stack, sid, "alice", tokens, [10, 10, 10])
        truth = model.advance(model.initial_state(), tokens)
        assert stack.acts.failed == {2}
        assert results[-1].receipt.position == 30
        assert results[-1].receipt.checksum == plaintext_checksum(truth.state.tensors)
        assert results[1].output_digest == digest(truth.logits[10:20])
        if cls is FailOnce:
            assert stack.acts.runs[2] == 1  # the retry found the record: no second run
        keys = stack.acts.store.list_stream(stream_id=sid)
        assert sum(1 for k in keys if ".c2." in k and not k.endswith(".out")) <= 1


async def test_generate_is_seeded_and_advances_like_input(stack: Stack):
    model = local("tiny-mamba3")
    sid = await stack.streams.open("alice", "tiny-mamba3")
    with pytest.raises(WorkflowUpdateFailedError) as exc:
        await stack.streams.generate(sid, "alice", 4, seed=1)
    assert reason(exc.value) == "EmptyContext"
    prompt = await stack.streams.advance(sid, "alice", text="Once upon")
    gen = await stack.streams.generate(sid, "alice", 9, seed=42, temperature=0.9, top_k=20)
    assert len(gen.tokens) == 9 and gen.position == prompt.position + 9
    truth = model.advance(model.initial_state(), model.transform.encode("Once upon") + gen.tokens)
    assert gen.receipt.checksum == plaintext_checksum(truth.state.tensors)
    # the same seed from the same state samples the same tokens (a replay, a retry)
    sid2 = await stack.streams.open("alice", "tiny-mamba3")
    await stack.streams.advance(sid2, "alice", text="Once upon")
    gen2 = await stack.streams.generate(sid2, "alice", 9, seed=42, temperature=0.9, top_k=20)
    assert gen2.tokens == gen.tokens and gen2.receipt.checksum == gen.receipt.checksum
    greedy = await stack.streams.generate(sid2, "alice", 3, temperature=0.0)
    logits = model.advance(truth.state, []).logits  # empty: nothing new
    assert logits.shape[0] == 0 and greedy.tokens[0] == int(truth.logits[-1].argmax())


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("edge", ["admitted", "computed", "written", "recorded"])
async def test_worker_killed_at_a_commit_edge_another_worker_finishes(temporal_env, tmp_path, edge):
    """SIGKILL (a) after admission, (b) after the kernel, (c) after the write, (d) after the record."""
    import subprocess
    import sys

    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        keyfile, ready = tmp_path / "keyring.json", tmp_path / "ready"
        stack.keyring.save(keyfile)
        await stack.worker(workflows=True, activities=False)  # the workflow lives on, here
        proc = subprocess.Popen([sys.executable, "-m", "tests.workflows._crash_worker", stack.address, stack.queue,
                                 stack.store_url, str(keyfile), edge, "2", str(ready)], cwd=ROOT)
        try:
            await eventually(lambda: _exists(ready), timeout=90)
            model = local("tiny-mamba2")
            tokens = list(range(100, 130))
            # the regular path: a workflows-only worker cannot run a chunk as a local activity
            sid = await stack.streams.open("alice", "tiny-mamba2",
                                           options=FAST.model_copy(update={"local_chunks": False}))
            await stack.streams.advance(sid, "alice", tokens=tokens[:10])  # on the doomed worker
            assert (await stack.streams.stats(sid)).migrations == 0
            await stack.worker(workflows=False, activities=True)  # the rescuer
            r2 = await stack.streams.advance(sid, "alice", tokens=tokens[10:20])  # the doomed worker dies
            assert proc.wait(timeout=30) == -9
            r3 = await stack.streams.advance(sid, "alice", tokens=tokens[20:])
            truth = model.advance(model.initial_state(), tokens)
            assert r2.output_digest == digest(truth.logits[10:20])
            assert r3.receipt.position == 30
            assert r3.receipt.checksum == plaintext_checksum(truth.state.tensors)
            stats = await stack.streams.stats(sid)
            assert stats.migrations >= 1 and stats.chunks == 3
        finally:
            if proc.poll() is None:
                proc.kill()


async def _exists(path: Path) -> bool:
    return path.exists()
