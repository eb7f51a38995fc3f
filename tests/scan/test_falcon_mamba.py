"""FalconMamba (a Mamba-1 with weightless RMS norms on dt, B and C) from a Hugging Face directory.

The truth is transformers' own FalconMamba, a tiny random one saved with `save_pretrained` and run
in float32 on its slow (pure PyTorch) path. Ours must match it within 1e-4 of each row's logit
scale on every backend, give the same bits under any chunking on the exact backend, keep the
norms through q8, bfloat16 and our own checkpoints, and tell its state from a plain Mamba-1's.
A plain Mamba-1 read from the same weights misses the bound: the norms are what is compared.
"""

from __future__ import annotations

import json
import shutil
import types

import pytest
import torch

from mamba_stream.scan import ModelConfig, _triton, load_model, save_checkpoint
from mamba_stream.scan._errors import ConfigError
from mamba_stream.scan._loading import config_from_json, mamba_ssm_config
from mamba_stream.scan.exact._kernels import _kernel_ops
from tests.scan._helpers import scan_chunks
from tests.scan._mamba_ssm import import_mamba_ssm, require

pytestmark = pytest.mark.crosscheck

N_TOKENS = 96
CHUNKINGS = [[N_TOKENS], [1, 7, 30, 58], [1] * N_TOKENS]
BOUND = 1e-4  # row-wise max |diff| / max |logit| against transformers, float32
EPS = 1e-6  # FalconMambaConfig's mixer_rms_eps


