"""The default worker configuration is exact: streams fed the same tokens in any chunking, decode
steps included, end with the same checksum, through Temporal, and it equals one local scan."""

from __future__ import annotations

import concurrent.futures
import functools
import random

import pytest
import torch
from temporalio.client import Client, WorkflowFailureError
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.worker import Worker

from mamba_stream.activities import ModelRegistry, StreamActivities, StreamMetrics, open_store
from mamba_stream.plugin import MambaStreamPlugin
from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import Keyring, plaintext_checksum
from mamba_stream.workflows import StreamOptions
from tests.scan._helpers import tokens
from tests.workflows.conftest import FAST, make_stack
from tests.workflows.test_metrics import Meter, free_port
from tests.workflows.test_stream_workflow import chunking, digest, feed

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.mark.parametrize("model_id", ["tiny-mamba1", "tiny-mamba2", "tiny-mamba3"])
async def test_the_default_backend_gives_one_checksum_for_every_chunking(temporal_env, tmp_path, model_id):
    stack = await make_stack(temporal_env, tmp_path, backend="auto")  # what `python worker.py` runs
    async with stack.exits:
        rng = random.Random(7)
        prompt = [rng.randrange(256) for _ in range(61)]
        tail = [rng.randrange(256) for _ in range(9)]
        runs = []
        for chunks in ([61], [1] * 61, chunking(rng, 61)):
            sid = await stack.streams.open("alice", model_id)
            await feed(stack, sid, "alice", prompt, chunks)
            gen = await stack.streams.generate(sid, "alice", 6, temperature=0.0)  # decode steps in between
            last = await stack.streams.advance(sid, "alice", tokens=tail)
            runs.append((gen.tokens, last.output_digest, last.receipt))
        (gen0, out0, rec0), *others = runs
        assert rec0.backend == "exact:exact" and rec0.position == 61 + len(gen0) + 9  # backend:path
        for gen, out, rec in others:
            assert gen == gen0 and out == out0  # the same continuation, bit for bit
            assert rec.checksum == rec0.checksum and rec.position == rec0.position
        # and it is one local scan of the same tokens on the same backend
        local = load_model(model_id)
        one = local.advance(local.initial_state(), prompt + gen0 + tail)
        assert plaintext_checksum(one.state.tensors) == rec0.checksum
        assert digest(one.logits[-len(tail):]) == out0


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "q8"])
async def test_weights_read_as_stored_give_one_checksum_for_every_chunking_and_do_not_resume_in_another_format(
        temporal_env, tmp_path, fmt):
    """A worker serving a model's matrices in bfloat16 / float16 (read as stored by the exact
    kernels) or block-int8: three chunkings end with one checksum, a local scan's; the receipt
    names the format;
    a worker serving the same checkpoint in float32 refuses to resume it, typed, and the stream
    that made it is untouched."""
    stack = await make_stack(temporal_env, tmp_path, backend="auto", start_worker=False)
    async with stack.exits:
        await stack.worker(stack.new_activities(backend="auto", models={"narrow": f"tiny-mamba2#{fmt}",
                                                                         "wide": "tiny-mamba2"}))
        rng = random.Random(11)
        prompt, tail = [rng.randrange(256) for _ in range(40)], [rng.randrange(256) for _ in range(5)]
        runs = []
        for chunks in ([40], [1] * 40, chunking(rng, 40)):
            sid = await stack.streams.open("alice", "narrow")
            await feed(stack, sid, "alice", prompt, chunks)
            runs.append((sid, await stack.streams.advance(sid, "alice", tokens=tail)))
        (sid0, r0), *others = runs
        assert r0.receipt.arithmetic.id == f"exact-1/float32/weights-{fmt}" and r0.receipt.backend == "exact:exact"
        for _, r in others:
            assert r.receipt.checksum == r0.receipt.checksum and r.output_digest == r0.output_digest
        local = load_model("tiny-mamba2", weights=fmt)
        one = local.advance(local.initial_state(), prompt + tail)
        assert plaintext_checksum(one.state.tensors) == r0.receipt.checksum
        assert digest(one.logits[-len(tail):]) == r0.output_digest
        wide = load_model("tiny-mamba2")
        assert plaintext_checksum(wide.advance(wide.initial_state(), prompt + tail).state.tensors) \
            != r0.receipt.checksum
        cp = await stack.streams.checkpoint(sid0, "alice")
        with pytest.raises(WorkflowFailureError) as exc:
            await stack.streams.open("alice", "wide", resume=cp.receipt)
        assert getattr(exc.value.cause, "type", None) == "SchemaMismatch"
        assert await stack.streams.receipt(sid0) == cp.receipt
        resumed = await stack.streams.open("alice", "narrow", resume=cp.receipt)  # its own format resumes
        assert (await stack.streams.receipt(resumed)).checksum == cp.receipt.checksum


