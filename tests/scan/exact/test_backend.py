"""The exact backends (`_backend`): nothing the caller cannot see changes a bit (the chunking, the
batch, prefill against decode, the instruction set the kernels were built for, whether they were
built at all), and each arithmetic gives its pinned bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mamba_stream.scan import load_model
from mamba_stream.scan.exact import ARITHMETIC, ARITHMETIC_FMA, exact_backend, exact_step_backend
from tests.scan._helpers import ARCH_PRESETS, model_for, scan_chunks, tokens
from tests.scan.exact._helpers import NEEDS_KERNELS, ROOT

pytestmark = NEEDS_KERNELS


def test_the_fma_backend_is_probed_and_named_on_its_own():
    """One model, both arithmetics: each probed on its own kernels, each result naming its own
    arithmetic in the receipt's id, and other bits (the same tokens, another checksum)."""
    one, two = load_model("tiny-mamba2", backend="exact"), load_model("tiny-mamba2", backend="exact-fma")
    assert two.exact_probe.kernels and two.exact_probe.path == "exact"
    assert (one.arithmetic().id, two.arithmetic().id) == ("exact-1/float32", "exact-2/float32")
    assert one.arithmetic().exact and two.arithmetic().exact
    a, b = (m.advance(m.initial_state(), tokens(12, 3)) for m in (one, two))
    assert a.path == b.path == "exact" and not torch.equal(a.logits, b.logits)
    assert (a.logits - b.logits).abs().max() < 1e-3  # the same function, rounded otherwise


@st.composite
def _schedules(draw: st.DrawFn) -> list[tuple[int, list[int]]]:
    """Co-scheduled streams: (warm-up length, next chunk length) each."""
    n = draw(st.integers(1, 6))
    return [(draw(st.integers(0, 20)), draw(st.integers(0, 9))) for _ in range(n)]


#: the computation, or the computation and the format its weights are read in
COMPUTE = ["float32", "float64", "float32/bfloat16", "float32/float16", "float32/q8"]


#: ... and the exact arithmetic: exact-1 in each, exact-2 (float32 only) in each float32 one
EXACT_COMPUTE = [("exact", d) for d in COMPUTE] + [("exact-fma", d) for d in COMPUTE if d != "float64"]


@pytest.mark.parametrize(("backend", "dtype"), EXACT_COMPUTE)
@pytest.mark.parametrize("preset", ARCH_PRESETS)
@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(schedule=_schedules())
def test_any_co_scheduled_batch_gives_each_stream_its_solo_bits(preset, backend, dtype, schedule):
    model = model_for(preset, backend, dtype)
    states = [model.advance(model.initial_state(), tokens(w, 10 + i)).state for i, (w, _) in enumerate(schedule)]
    chunks = [tokens(c, 50 + i) for i, (_, c) in enumerate(schedule)]
    for s, c, got in zip(states, chunks, model.advance_batch(states, chunks), strict=True):
        solo = model.advance(s, c)
        assert torch.equal(got.logits, solo.logits) and got.state.equal(solo.state)
    # the slot table's decode step over the same streams, one token each, any subset of rows
    buffers = {name: torch.stack([s.tensors[name] for s in states]) for name in states[0].tensors}
    rows = list(range(0, len(states), 2))
    logits, path = model.step_rows(buffers, torch.tensor(rows), torch.tensor([7] * len(rows)))
    for i, r in enumerate(rows):
        solo = model.advance(states[r], [7])
        assert torch.equal(logits[i], solo.logits[0]) and path == "exact"
        assert all(torch.equal(buffers[k][r], solo.state.tensors[k]) for k in buffers)


