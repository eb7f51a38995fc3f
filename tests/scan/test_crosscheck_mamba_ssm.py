"""Our layers and language model against mamba-ssm's own pure-PyTorch references (float32).

Each mamba-ssm module gets our preset's weights through `load_state_dict(strict=True)` (the
parameter names are the same), runs with its kernels rebound to mamba-ssm's reference functions
(`selective_scan_ref`, `ssd_minimal_discrete`, `selective_state_update_ref`, the Mamba-3 fused
step reference and rotary reference), and is compared with our reference backend (one token at a
time) and our chunked backend, on outputs and on every state tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

from mamba_stream.scan import PRESETS, ModelConfig, init_model, load_model, weights_revision
from mamba_stream.scan._backends import CHUNKED, REFERENCE
from tests.scan._mamba_ssm import import_mamba_ssm, patch_to_references

pytestmark = pytest.mark.crosscheck

# Largest differences seen on this machine were <= 1.3e-6 (printed with `make crosscheck`);
# the bound leaves room for other CPUs while staying far below what a wrong formula gives.
ATOL = 2e-5
L = 29
PREFILL = 11


@pytest.fixture
def refs(monkeypatch: pytest.MonkeyPatch):
    import_mamba_ssm()
    return patch_to_references(monkeypatch)


def _our_layer(name: str, **changes):
    """Layer 0 of a preset, or of a fresh model from the preset's config with `changes`."""
    if changes:
        fields, seed = PRESETS[name]
        model = init_model(ModelConfig.create(**{**fields, **changes}), seed, backend="reference")
    else:
        model = load_model(name, backend="reference")
    mixer = model.module.mixers[0]
    # The init sets D, norm weights and biases to constants, which would hide a wrong layout
    # (per-head vs per-channel D, which norm weight goes where): perturb them.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for pname, p in mixer.named_parameters():
            if pname.split(".")[-1] in ("D", "bias", "B_bias", "C_bias", "mimo_x", "mimo_z", "mimo_o") \
                    or pname.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    zeros = lambda b: tuple(torch.zeros(b, *shape) for _, shape in mixer.state_shapes())  # noqa: E731
    return model, mixer, zeros


def _our_runs(mixer, zeros, u):
    ref_y, ref_states, _ = REFERENCE.mix(mixer, u, zeros(u.shape[0]))
    # chunked: a prefill chunk, then the rest in two uneven chunks
    s = zeros(u.shape[0])
    outs = []
    for lo, hi in ((0, PREFILL), (PREFILL, PREFILL + 5), (PREFILL + 5, u.shape[1])):
        y, s, _ = CHUNKED.mix(mixer, u[:, lo:hi], s)
        outs.append(y)
    return ref_y, ref_states, torch.cat(outs, dim=1), s


