"""NemotronH from a Hugging Face directory: layers of one block each (norm -> mixer -> residual add),
the mixer a Mamba-2 ("M"), attention ("*") or a not-gated relu2 MLP ("-").

The truth is transformers' own NemotronH, a tiny random one saved with `save_pretrained` and run in
float32 on its pure-PyTorch path: pattern "M-M*-M" (Mamba, MLP, Mamba, attention, MLP, Mamba),
attention with 4 query heads sharing 2 key/value heads of 16 (NoPE, scale 16**-0.5), Mamba-2 with 8
heads of 16, state 16, 2 groups (so the gated norm runs over two groups of 64). Its Mamba weights are
edited so that the scan's features show in the logits: B and C scaled up, and every other head given
a dt under `time_step_min` (0.1, the clamp transformers applies) and a slow decay.

Ours must match within 1e-4 of each row's logit scale on every backend, give the same bits (logits
and every state tensor) under any chunking and batching on the exact backends, hold no state for the
MLP layers, and refuse typed what it does not compute (unknown layer kinds, a dt limit transformers
ignores, unknown fields). Negative controls: the gated norm over the whole width (n_groups 1 in
effect), the dt clamp dropped, the MLP's activation read as silu: each misses the bound by more
than 10x. Its MoE layers ("E"): `test_nemotron_h_moe.py`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mamba_stream.scan import load_model
from mamba_stream.scan._mamba2 import Mamba2Mixer
from tests.scan._helpers import scan_chunks
from tests.scan._hybrid import (
    BOUND,
    CHUNKINGS,
    N_TOKENS,
    assert_exact_chunking_and_batching,
    assert_matches,
    assert_q8_chunks_exactly,
    assert_refused,
    assert_schema_round_trips,
    edited,
    hf_logits,
    load_bfloat16_as_stored,
    perturb,
    rel,
    rel_of,
    save_bfloat16,
    saved_with_truth,
    seal_and_unseal,
    state_equal,
)
from tests.scan._mamba_ssm import require

pytestmark = pytest.mark.crosscheck

PATTERN = "M-M*-M"
KINDS_NEW = ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp", "linear_attention"]
MAX_POSITIONS = 128
#: the dt clamp (transformers' `time_step_min`): every other head's dt is set under it (`_hf_nemotron_h`)
DT_MIN = 0.1


def _hf_nemotron_h():
    """A seeded tiny NemotronH of transformers' own making (see the module docstring)."""
    require("transformers")
    from transformers import NemotronHConfig, NemotronHForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = NemotronHConfig(
            vocab_size=256, hidden_size=64, hybrid_override_pattern=PATTERN, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16,
            ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=32, max_position_embeddings=MAX_POSITIONS,
            time_step_min=DT_MIN, time_step_max=0.2, layer_norm_epsilon=1e-5)
        model = NemotronHForCausalLM(cfg).eval()
        # transformers initializes A_log, D and the norms to constants (dt_bias to a narrow range):
        # random values, so that a mixed-up head, a skipped D or a norm's weight shows
        perturb(model, ("A_log", "D", "dt_bias", "norm.weight", "norm_f.weight"))
        # B and C scaled up, so that the scan's own term C h is not lost beside D x (at the init's
        # scale, dropping the dt clamp moved the logits by ~1e-6 of their scale: it would not show)
        with torch.no_grad():
            for layer in model.model.layers:
                if layer.block_type == "linear_attention":
                    inner, gn = cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.n_groups * cfg.ssm_state_size
                    layer.mixer.in_proj.weight[2 * inner : 2 * inner + 2 * gn] *= 10
                    # every other head's dt well under time_step_min, so the clamp binds there (and
                    # a group's heads are not all scaled alike, which its norm would hide)
                    layer.mixer.dt_bias[::2] = -3.5 + 0.3 * torch.randn(cfg.mamba_num_heads // 2)
                    # and slow decay there (A near -0.3): with a fast one the state settles to
                    # x B / |A| whatever dt is, and the clamp would not show
                    layer.mixer.A_log[::2] = math.log(0.3) + 0.3 * torch.randn(cfg.mamba_num_heads // 2)
        return model


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    """(transformers' model, its float32 directory, the token ids, transformers' logits (L, V))."""
    # config.json (layers_block_type) + model.safetensors (backbone.*)
    return saved_with_truth(_hf_nemotron_h(), tmp_path_factory.mktemp("nemotron-h-f32"))


def test_the_checkpoint_loads_as_typed_layers_without_state_for_the_mlp_layers(nemotron):
    _, d, toks, _ = nemotron
    saved = json.loads((d / "config.json").read_text())
    assert saved["layers_block_type"] == KINDS_NEW and "hybrid_override_pattern" not in saved
    model = load_model(d, backend="exact")
    cfg = model.config
    assert cfg.kinds == ("mamba2", "mlp", "mamba2", "attention", "mlp", "mamba2") and cfg.is_hybrid
    assert cfg.ffns == ("none",) * 6 and not cfg.tie_embeddings
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_positions) == (4, 2, 16, MAX_POSITIONS)
    assert (cfg.position_embedding, cfg.attention_multiplier) == ("nope", 0.25)
    assert (cfg.mlp_gated, cfg.mlp_activation, cfg.mlp_bias, cfg.mlp_intermediate_size) == (False, "relu2", False, 128)
    assert (cfg.ngroups, cfg.headdim, cfg.nheads, cfg.d_inner, cfg.dt_min_clamp, cfg.dt_max_clamp) == (
        2, 16, 8, 128, DT_MIN, None)
    assert [blk.kind for blk in model.module.backbone.layers] == list(cfg.kinds)
    assert all(blk.mlp is None and blk.moe is None for blk in model.module.backbone.layers)
    roles = [(t.layer, t.role, t.shape) for t in model.schema.tensors]
    kv = (MAX_POSITIONS, 2, 16)
    conv, ssm = (128 + 2 * 2 * 16, 4), (8, 16, 16)
    assert roles == [(0, "conv", conv), (0, "ssm", ssm), (2, "conv", conv), (2, "ssm", ssm),
                     (3, "k", kv), (3, "v", kv), (5, "conv", conv), (5, "ssm", ssm)]
    layers = model.schema.layers
    assert layers is not None and layers.kinds == cfg.kinds and layers.ffns is None
    assert layers.mlp_gated is False and layers.mlp_activation == "relu2"
    assert_schema_round_trips(model)
    # the state codec: seal and unseal a state of it bit for bit; it continues as the original
    state = model.advance(model.initial_state(), toks[:29]).state
    restored, segments = seal_and_unseal(model, state)  # 29 positions: one 16-row KV segment and a tail
    assert segments == 1
    assert state_equal(restored, state) and restored.position == 29
    a, b = model.advance(state, toks[29:40]), model.advance(restored, toks[29:40])
    assert torch.equal(a.logits, b.logits) and state_equal(a.state, b.state)


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_nemotron_h(nemotron, backend):
    _, d, toks, truth = nemotron
    assert_matches(load_model(d, backend=backend), toks, truth, "nemotron_h")


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
def test_exact_chunking_and_batching_give_the_same_bits(nemotron, backend):
    """[96], [1, 7, 30, 58] and 96 x 1: the same logits and every state tensor (conv, SSM, k, v);
    two streams at different positions advanced together keep their own bits."""
    _, d, toks, truth = nemotron
    model = load_model(d, backend=backend)
    state = assert_exact_chunking_and_batching(model, toks)
    assert state.position == N_TOKENS and sorted(state.tensors) == sorted(t.name for t in model.schema.tensors)
    one_by_one, _ = scan_chunks(model, model.initial_state(), toks, CHUNKINGS[-1])
    assert rel(one_by_one, truth) <= BOUND


def test_the_hub_spelling_loads_to_the_same_model(nemotron, tmp_path):
    """The hub's configs: `hybrid_override_pattern` with `num_hidden_layers`, the `mamba_*` names of
    the Mamba fields, `tie_word_embeddings` true (transformers ties nothing in NemotronH: the head
    stays its own tensor); tensors under `model.` (transformers' names in memory) load the same
    too, and multi-token-prediction tensors (`mtp.*`) are dropped as transformers drops them."""
    _, d, toks, _ = nemotron
    cfg = json.loads((d / "config.json").read_text())
    hub = edited(d, tmp_path / "hub", layers_block_type=None, hybrid_override_pattern=PATTERN, num_hidden_layers=6,
                 n_groups=None, mamba_n_groups=2, conv_kernel=None, mamba_d_conv=4, time_step_min=None,
                 mamba_dt_min=cfg["time_step_min"], use_conv_bias=None, mamba_conv_bias=True,
                 tie_word_embeddings=True, num_nextn_predict_layers=1)
    a, b = load_model(d, backend="exact"), load_model(hub, backend="exact")
    assert a.config == b.config and a.schema.fingerprint() == b.schema.fingerprint()
    assert torch.equal(a.advance(a.initial_state(), toks).logits, b.advance(b.initial_state(), toks).logits)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    renamed = {k.replace("backbone.", "model.", 1): v for k, v in sd.items()}
    save_file({**renamed, "mtp.layers.0.norm.weight": torch.ones(64)}, str(hub / "model.safetensors"))
    c = load_model(hub, backend="exact")
    assert torch.equal(a.advance(a.initial_state(), toks).logits, c.advance(c.initial_state(), toks).logits)


def test_the_gated_norm_over_the_whole_width_misses_the_bound(nemotron, monkeypatch):
    """The negative control for n_groups: the gated RMS norm over all 128 channels rather than two
    groups of 64 (what n_groups 1 would compute; n_groups itself cannot be edited, it sizes the
    conv) misses the bound; the same run with the groups restored matches."""
    _, d, toks, truth = nemotron

    class WholeWidth:
        def __init__(self, ops):
            self._ops = ops

        def __getattr__(self, name):
            return getattr(self._ops, name)

        def gated_norm(self, y, z, weight, eps, group_size, norm_before_gate):
            return self._ops.gated_norm(y, z, weight, eps, y.shape[-1], norm_before_gate)

    finish = Mamba2Mixer._finish
    monkeypatch.setattr(Mamba2Mixer, "_finish", lambda self, y, z, z0, x0, ops: finish(self, y, z, z0, x0,
                                                                                        WholeWidth(ops)))
    r = rel_of(d, toks, truth, backend="reference")
    print(f"CROSSCHECK HF nemotron_h vs ours with the gated norm over the whole width: max rel {r:.2e}")
    assert r > 10 * BOUND
    monkeypatch.setattr(Mamba2Mixer, "_finish", finish)
    assert rel_of(d, toks, truth, backend="reference") <= BOUND


@pytest.mark.parametrize(("changes", "what"), [
    ({"time_step_min": 0.001}, "the dt clamp at time_step_min"),
    ({"mlp_hidden_act": "silu"}, "relu2 in the MLP layers"),
])
def test_a_feature_read_otherwise_misses_the_bound(nemotron, tmp_path, changes, what):
    """The negative controls: the checkpoint edited to drop one of NemotronH's own features (a
    shape-compatible edit) loads, and misses the bound."""
    _, d, toks, truth = nemotron
    r = rel_of(edited(d, tmp_path / "m", **changes), toks, truth)
    print(f"CROSSCHECK HF nemotron_h vs ours without {what}: max rel {r:.2e}")
    assert r > 10 * BOUND


@pytest.mark.parametrize(("changes", "field"), [
    ({"layers_block_type": None, "hybrid_override_pattern": "M-X*-M"}, "hybrid_override_pattern"),
    ({"layers_block_type": ["linear_attention", "mlp", "linear_attention", "sliding_attention", "mlp",
                            "linear_attention"]}, "layers_block_type"),
    ({"num_hidden_layers": 7}, "num_hidden_layers"),
    ({"time_step_limit": [0.0, 0.5]}, "time_step_limit"),
    ({"attention_bias": True}, "attention_bias"),
    ({"sliding_window": 64}, "sliding_window"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"mamba_hidden_act": "relu"}, "mamba_hidden_act"),
    ({"n_groups": 3}, "n_groups"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_what_is_not_computed_is_refused_typed_naming_the_field(nemotron, tmp_path, changes, field):
    assert_refused(nemotron[1], tmp_path / "bad", changes, field, "NemotronH")


def test_bfloat16_and_q8_matrices_compute_their_own_function(nemotron, tmp_path):
    """transformers' bfloat16 save is read as stored (every matrix: Mamba, attention, MLP), with the
    bits of its float32 widening; q8 holds every matrix as block-int8 and still chunks exactly."""
    hf, d, toks, truth = nemotron
    bf = tmp_path / "bf16"
    rounded = save_bfloat16(_hf_nemotron_h, hf, bf)
    kept, a = load_bfloat16_as_stored(bf, toks)
    layers = kept.module.backbone.layers
    assert layers[1].mixer.input_linear.weight.dtype == torch.bfloat16
    assert layers[3].mixer.q_proj.weight.dtype == torch.bfloat16
    r = rel(a.logits, hf_logits(rounded.float(), toks))
    print(f"CROSSCHECK HF nemotron_h bf16 vs ours (exact, bf16 matrices kept): max rel {r:.2e}")
    assert r <= BOUND
    assert_q8_chunks_exactly(d, toks, truth, "nemotron_h", 0.05)
