"""Presets are the same bytes on every machine: revisions pinned, and rebuilt under every
instruction set torch (and numpy) can be told to use, with 1 and 2 threads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest
import torch

from mamba_stream.scan import PRESETS, init_weights, load_model, weights_revision
from mamba_stream.scan._init import exp, expm1, log, ndtri, normal, uniform

ROOT = Path(__file__).resolve().parents[2]

#: the random-weight presets' revisions; a change here is a new model for every deployed stream
PINNED = {
    "tiny-mamba1": "sha256:d6b2ff758e88c0bcaec09e381e1bce825d3a2179094f10c73a6e0bff3ab785a5",
    "tiny-mamba2": "sha256:cd2a69d4328159aa3f591e5aaec7b8e4fa5068129919e73fabeffaae50cb5732",
    "tiny-mamba3": "sha256:814e46ad4167b0edd59358ebd53526bcd276676abf41ef2fdd23862501e9ab94",
    "tiny-mamba3-mimo": "sha256:4118815fa1aa37057e96d27499b16e272d754b8811d1dc83a1dba83cec80b34e",
}

_PROBE = """
import json, torch
from mamba_stream.scan import PRESETS, load_model
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                  "revisions": {n: load_model(n).revision for n in PRESETS}}))
"""


def _cpu_has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f " in flags.replace("\n", " ")


def _numpy_dispatch() -> str:
    """numpy's dispatchable CPU features, all of them: disabling them leaves its baseline build."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__
    except ImportError:  # numpy < 2
        return ""
    return " ".join(__cpu_dispatch__)


CAPABILITIES = ["default", "avx2"] + (["avx512"] if _cpu_has_avx512() else [])


def test_every_preset_has_its_pinned_revision():
    assert set(PINNED) == set(PRESETS)
    for name in PRESETS:
        assert load_model(name).revision == PINNED[name], name


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_presets_are_the_same_bytes_under_every_instruction_set_and_thread_count(capability, threads):
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    if capability == "default":
        env["NPY_DISABLE_CPU_FEATURES"] = _numpy_dispatch()
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, cwd=ROOT,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["capability"] == capability.upper() and got["threads"] == threads  # the override took effect
    assert got["revisions"] == PINNED


def test_the_initialization_does_not_move_the_callers_rng():
    torch.manual_seed(7)
    before = torch.rand(3)
    torch.manual_seed(7)
    load_model("tiny-mamba2")
    assert torch.equal(torch.rand(3), before)


def test_the_recipe_sets_every_parameter_that_is_not_a_constructor_constant():
    from mamba_stream.scan import ModelConfig
    from mamba_stream.scan._lm import MambaLM

    for name, (fields, _) in PRESETS.items():
        cfg = ModelConfig.create(**fields)
        a, b = MambaLM(cfg), MambaLM(cfg)  # two constructions: different torch-RNG garbage
        init_weights(a, 11)
        init_weights(b, 11)
        assert weights_revision(a.state_dict()) == weights_revision(b.state_dict()), name
        other = MambaLM(cfg)
        init_weights(other, 12)
        differ = [k for k, v in a.state_dict().items() if not torch.equal(v, other.state_dict()[k])]
        assert "backbone.embedding.weight" in differ and any("in_proj" in k for k in differ)


# --- the arithmetic ---------------------------------------------------------------------------


def test_log_exp_and_expm1_agree_with_libm_to_an_ulp_or_two():
    x = np.exp(np.linspace(-40.0, 40.0, 20001))
    ref = np.array([math.log(v) for v in x])
    assert np.max(np.abs(log(x) - ref)) <= 2 * np.finfo(np.float64).eps * np.max(np.abs(ref))
    near_one = 1.0 + np.linspace(-1e-6, 1e-6, 2001)
    ref1 = np.array([math.log(v) for v in near_one])
    assert np.max(np.abs(log(near_one) - ref1)) <= 1e-21
    y = np.linspace(-60.0, 60.0, 20001)
    assert np.max(np.abs(exp(y) / np.array([math.exp(v) for v in y]) - 1.0)) <= 4e-16
    z = np.concatenate([np.linspace(-2.0, 2.0, 4001), np.geomspace(1e-12, 0.4, 200), -np.geomspace(1e-12, 0.4, 200)])
    ref_z = np.array([math.expm1(v) for v in z])
    assert np.max(np.abs(expm1(z) - ref_z) / np.abs(np.where(ref_z == 0, 1.0, ref_z))) <= 6e-16
    with pytest.raises(ValueError):
        log(np.array([0.0]))
    with pytest.raises(ValueError):
        exp(np.array([800.0]))


def test_the_normal_quantile_is_acklams_accuracy_everywhere():
    p = np.concatenate([np.geomspace(1e-15, 0.02425, 400), np.linspace(0.02425, 0.97575, 2001),
                        1.0 - np.geomspace(1e-15, 0.02425, 400)])
    ref = np.array([NormalDist().inv_cdf(float(v)) for v in p])
    assert np.max(np.abs(ndtri(p) - ref) / np.maximum(np.abs(ref), 1.0)) <= 1.2e-9


def test_draws_have_their_distribution_and_each_name_its_own_stream():
    n = normal(3, "w", (400_000,), 0.5)
    assert abs(n.mean()) < 4 * 0.5 / math.sqrt(n.size) and abs(n.std() / 0.5 - 1) < 0.005
    assert abs(np.mean((n / 0.5) ** 4) - 3.0) < 0.05  # normal tails, not a bounded approximation
    u = uniform(3, "w", (400_000,), -2.0, 6.0)
    assert u.min() > -2.0 and u.max() < 6.0 and abs(u.mean() - 2.0) < 0.02
    assert np.array_equal(normal(3, "w", (10,), 1.0), normal(3, "w", (10,), 1.0))
    assert not np.array_equal(normal(3, "w", (10,), 1.0), normal(3, "v", (10,), 1.0))
    assert not np.array_equal(normal(3, "w", (10,), 1.0), normal(4, "w", (10,), 1.0))
    assert np.array_equal(normal(3, "w", (4, 5), 1.0).reshape(-1)[:10], normal(3, "w", (10,), 1.0))


def test_a_config_copied_with_changes_derives_its_sizes_afresh():
    # the derived sizes are cached on the frozen config: a copy with an update must not keep them
    from mamba_stream.scan import ModelConfig

    cfg = ModelConfig.create(architecture="mamba2", d_model=64, n_layer=1, vocab_size=250, headdim=16, d_state=16,
                             pad_vocab_size_multiple=8)
    assert (cfg.d_inner, cfg.nheads, cfg.conv_dim, cfg.padded_vocab_size) == (128, 8, 160, 256)
    wider = cfg.model_copy(update={"d_model": 128, "vocab_size": 260})
    assert (wider.d_inner, wider.nheads, wider.conv_dim, wider.padded_vocab_size) == (256, 16, 288, 264)
    assert cfg.model_copy().d_inner == 128