@pytest.mark.parametrize(("backend", "dtype"), EXACT_COMPUTE)
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_the_in_place_step_gives_the_steps_bits_and_touches_only_its_rows(preset, backend, dtype):
    """`step_rows(in_place=True)`: the layers write the slot buffers as they run, on a span of rows
    (no copy-back) and on scattered ones, with the bits of the out-of-place step."""
    model = model_for(preset, backend, dtype)
    step, plain = exact_step_backend(model.module, model.dtype, backend), exact_backend(model.module, model.dtype,
                                                                                            backend)[0]
    assert step is not plain and step.name == plain.name == backend
    states = [model.advance(model.initial_state(), tokens(n, 30 + n)).state for n in (3, 7, 1, 12, 5)]
    stacked = {name: torch.stack([s.tensors[name] for s in states]) for name in states[0].tensors}
    for rows in ([1, 2, 3], [4, 0, 2], [0, 1, 2, 3, 4]):
        plain = {k: v.clone() for k, v in stacked.items()}
        fast = {k: v.clone() for k, v in stacked.items()}
        toks = torch.tensor([9, 200, 31, 4, 77][: len(rows)])
        want, path = model.step_rows(plain, torch.tensor(rows), toks)
        got, path_in_place = model.step_rows(fast, torch.tensor(rows), toks, in_place=True)
        assert torch.equal(got, want) and path_in_place == path == "exact"
        assert all(torch.equal(fast[k], plain[k]) for k in plain), rows  # stepped rows and the others
        for r in sorted(set(range(5)) - set(rows)):
            assert all(torch.equal(fast[k][r], stacked[k][r]) for k in fast)


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
@pytest.mark.parametrize("dtype", ["float32", "float32/bfloat16", "float32/float16", "float32/q8"])
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_decode_token_by_token_equals_the_prefill_of_the_same_tokens(preset, dtype, backend):
    model = model_for(preset, backend, dtype)
    start = model.advance(model.initial_state(), tokens(9, 4)).state
    toks = tokens(40, 5)
    chunk = model.advance(start, toks)
    logits, state = scan_chunks(model, start, toks, [1] * 40)
    assert torch.equal(logits, chunk.logits) and state.equal(chunk.state)


_CHECKSUMS = """
import hashlib, json, sys, torch
from mamba_stream.scan import load_model
from tests.scan._helpers import tokens
out = {}
for entry in sys.argv[1].split(","):
    backend, _, model = entry.rpartition(":")
    name, _, weights = model.partition("@")
    m = load_model(name, backend=backend or "exact", weights=weights or None)
    r = m.advance(m.advance(m.initial_state(), tokens(30, 1)).state, tokens(17, 2))
    h = hashlib.sha256(r.logits.numpy().tobytes())
    for t in r.state.tensors.values():
        h.update(t.contiguous().numpy().tobytes())
    out[entry] = [h.hexdigest(), r.path, m.arithmetic(r.path).id]
print(json.dumps(out))
"""


def _checksums(env: dict[str, str], presets: list[str]) -> dict[str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _CHECKSUMS, ",".join(presets)], env={**os.environ, **env},
                          capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_same_bits_for_every_instruction_set_thread_count_and_without_kernels(tmp_path):
    """Kernels built for plain x86-64 (SSE2), for AVX2 and for this machine, on one or two threads,
    and the twins alone, under torch's scalar build: one checksum per preset."""
    presets = [*PINNED, *PINNED_FMA]
    cache = str(tmp_path / "cache")
    runs = {
        "native, 2 threads": {"MAMBA_STREAM_CACHE": cache, "OMP_NUM_THREADS": "2"},
        "native, 1 thread": {"MAMBA_STREAM_CACHE": cache, "OMP_NUM_THREADS": "1"},
        "x86-64": {"MAMBA_STREAM_CACHE": cache, "MAMBA_STREAM_EXACT_MARCH": "x86-64"},
        "x86-64-v3": {"MAMBA_STREAM_CACHE": cache, "MAMBA_STREAM_EXACT_MARCH": "x86-64-v3",
                      "ATEN_CPU_CAPABILITY": "avx2"},
        "twins, torch default": {"MAMBA_STREAM_EXACT_KERNELS": "0", "ATEN_CPU_CAPABILITY": "default"},
    }
    got = {label: _checksums(env, presets) for label, env in runs.items()}
    first = got["native, 2 threads"]
    for label, sums in got.items():
        assert {k: v[0] for k, v in sums.items()} == {k: v[0] for k, v in first.items()}, label
    assert {v[1] for v in got["twins, torch default"].values()} == {"exact-twin"}
    assert {v[1] for v in first.values()} == {"exact"}
    assert len({v[0] for v in first.values()}) == len(presets)  # and the presets do differ
    # the receipt's arithmetic says so: one id everywhere, naming the weight format where it is narrower
    for sums in got.values():
        assert {k: v[2] for k, v in sums.items()} == {
            k: (ARITHMETIC_FMA if k.startswith("exact-fma:") else ARITHMETIC) + "/float32"
            + (f"/weights-{k.partition('@')[2]}" if "@" in k else "") for k in presets}
    # and they are these versions' bits
    assert {k: v[0] for k, v in first.items()} == {**PINNED, **PINNED_FMA}