@pytest.mark.parametrize("source", ["tiny-mamba1", "tiny-mamba2#q8", "tiny-mamba3#bfloat16"])
async def test_the_fma_backend_gives_one_checksum_for_every_chunking_under_its_own_arithmetic(
        temporal_env, tmp_path, source):
    """A worker on the exact-fma backend (MAMBA_STREAM_BACKEND=exact-fma: arithmetic exact-2): three
    chunkings, decode steps between, end with one checksum and one output, a local exact-fma scan's;
    the receipt names exact-2, and the bits are not exact-1's."""
    stack = await make_stack(temporal_env, tmp_path, backend="exact-fma", start_worker=False)
    async with stack.exits:
        await stack.worker(stack.new_activities(backend="exact-fma", models={"m": source}))
        name, _, fmt = source.partition("#")
        rng = random.Random(13)
        prompt, tail = [rng.randrange(256) for _ in range(45)], [rng.randrange(256) for _ in range(7)]
        runs = []
        for chunks in ([45], [1] * 45, chunking(rng, 45)):
            sid = await stack.streams.open("alice", "m")
            await feed(stack, sid, "alice", prompt, chunks)
            gen = await stack.streams.generate(sid, "alice", 4, temperature=0.0)
            runs.append((gen.tokens, await stack.streams.advance(sid, "alice", tokens=tail)))
        (gen0, r0), *others = runs
        weights = f"/weights-{fmt}" if fmt else ""
        assert r0.receipt.arithmetic.id == f"exact-2/float32{weights}" and r0.receipt.backend == "exact-fma:exact"
        for gen, r in others:
            assert gen == gen0 and r.receipt.checksum == r0.receipt.checksum and r.output_digest == r0.output_digest
        local = load_model(name, backend="exact-fma", weights=fmt or None)
        one = local.advance(local.initial_state(), prompt + gen0 + tail)
        assert plaintext_checksum(one.state.tensors) == r0.receipt.checksum
        assert digest(one.logits[-len(tail):]) == r0.output_digest
        plain = load_model(name, backend="exact", weights=fmt or None)
        assert plaintext_checksum(plain.advance(plain.initial_state(), prompt + gen0 + tail).state.tensors) != (
            r0.receipt.checksum)


async def _serving(stack, acts, runtime):
    """A worker for the shared queue only (no affinity), wired by the plugin; stopped on exit."""
    client = await Client.connect(stack.address, runtime=runtime,
                                  plugins=[MambaStreamPlugin(keyring=stack.keyring, activities=acts)])
    return Worker(client, task_queue=stack.queue, activity_executor=concurrent.futures.ThreadPoolExecutor(4))


async def test_a_stream_that_moves_to_other_arithmetic_continues_and_the_change_is_recorded(temporal_env, tmp_path):
    """Exact, then a chunked worker, then exact again: the stream goes on, each receipt says what
    decided its bits and since when, the stats and the metric count the two changes, and the
    exact worker's drift samples re-run each chunk in another partition with no mismatch."""
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    stack = await make_stack(temporal_env, tmp_path, start_worker=False)
    async with stack.exits:
        opts = StreamOptions(**{**FAST.model_dump(), "affinity": False})
        meter = Meter(port)
        exact = stack.new_activities(backend="exact", metrics=StreamMetrics(runtime.metric_meter),
                                     drift_check_every=1)
        chunked = stack.new_activities(backend="chunked", metrics=StreamMetrics(runtime.metric_meter))
        toks = tokens(40, 5)
        async with await _serving(stack, exact, runtime):
            sid = await stack.streams.open("alice", "tiny-mamba3", options=opts)
            await stack.streams.advance(sid, "alice", tokens=toks[:20])
            r1 = await stack.streams.advance(sid, "alice", tokens=toks[20:27])
        a1 = r1.receipt.arithmetic
        assert a1 is not None and a1.id == "exact-1/float32" and a1.path == "exact"
        assert (r1.receipt.arithmetic_since, r1.receipt.arithmetic_changes) == (0, 0)
        assert meter.delta("mamba_stream_drift_logits_abs_count") == 2  # both chunks run again, split...
        assert meter.delta("mamba_stream_drift_logits_abs_sum") == 0.0  # ...bit for bit
        assert meter.delta("mamba_stream_exact_mismatches") == 0
        assert meter.delta("mamba_stream_models_loaded", backend="exact", path="exact",
                           arithmetic="exact-1/float32") == 1
        assert meter.delta("mamba_stream_arithmetic_changes") == 0

        async with await _serving(stack, chunked, runtime):
            r2 = await stack.streams.advance(sid, "alice", tokens=toks[27:33])
            stats = await stack.streams.stats(sid)  # a query needs a worker
        a2 = r2.receipt.arithmetic
        assert a2 is not None and not a2.exact and a2.backend == "chunked" and a2.id != a1.id
        assert (r2.receipt.position, r2.receipt.arithmetic_since, r2.receipt.arithmetic_changes) == (33, 27, 1)
        assert stats.arithmetic == a2.id and stats.arithmetic_changes == 1 and stats.chunks == 3

        async with await _serving(stack, exact, runtime):
            r3 = await stack.streams.advance(sid, "alice", tokens=toks[33:])
            stats = await stack.streams.stats(sid)
        assert r3.receipt.arithmetic.id == a1.id
        assert (r3.receipt.arithmetic_since, r3.receipt.arithmetic_changes) == (33, 2)
        assert stats.arithmetic == a1.id and stats.arithmetic_changes == 2
        assert meter.delta("mamba_stream_arithmetic_changes") == 2
        assert meter.delta("mamba_stream_arithmetic_changes", backend="chunked") == 1
        # the stream went on from the chunked worker's state, exact from position 33 on
        ex, ch = load_model("tiny-mamba3"), load_model("tiny-mamba3", backend="chunked")
        at27 = ex.advance(ex.initial_state(), toks[:27]).state
        assert plaintext_checksum(at27.tensors) == r1.receipt.checksum
        at33 = ch.advance(ch.restore_state(27, at27.tensors), toks[27:33]).state
        assert plaintext_checksum(at33.tensors) == r2.receipt.checksum
        end = ex.advance(ex.restore_state(33, at33.tensors), toks[33:]).state
        assert plaintext_checksum(end.tensors) == r3.receipt.checksum
        straight = ex.advance(at27, toks[27:]).state  # which is not where exact alone would be
        assert plaintext_checksum(straight.tensors) != r3.receipt.checksum