def _report(label: str, **diffs: float) -> None:
    print(f"CROSSCHECK {label}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    for k, v in diffs.items():
        assert v <= ATOL, f"{label}: {k} differs by {v:.3e} > {ATOL}"


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("changes", [{}, {"bias": True, "conv_bias": False, "dt_rank": 7, "d_conv": 3}])
def test_mamba1_layer_matches_selective_scan_ref_and_state_update_ref(refs, changes):
    from mamba_ssm.utils.generation import InferenceParams

    _, mixer, zeros = _our_layer("tiny-mamba1", **changes)
    cfg = mixer.cfg
    theirs = refs.mamba_simple.Mamba(cfg.d_model, d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand,
                                     dt_rank=cfg.resolved_dt_rank, bias=cfg.bias, conv_bias=cfg.conv_bias,
                                     use_fast_path=False, layer_idx=0)
    theirs.load_state_dict(mixer.state_dict(), strict=True)
    u = torch.randn(2, L, cfg.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = theirs(u)  # selective_scan_ref over the whole sequence
        ip = InferenceParams(max_seqlen=L, max_batch_size=2)
        pre = theirs(u[:, :PREFILL], inference_params=ip)  # selective_scan_ref with return_last_state
        ip.seqlen_offset = PREFILL
        steps = []
        for t in range(PREFILL, L):  # selective_state_update_ref
            steps.append(theirs(u[:, t : t + 1], inference_params=ip))
            ip.seqlen_offset += 1
        conv, ssm = ip.key_value_memory_dict[0]
        ref_y, ref_states, ch_y, ch_states = _our_runs(mixer, zeros, u)
    stepped = torch.cat([pre, *steps], dim=1)
    _report(f"mamba1 layer {changes} vs selective_scan_ref (full)", reference=_maxdiff(ref_y, full),
            chunked=_maxdiff(ch_y, full))
    _report(f"mamba1 layer {changes} vs prefill + selective_state_update_ref", outputs=_maxdiff(ref_y, stepped),
            conv=_maxdiff(ref_states[0], conv), ssm=_maxdiff(ref_states[1], ssm),
            chunked_conv=_maxdiff(ch_states[0], conv), chunked_ssm=_maxdiff(ch_states[1], ssm))


# (changes, whether mamba-ssm's own step path can run them)
MAMBA2_VARIANTS = [
    ({}, True),
    ({"d_ssm": 64, "norm_before_gate": True, "bias": True}, True),  # gated-MLP part
    ({"rmsnorm": False, "ngroups": 1, "conv_bias": False}, True),  # z gate instead of the gated norm
    ({"dt_min_clamp": 0.01, "dt_max_clamp": 0.05}, False),  # mamba-ssm's step ignores dt_limit
    ({"D_has_hdim": True}, False),  # mamba-ssm's step repeats D per head and fails on this shape
]


@pytest.mark.parametrize("changes,their_step", MAMBA2_VARIANTS)
def test_mamba2_layer_matches_ssd_minimal_and_state_update_ref(refs, changes, their_step):
    from mamba_ssm.utils.generation import InferenceParams

    _, mixer, zeros = _our_layer("tiny-mamba2", **changes)
    cfg = mixer.cfg
    limit = (cfg.dt_min_clamp, cfg.dt_max_clamp if cfg.dt_max_clamp is not None else float("inf"))
    theirs = refs.mamba2.Mamba2(cfg.d_model, d_state=cfg.d_state, d_conv=cfg.d_conv, expand=cfg.expand,
                                headdim=cfg.headdim, ngroups=cfg.ngroups, chunk_size=cfg.chunk_size,
                                d_ssm=cfg.d_ssm, D_has_hdim=cfg.D_has_hdim, rmsnorm=cfg.rmsnorm,
                                norm_before_gate=cfg.norm_before_gate, bias=cfg.bias, conv_bias=cfg.conv_bias,
                                dt_limit=limit, use_mem_eff_path=False, layer_idx=0)
    theirs.load_state_dict(mixer.state_dict(), strict=True)
    u = torch.randn(2, L, cfg.d_model, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = theirs(u)  # ssd_minimal_discrete (+ gated rms_norm_ref)
        ref_y, ref_states, ch_y, ch_states = _our_runs(mixer, zeros, u)
    _report(f"mamba2 layer {changes} vs ssd_minimal_discrete (full)", reference=_maxdiff(ref_y, full),
            chunked=_maxdiff(ch_y, full))
    if not their_step:
        return
    with torch.no_grad():
        ip = InferenceParams(max_seqlen=L, max_batch_size=2)
        pre = theirs(u[:, :PREFILL], inference_params=ip)
        ip.seqlen_offset = PREFILL
        steps = []
        for t in range(PREFILL, L):
            steps.append(theirs(u[:, t : t + 1], inference_params=ip))
            ip.seqlen_offset += 1
        conv, ssm = ip.key_value_memory_dict[0]
    stepped = torch.cat([pre, *steps], dim=1)
    _report(f"mamba2 layer {changes} vs prefill + selective_state_update_ref", outputs=_maxdiff(ref_y, stepped),
            conv=_maxdiff(ref_states[0], conv), ssm=_maxdiff(ref_states[1], ssm),
            chunked_conv=_maxdiff(ch_states[0], conv), chunked_ssm=_maxdiff(ch_states[1], ssm))


@pytest.mark.parametrize(
    "preset,changes",
    [
        ("tiny-mamba3", {}),
        ("tiny-mamba3", {"is_outproj_norm": True, "rope_fraction": 1.0, "A_floor": 0.05}),
        ("tiny-mamba3-mimo", {}),
        ("tiny-mamba3-mimo", {"is_outproj_norm": False, "mimo_rank": 3}),
    ],
)
def test_mamba3_layer_matches_fused_step_reference(refs, preset, changes):
    _, mixer, zeros = _our_layer(preset, **changes)
    cfg = mixer.cfg
    mimo = cfg.mimo_rank > 1
    theirs = refs.mamba3.Mamba3(cfg.d_model, d_state=cfg.d_state, expand=cfg.expand, headdim=cfg.headdim,
                                rope_fraction=cfg.rope_fraction, is_outproj_norm=cfg.is_outproj_norm,
                                A_floor=cfg.A_floor, is_mimo=mimo, mimo_rank=cfg.mimo_rank, layer_idx=0)
    theirs.load_state_dict(mixer.state_dict(), strict=True)
    u = torch.randn(2, L, cfg.d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        angle, ssm, k, v = theirs.allocate_inference_cache(2, L, dtype=torch.float32)
        outs = []
        for t in range(L):  # mamba-ssm's step: rotary reference + fused step reference
            y, *_ = theirs.step(u[:, t], angle, ssm, k, v)
            outs.append(y)
        theirs_y = torch.stack(outs, dim=1)
        ref_y, ref_states, ch_y, ch_states = _our_runs(mixer, zeros, u)
    # mamba-ssm's step path keeps the angle unwrapped; ours keeps it modulo 2 pi like its kernels
    wrapped = angle - 2 * math.pi * torch.floor(angle / (2 * math.pi))
    label = f"{preset} layer {changes} vs Mamba3.step (fused_ref_v2, rotary reference)"
    _report(label, reference=_maxdiff(ref_y, theirs_y), chunked=_maxdiff(ch_y, theirs_y),
            angle=_maxdiff(ref_states[0], wrapped), ssm=_maxdiff(ref_states[1], ssm),
            k=_maxdiff(ref_states[2], k), v=_maxdiff(ref_states[3], v),
            chunked_ssm=_maxdiff(ch_states[1], ssm), chunked_k=_maxdiff(ch_states[2], k))


@pytest.mark.parametrize(
    "preset,layer,changes",
    [("tiny-mamba1", "Mamba1", {}), ("tiny-mamba2", "Mamba2", {}), ("tiny-mamba2", "Mamba2", {"rms_norm": False})],
)
def test_language_model_matches_mamba_lm_head_model(refs, tmp_path, preset, layer, changes):
    """mamba-ssm's MambaLMHeadModel, saved with its own save_pretrained, loads through load_model."""
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    fields, seed = PRESETS[preset]
    ours = init_model(ModelConfig.create(**{**fields, **changes}), seed, backend="reference")
    with torch.no_grad():  # norms start as constants; make them count
        g = torch.Generator().manual_seed(8)
        for name, p in ours.module.named_parameters():
            if ".norm." in name or "norm_f" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    cfg = ours.config
    ssm_cfg = {"layer": layer, "d_state": cfg.d_state, "d_conv": cfg.d_conv, "expand": cfg.expand}
    if layer == "Mamba2":
        ssm_cfg.update(headdim=cfg.headdim, ngroups=cfg.ngroups, chunk_size=cfg.chunk_size, use_mem_eff_path=False)
    else:
        ssm_cfg.update(use_fast_path=False)
    mcfg = MambaConfig(d_model=cfg.d_model, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size, ssm_cfg=ssm_cfg,
                       rms_norm=cfg.rms_norm, residual_in_fp32=True, fused_add_norm=False, pad_vocab_size_multiple=8)
    theirs = MambaLMHeadModel(mcfg)
    missing, unexpected = theirs.load_state_dict(ours.module.state_dict(), strict=False)
    assert not missing and not unexpected
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        their_logits = theirs(ids).logits[0]
    theirs.save_pretrained(str(tmp_path))  # config.json + pytorch_model.bin
    loaded = load_model(tmp_path, backend="reference")
    # the revision is over the weights as they now are (perturbed above), tied head folded
    now = {k: v for k, v in ours.module.state_dict().items() if k != "lm_head.weight"}
    assert loaded.revision == weights_revision(now)
    assert loaded.schema.fingerprint() == ours.schema.fingerprint()
    toks = ids[0].tolist()
    s, rows = loaded.initial_state(), []
    for lo, hi in ((0, 1), (1, 8), (8, 21), (21, 40)):
        step = loaded.advance(s, toks[lo:hi])
        rows.append(step.logits)
        s = step.state
    chunked = loaded.with_backend("chunked").advance(loaded.initial_state(), toks).logits
    _report(f"{preset} {changes} LM vs MambaLMHeadModel logits",
            reference_chunked=_maxdiff(torch.cat(rows), their_logits),
            chunked_backend=_maxdiff(chunked, their_logits))