#: The bits of arithmetic `exact-1` (the `_CHECKSUMS` run), on whatever CPU this runs. A change
#: of any of them is a new arithmetic: bump `scan.exact.ARITHMETIC`, then these.
PINNED = {
    "tiny-mamba1": "d19c7d10294ac3235319c4821186f49b0e2bfddfc715a552463f63870dce09ed",
    "tiny-mamba2": "09f1f989186456a65a888209770d43b720d6059a90dbc135f6064a004b79a74f",
    "tiny-mamba3": "4066780d1324baf2404e5882328bced56ca5ba1ae0617f193f4f20838e59a836",
    "tiny-mamba3-mimo": "de54304970cbfa0be1c72472be1371119c7e919e602ac96007f9d1b6c9b32450",
    # the same presets with their matrices rounded to bfloat16 / float16 at load, read as such, ...
    "tiny-mamba1@bfloat16": "73010811dc29743ca2b568db9278755ee019a7e2d95d8de13acd0e544d79a896",
    "tiny-mamba2@bfloat16": "19545b517312e28a30b4928b7ed593ddd3cd6a80497f1c2dc7abfa88f3dd0c2a",
    "tiny-mamba3@float16": "723aca271103d3752f34be12f7064e04aad52c5a5ccded794573c1da23fb7369",
    # ... and quantized to block-int8 at load
    "tiny-mamba1@q8": "1b8568157024c3ed3ff9a2f2952f103a7ecce196af04c1be89de6626351d3bb4",
    "tiny-mamba2@q8": "51c40b1f052d5f9d31780cdd9b4b1b1976733f3e288f922f55d677bf09d97b46",
    "tiny-mamba3-mimo@q8": "715099238ad46b1a2708d12502f929a33796c0a61686b7d3e139fe9ba4136fa4",
}


#: The bits of arithmetic `exact-2` (backend "exact-fma"), as `PINNED` for exact-1: each differs
#: from exact-1's for the same preset (a fused multiply-add rounds once where exact-1 rounds twice).
PINNED_FMA = {
    "exact-fma:tiny-mamba1": "d9a6551c537207a7d6db420c3eefa4bfe118eed9bc7e4105bd4cffc38eaa7b77",
    "exact-fma:tiny-mamba2": "8d8ff8fb8799d8ab2893bbdf71ec1f62ddfca4d3a38a4c3f45fe21559b4a40b7",
    "exact-fma:tiny-mamba3": "cce01caf59208b20c3dd6495f01bb8d21148431f5dceea7d8d715c8c2076e645",
    "exact-fma:tiny-mamba3-mimo": "bb7fe65962d0dcbbe97caa09077acd1669d96758edb148ebddcbb6556fe184e8",
    "exact-fma:tiny-mamba1@bfloat16": "ab86020a93b435d342b49305f1db8cf8b6a429655d13259cfb77c0b7a4a71637",
    "exact-fma:tiny-mamba3@float16": "78e1627c5767403b47d8889273b849d9420900ed97a7088194527436a5fd1657",
    "exact-fma:tiny-mamba2@q8": "8995e76a7dfb17ea530d080b4afad77cc74b1155b8cfec1402fb609b2936d090",
}


def test_this_version_of_the_exact_arithmetic_gives_its_pinned_bits():
    assert ARITHMETIC == "exact-1" and ARITHMETIC_FMA == "exact-2"
    assert {k: v[0] for k, v in _checksums({}, [*PINNED, *PINNED_FMA]).items()} == {**PINNED, **PINNED_FMA}
    for entry, digest in PINNED_FMA.items():  # exact-2 is not exact-1 under another name
        assert digest != PINNED.get(entry.partition(":")[2])