def _hf_falcon():
    """A seeded tiny FalconMamba of transformers' own making: 3 layers, hidden 64, d_state 16, an
    untied head (as FalconMamba-7B has)."""
    require("transformers")
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = FalconMambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, state_size=16, expand=2,
                                conv_kernel=4, tie_word_embeddings=False, mixer_rms_eps=EPS)
        return FalconMambaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    """(transformers' model, its float32 directory, the token ids, transformers' logits (L, V))."""
    hf = _hf_falcon()
    d = tmp_path_factory.mktemp("falcon-f32")
    hf.save_pretrained(str(d))  # config.json + model.safetensors, HF tensor names
    ids = torch.randint(0, 256, (1, N_TOKENS), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        truth = hf(ids).logits[0].float()
    return hf, d, ids[0].tolist(), truth


def _rel(got: torch.Tensor, truth: torch.Tensor) -> float:
    """max over rows of max |got - truth| / max |truth|: (L, V) logits against the truth."""
    return float(((got - truth).abs().amax(-1) / truth.abs().amax(-1)).max())


def _plain_copy(src, dst):
    """The same checkpoint declared a plain Mamba-1 (HF `mamba`: the same tensor names, no norms)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "mamba"
    cfg.pop("mixer_rms_eps")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _state_equal(a, b) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_falcon_mamba(falcon, backend):
    _, d, toks, truth = falcon
    model = load_model(d, backend=backend)
    assert model.config.architecture == "mamba1" and model.config.bcdt_rms_eps == EPS
    for chunks in ([N_TOKENS], [1, 7, 30, 58]):
        logits, _ = scan_chunks(model, model.initial_state(), toks, chunks)
        rel = _rel(logits, truth)
        print(f"CROSSCHECK HF falcon_mamba vs ours ({backend}, chunks {chunks}): max rel {rel:.2e}")
        assert rel <= BOUND, (backend, chunks, rel)


def test_the_same_weights_as_a_plain_mamba1_miss_the_bound(falcon, tmp_path):
    """The negative control: without the norms the comparison fails, so it can."""
    _, d, toks, truth = falcon
    plain = load_model(_plain_copy(d, tmp_path / "plain"), backend="exact")
    assert plain.config.bcdt_rms_eps is None
    rel = _rel(plain.advance(plain.initial_state(), toks).logits, truth)
    print(f"CROSSCHECK HF falcon_mamba vs the same weights as a plain Mamba-1 (exact): max rel {rel:.2e}")
    assert rel > 100 * BOUND


def test_exact_chunking_gives_the_same_bits_and_the_one_call_step_is_not_taken(falcon, tmp_path, monkeypatch):
    """[96], [1, 7, 30, 58] and 96 x 1 on the exact backend: the same logits and every state
    tensor bit for bit. The one-call decode steps (a layer's, `mamba1_step_f32`, and a whole
    model's, `model_step_f32`) have no dt/B/C norms, so a FalconMamba's tokens go through the
    primitives; a plain Mamba-1 of the same shapes takes the model's (the count is live)."""
    _, d, toks, truth = falcon
    ops = _kernel_ops()
    calls: list[int] = []
    if ops is not None:
        for name in ("mamba1_step_f32", "model_step_f32"):
            real = getattr(ops.lib, name)
            monkeypatch.setattr(ops.lib, name, lambda *a, _real=real: (calls.append(1), _real(*a))[1])
    model = load_model(d, backend="exact")
    runs = [scan_chunks(model, model.initial_state(), toks, chunks) for chunks in CHUNKINGS]
    for (logits, state), chunks in zip(runs[1:], CHUNKINGS[1:], strict=True):
        assert torch.equal(logits, runs[0][0]), chunks[:4]
        assert _state_equal(state, runs[0][1]), chunks[:4]
    assert _rel(runs[-1][0], truth) <= BOUND
    assert model.advance(model.initial_state(), toks[:1]).path == model.exact_probe.path
    assert calls == []
    if ops is not None:
        plain = load_model(_plain_copy(d, tmp_path / "plain"), backend="exact")
        if plain.exact_probe.kernels:  # (the probe steps too: counted from here)
            calls.clear()
            plain.advance(plain.initial_state(), toks[:1])
            assert len(calls) == 1  # the whole model's step, its layers' inside it


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
def test_the_slot_tables_decode_step_gives_each_stream_its_own_bits(falcon, backend):
    """`step_rows`, out of place and in place (the exact backend's in-place step backend, which
    has the one-call step too): each row the bits of its stream's own `advance`."""
    _, d, toks, _ = falcon
    model = load_model(d, backend=backend)
    states = [model.advance(model.initial_state(), toks[:n]).state for n in (3, 17, 1, 40)]
    stacked = {name: torch.stack([s.tensors[name] for s in states]) for name in states[0].tensors}
    rows, step = [0, 1, 3], [9, 200, 31]
    for in_place in (False, True):
        buffers = {k: v.clone() for k, v in stacked.items()}
        logits, path = model.step_rows(buffers, torch.tensor(rows), torch.tensor(step), in_place=in_place)
        assert path == model.exact_probe.path
        for i, r in enumerate(rows):
            solo = model.advance(states[r], [step[i]])
            assert torch.equal(logits[i], solo.logits[0]), (in_place, r)
            assert all(torch.equal(buffers[k][r], solo.state.tensors[k]) for k in buffers), (in_place, r)
        assert all(torch.equal(buffers[k][2], stacked[k][2]) for k in buffers)


def test_the_schema_tells_a_falcon_mamba_state_from_a_plain_mamba1_state(falcon, tmp_path):
    _, d, _, _ = falcon
    falcon_schema = load_model(d, backend="exact").schema
    plain_schema = load_model(_plain_copy(d, tmp_path / "plain"), backend="exact").schema
    assert falcon_schema.tensors == plain_schema.tensors and falcon_schema.state_bytes == plain_schema.state_bytes
    assert falcon_schema.discretization.bcdt_rms_eps == EPS and plain_schema.discretization.bcdt_rms_eps is None
    assert falcon_schema.fingerprint() != plain_schema.fingerprint()
    # unset, the field is left out of the JSON: a plain Mamba-1 keeps the fingerprint it had before the field
    assert "bcdt_rms_eps" not in plain_schema.canonical_json()
    assert f'"bcdt_rms_eps":{EPS}' in falcon_schema.canonical_json()
    back = type(falcon_schema).model_validate_json(falcon_schema.model_dump_json())
    assert back == falcon_schema and back.fingerprint() == falcon_schema.fingerprint()


def test_our_checkpoint_of_a_falcon_mamba_keeps_the_norms(falcon, tmp_path):
    """save_checkpoint (mamba-ssm layout) and back: `bcdt_rms_eps` in ssm_cfg, the same bits."""
    _, d, toks, _ = falcon
    model = load_model(d, backend="exact")
    save_checkpoint(model, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["ssm_cfg"]["bcdt_rms_eps"] == EPS == mamba_ssm_config(model.config)["ssm_cfg"]["bcdt_rms_eps"]
    back = load_model(tmp_path / "ours", backend="exact")
    assert back.config.bcdt_rms_eps == EPS and back.schema == model.schema
    a, b = model.advance(model.initial_state(), toks), back.advance(back.initial_state(), toks)
    assert torch.equal(a.logits, b.logits) and _state_equal(a.state, b.state)
    # a plain Mamba-1's mamba-ssm config has no such key (mamba-ssm's Mamba takes none)
    plain = mamba_ssm_config(model.config.model_copy(update={"bcdt_rms_eps": None}))
    assert "bcdt_rms_eps" not in plain["ssm_cfg"]


def test_a_bfloat16_checkpoint_is_kept_as_stored_and_computes_its_own_function(falcon, tmp_path):
    """transformers' bfloat16 save: the exact backend reads the matrices as stored, with the bits of
    their float32 widening, and matches transformers' float32 forward of the rounded weights."""
    hf, _, toks, _ = falcon
    d = tmp_path / "bf16"
    rounded = _hf_falcon()
    rounded.load_state_dict(hf.state_dict())
    rounded.to(torch.bfloat16).save_pretrained(str(d))
    kept = load_model(d, backend="exact")
    wide = load_model(d, backend="exact", weights="float32")
    assert kept.weight_format == "bfloat16" and kept.schema.weights == "bfloat16"
    assert kept.module.backbone.layers[0].mixer.x_proj.weight.dtype == torch.bfloat16
    assert kept.schema.discretization.bcdt_rms_eps == EPS
    a, b = kept.advance(kept.initial_state(), toks), wide.advance(wide.initial_state(), toks)
    assert torch.equal(a.logits, b.logits) and _state_equal(a.state, b.state)
    with torch.no_grad():
        truth = rounded.float()(torch.tensor([toks])).logits[0]
    rel = _rel(a.logits, truth)
    print(f"CROSSCHECK HF falcon_mamba bf16 checkpoint (float32 forward) vs ours (exact, bf16 kept): {rel:.2e}")
    assert rel <= BOUND


def test_q8_weights_keep_the_norms_and_chunk_exactly(falcon, tmp_path):
    _, d, toks, truth = falcon
    q8 = load_model(d, backend="exact", weights="q8")
    assert q8.weight_format == "q8" and q8.schema.weights == "q8"
    assert q8.schema.discretization.bcdt_rms_eps == EPS
    runs = [scan_chunks(q8, q8.initial_state(), toks, chunks) for chunks in CHUNKINGS]
    for logits, state in runs[1:]:
        assert torch.equal(logits, runs[0][0]) and _state_equal(state, runs[0][1])
    # q8 rounds the matrices: nearer transformers' FalconMamba than the same float32 weights without norms
    plain = load_model(_plain_copy(d, tmp_path / "plain"), backend="exact")
    rel, rel_plain = _rel(runs[0][0], truth), _rel(plain.advance(plain.initial_state(), toks).logits, truth)
    print(f"CROSSCHECK HF falcon_mamba vs ours (exact, q8): {rel:.2e} (plain Mamba-1, float32: {rel_plain:.2e})")
    assert rel < rel_plain / 10
    save_checkpoint(q8, tmp_path / "q8")
    back = load_model(tmp_path / "q8", backend="exact")
    assert back.weight_format == "q8" and back.schema == q8.schema
    assert torch.equal(back.advance(back.initial_state(), toks).logits, runs[0][0])


@pytest.fixture
def triton_twins(monkeypatch):
    """The triton backend's Mamba-1 kernel (`selective_state_update`) replaced by mamba-ssm's own
    reference, so its wiring runs on a CPU (as tests/scan/test_triton_wiring.py does)."""
    import_mamba_ssm()
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update_ref

    def update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, **_):
        return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)

    monkeypatch.setattr(_triton, "_kernels", lambda: types.SimpleNamespace(state_update=update_ref))


def test_the_triton_path_normalizes_too(falcon, triton_twins):
    """The triton backend runs the mixer's own code around its kernels, norms included."""
    _, d, toks, truth = falcon
    model = load_model(d, backend="chunked")
    model.backend = "triton"  # on CPU, with the twin: the wiring alone is under test
    for chunks in ([N_TOKENS], [1, 7, 30, 58]):
        logits, _ = scan_chunks(model, model.initial_state(), toks, chunks)
        rel = _rel(logits, truth)
        print(f"CROSSCHECK HF falcon_mamba vs ours (triton wiring on CPU, chunks {chunks}): max rel {rel:.2e}")
        assert rel <= BOUND, (chunks, rel)
    assert model.advance(model.initial_state(), toks[:1]).path == "step-kernel"


def test_the_norms_are_a_validated_mamba1_option():
    base = {"d_model": 64, "n_layer": 2, "vocab_size": 256}
    assert ModelConfig.create(architecture="mamba1", **base).bcdt_rms_eps is None
    for bad in (0.0, -1e-6, float("inf"), float("nan")):
        with pytest.raises(ConfigError) as err:
            ModelConfig.create(architecture="mamba1", **base, bcdt_rms_eps=bad)
        assert err.value.field == "bcdt_rms_eps"
    for arch in ("mamba2", "mamba3"):
        with pytest.raises(ConfigError) as err:
            ModelConfig.create(architecture=arch, **base, bcdt_rms_eps=1e-6)
        assert err.value.field == "bcdt_rms_eps"
    with pytest.raises(ConfigError) as err:  # a mamba-ssm Mamba2 layer has no such option
        config_from_json({"d_model": 64, "n_layer": 2, "vocab_size": 256,
                          "ssm_cfg": {"layer": "Mamba2", "bcdt_rms_eps": 1e-6}})
    assert err.value.field == "ssm_cfg.bcdt_rms_eps"
    hf = {"model_type": "falcon_mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256}
    cfg, layout = config_from_json(hf)  # FalconMambaConfig's defaults: state 16, eps 1e-6
    assert layout == "hf" and cfg.d_state == 16 and cfg.bcdt_rms_eps == 1e-6
    assert config_from_json({**hf, "mixer_rms_eps": 1e-5})[0].bcdt_rms_eps == 1e-5