async def test_an_exact_drift_sample_that_finds_other_bits_counts_a_mismatch(tmp_path):
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    acts = StreamActivities(models=ModelRegistry(["tiny-mamba2"], backend="exact"),
                            store=open_store(f"file://{tmp_path}/s"), keyring=Keyring.generate(),
                            metrics=StreamMetrics(runtime.metric_meter), drift_check_every=1)
    try:
        meter = Meter(port)
        model = acts.models.get("tiny-mamba2")
        start = model.advance(model.initial_state(), tokens(9, 1)).state
        toks = tokens(12, 2)
        served = model.advance(start, toks)
        acts.drift.sample(acts.metrics, model, start, toks, served.logits, served.state)
        assert meter.delta("mamba_stream_exact_mismatches") == 0
        off = served.logits.clone()
        off[7, 3] = torch.nextafter(off[7, 3], off[7, 3] + 1)  # one logit one ulp away
        acts.drift.sample(acts.metrics, model, start, toks, off, served.state)
        assert meter.delta("mamba_stream_exact_mismatches") == 1
        bad = {k: v.clone() for k, v in served.state.tensors.items()}
        first = next(iter(bad))
        bad[first].view(-1)[0] = torch.nextafter(bad[first].view(-1)[0], bad[first].view(-1)[0] + 1)
        acts.drift.sample(acts.metrics, model, start, toks, served.logits,
                          model.restore_state(served.state.position, bad))
        assert meter.delta("mamba_stream_exact_mismatches") == 2  # a state one ulp away, too
    finally:
        acts.close()


async def test_a_model_whose_kernels_fail_the_probe_says_so_in_its_path_arithmetic_and_metric(tmp_path, monkeypatch):
    """A product that depends on its batch (as tests/scan/exact/test_probe.py forces it): the probe at
    load catches it, the twins run, and the worker's metric and the receipt's arithmetic say so."""
    from mamba_stream.scan.exact import _kernels, _primitives

    ops = _kernels._kernel_ops()
    honest = type(ops).linear

    def batch_dependent(self, x, weight, bias=None):
        out = honest(self, x, weight, bias)
        return torch.nextafter(out, out + 1) if out.numel() // out.shape[-1] > 1 else out

    monkeypatch.setattr(type(ops), "linear", batch_dependent)
    monkeypatch.setattr(_primitives, "_kernel_primitives", functools.cache(_primitives._kernel_primitives.__wrapped__))
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    acts = StreamActivities(models=ModelRegistry(["tiny-mamba1"], backend="exact"),
                            store=open_store(f"file://{tmp_path}/s"), keyring=Keyring.generate(),
                            metrics=StreamMetrics(runtime.metric_meter))
    try:
        meter = Meter(port)
        model = acts._model("tiny-mamba1")
        assert model.exact_probe.path == "exact-twin"
        assert meter.delta("mamba_stream_models_loaded", backend="exact", path="exact-twin",
                           arithmetic="exact-1/float32") == 1
        step = model.advance(model.initial_state(), tokens(5, 3))
        a = model.arithmetic(step.path)
        assert step.path == "exact-twin" and a.path == "exact-twin" and a.id == "exact-1/float32"  # same bits
        acts._model("tiny-mamba1")
        assert meter.delta("mamba_stream_models_loaded") == 1  # counted once per model
    finally:
        acts.close()
