"""Zamba2 from a Hugging Face directory: a Mamba-2 backbone whose "hybrid" layers first call a
weight-shared transformer block on concat(hidden, embeddings), with per-site LoRA adapters and KV.

The truth is transformers' own Zamba2, a tiny random one saved with `save_pretrained` and run in
float32 on its slow (pure PyTorch) path: hidden 64, 6 layers of which layers 1 and 4 are hybrid sites
calling the one shared block (num_mem_blocks 1), 4 attention heads of 32 over the block's 128-wide
input (RoPE), adapters of rank 8 on q, k, v and the MLP, the exact GELU, Mamba-2 with 8 heads of 16
and state 16. transformers initializes A_log, D, dt_bias and the norms to constants: they are
perturbed, and the adapters and q/k scaled up, so that a mixed-up head, a dropped adapter or the
scores would show. Ours must match within 1e-4 of each row's logit scale on every backend, give the
same bits (logits and every state tensor: conv, SSM and each site's own k, v) under any chunking and
batching on the exact backend, miss the bound by far more than 10x with the adapters or the
embedding half of the block's input dropped, hold the shared weights once, and refuse typed what it
does not compute.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mamba_stream.scan import PositionLimit, load_model
from mamba_stream.scan._errors import CheckpointError, ConfigError
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
    assert_step_rows_bits,
    edited,
    hf_logits,
    load_bfloat16_as_stored,
    perturb,
    rel,
    rel_of,
    save_bfloat16,
    saved_with_truth,
)
from tests.scan._mamba_ssm import require

pytestmark = pytest.mark.crosscheck

MAX_POSITIONS = 128
M, H = "linear_attention", "hybrid"
KINDS = [M, H, M, M, H, M]
SITES = [1, 4]
D_INNER, GN = 128, 16  # the Mamba-2's channels (8 heads of 16), its B (and C) columns (1 group of 16)


def _hf_zamba2(seed: int = 0, **overrides):
    """A seeded tiny Zamba2ForCausalLM of transformers' own making (`overrides`: config fields)."""
    require("transformers")
    from transformers import Zamba2Config, Zamba2ForCausalLM

    fields = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=len(KINDS), layers_block_type=KINDS, mamba_d_state=16,
        n_mamba_heads=8, mamba_ngroups=1, num_attention_heads=4, num_mem_blocks=1, use_shared_attention_adapter=True,
        adapter_rank=8, use_mem_rope=True, max_position_embeddings=MAX_POSITIONS, intermediate_size=96,
        chunk_size=32)
    fields.update(overrides)
    fields["num_hidden_layers"] = len(fields["layers_block_type"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Zamba2ForCausalLM(Zamba2Config(**fields)).eval()
        # random norms, dt_bias; long memories (A small) and a small D skip, so that the SSM's own
        # path moves the logits; the adapters (init N(0, 0.02) each: their product ~1% of a
        # projection) and q, k scaled up, so that a dropped adapter and the scores show
        perturb(model, ("dt_bias", "norm.weight", "layernorm.weight"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.log(torch.rand_like(p) * 0.5 + 0.05))
                elif name.endswith("mamba.D"):
                    p.copy_(0.1 * torch.randn_like(p))
                elif "adapter_list" in name or name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(4.0)
        return model


@pytest.fixture(scope="module")
def zamba(tmp_path_factory):
    """(transformers' model, its float32 directory, the token ids, transformers' logits (L, V))."""
    return saved_with_truth(_hf_zamba2(), tmp_path_factory.mktemp("zamba2-f32"))


def _tensors_edited(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint with `edit(name, tensor)` applied to every tensor (None: unchanged)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    sd = load_file(str(path))
    for name, t in list(sd.items()):
        new = edit(name, t.clone())
        if new is not None:
            sd[name] = new.contiguous()
    save_file(sd, str(path), metadata={"format": "pt"})
    return dst


def test_the_checkpoint_loads_as_shared_layers_holding_the_block_once(zamba):
    hf, d, _, _ = zamba
    saved = json.loads((d / "config.json").read_text())
    assert saved["layers_block_type"] == KINDS and saved["hidden_act"] == "gelu"
    model = load_model(d, backend="exact")
    cfg = model.config
    assert cfg.kinds == ("mamba2", "shared", "mamba2", "mamba2", "shared", "mamba2") and set(cfg.ffns) == {"none"}
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_positions) == (4, 4, 32, MAX_POSITIONS)
    assert cfg.attention_multiplier == 16**-0.5 and cfg.position_embedding == "rope" and cfg.rope_theta == 10000.0
    assert (cfg.shared_blocks, cfg.shared_adapter_rank, cfg.shared_attention_adapter) == (1, 8, True)
    assert (cfg.mlp_activation, cfg.mlp_intermediate_size, cfg.dt_min_clamp, cfg.dt_max_clamp) == (
        "gelu", 96, 1e-3, None)
    assert (cfg.nheads, cfg.headdim, cfg.norm_before_gate, cfg.tie_embeddings) == (8, 16, False, True)
    lm = model.module
    assert [site.mixer.block for site in lm.backbone.layers if site.kind == "shared"] == [0, 0]
    names = set(lm.state_dict())
    assert "backbone.shared.0.attn.q_proj.weight" in names and not any(".shared." in n for n in names
                                                                        if n.startswith("backbone.layers."))
    assert lm.backbone.shared[0].attn.q_proj.weight.shape == (128, 128)
    assert lm.backbone.layers[4].mixer.q_adapter.down.weight.shape == (8, 128)
    # the shared block's weights held once: as many parameters as transformers' (its ties deduplicated)
    ours = sum(p.numel() for p in lm.parameters())
    assert ours == sum(p.numel() for p in hf.parameters())
    # each site's own adapters: transformers' list entry of that site
    blk = hf.model.layers[1].shared_transformer
    for s, i in enumerate(SITES):
        theirs = blk.self_attn.linear_k_adapter_list[s][1].weight
        assert torch.equal(lm.backbone.layers[i].mixer.k_adapter.up.weight, theirs)
        assert torch.equal(lm.backbone.layers[i].mixer.mlp_adapter.down.weight,
                           blk.feed_forward.gate_up_proj_adapter_list[s][0].weight)
    roles = [(t.layer, t.role, t.shape) for t in model.schema.tensors]
    conv, ssm, kv = (D_INNER + 2 * GN, 4), (8, 16, 16), (MAX_POSITIONS, 4, 32)
    want = []
    for i in range(6):
        want += [(i, "conv", conv), (i, "ssm", ssm)] + ([(i, "k", kv), (i, "v", kv)] if i in SITES else [])
    assert roles == want
    layers = model.schema.layers
    assert layers is not None and layers.kinds == cfg.kinds and layers.mlp_activation == "gelu"
    assert (layers.shared_blocks, layers.shared_adapter_rank, layers.shared_attention_adapter) == (1, 8, True)
    assert_schema_round_trips(model)


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_zamba2(zamba, backend):
    _, d, toks, truth = zamba
    assert_matches(load_model(d, backend=backend), toks, truth, "zamba2")


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
def test_exact_chunking_and_batching_give_the_same_bits(zamba, backend):
    """[96], [1, 7, 30, 58] and 96 x 1: the same logits and every state tensor (each layer's conv and
    SSM, each site's own k and v) bit for bit; streams batched at positions 5 and 40 keep their own
    bits. The two sites call the same weights but hold different KV."""
    _, d, toks, truth = zamba
    model = load_model(d, backend=backend)
    state = assert_exact_chunking_and_batching(model, toks)
    assert state.position == N_TOKENS
    for role in ("k", "v"):
        a, b = state.tensors[f"layers.1.{role}"], state.tensors[f"layers.4.{role}"]
        assert a.shape == b.shape == (N_TOKENS, 4, 32) and bool(a.ne(0).any()) and not torch.equal(a, b)
    logits, _ = scan_chunks(model, model.initial_state(), toks, CHUNKINGS[-1])
    assert rel(logits, truth) <= BOUND
    assert model.advance(model.initial_state(), toks[:1]).path == model.exact_probe.path


def _no_adapters(name: str, t: torch.Tensor) -> torch.Tensor | None:
    return torch.zeros_like(t) if "adapter_list" in name else None


def _no_embeddings(name: str, t: torch.Tensor) -> torch.Tensor | None:
    """The block's input norm weight over the embedding half (features 64..127) zeroed: the block
    then reads the hidden half alone."""
    if name.endswith("shared_transformer.input_layernorm.weight"):
        t[64:] = 0.0
        return t
    return None


def _no_attention_adapters(name: str, t: torch.Tensor) -> torch.Tensor | None:
    return torch.zeros_like(t) if "self_attn.linear_" in name else None


@pytest.mark.parametrize("edit", [_no_adapters, _no_attention_adapters, _no_embeddings], ids=lambda f: f.__name__)
def test_a_dropped_feature_misses_the_bound(zamba, tmp_path, edit):
    """The negative controls: the checkpoint with every adapter zeroed, with only the attention
    adapters zeroed, or with the embedding half of the shared block's input dropped (its norm's
    weight zeroed there) fails the comparison by more than 10x."""
    _, d, toks, truth = zamba
    r = rel_of(_tensors_edited(d, tmp_path / "m", edit), toks, truth)
    print(f"CROSSCHECK HF zamba2 vs ours with {edit.__name__}: max rel {r:.2e}")
    assert r > 10 * BOUND


def test_the_tanh_gelu_is_another_function(zamba, monkeypatch):
    """GELU's tanh approximation in place of the exact (erf) one: the logits move measurably (the
    figure is printed), so the comparison sees which GELU the MLP computes."""
    from mamba_stream.scan import _layers

    _, d, toks, truth = zamba
    model = load_model(d, backend="exact")
    exact = model.advance(model.initial_state(), toks).logits

    def tanh_gelu(x: torch.Tensor, exp) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))

    monkeypatch.setattr(_layers, "gelu", tanh_gelu)
    approx = model.advance(model.initial_state(), toks).logits
    r, r_ours = rel(approx, truth), rel(approx, exact)
    print(f"CROSSCHECK HF zamba2 vs ours with the tanh GELU: max rel {r:.2e} (vs our exact GELU {r_ours:.2e}); "
          f"with the exact GELU {rel(exact, truth):.2e}")
    assert r_ours > 1e-6 and r > 10 * rel(exact, truth)


def test_two_blocks_called_in_rotation(tmp_path):
    """num_mem_blocks 2 over four sites: sites 0 and 2 call block 0, sites 1 and 3 block 1, each
    with its own adapters and KV; the same checkpoint read as one block (the second block's weights
    then a stray copy of the first's, which differs) is refused."""
    kinds = [M, H, H, M, H, M, H]
    hf, d, toks, truth = saved_with_truth(_hf_zamba2(seed=2, layers_block_type=kinds, num_mem_blocks=2),
                                          tmp_path / "two", seed=7)
    for backend in ("reference", "exact"):
        model = load_model(d, backend=backend)
        assert_matches(model, toks, truth, "zamba2 two blocks", chunkings=([N_TOKENS], [1, 7, 30, 58]))
    assert [blk.mixer.block for blk in model.module.backbone.layers if blk.kind == "shared"] == [0, 1, 0, 1]
    assert len(model.module.backbone.shared) == 2
    assert sum(p.numel() for p in model.module.parameters()) == sum(p.numel() for p in hf.parameters())
    assert_exact_chunking_and_batching(model, toks)
    with pytest.raises(CheckpointError):
        load_model(edited(d, tmp_path / "one", num_mem_blocks=1))


def test_the_plain_variant_matches(tmp_path):
    """Grouped-query attention (2 key/value heads) without attention adapters and without rope,
    biases on the Mamba-2 and MLP projections (add_bias_linear), an untied head. transformers 5.24
    ties the sites' blocks only with the embedding: untied, each site has its own block (its own
    weights, saved apart), and so it is read here: a block per site."""
    hf, d, toks, truth = saved_with_truth(
        _hf_zamba2(seed=1, use_shared_attention_adapter=False, num_key_value_heads=2, use_mem_rope=False,
                   add_bias_linear=True, tie_word_embeddings=False), tmp_path / "plain", seed=6)
    for backend in ("reference", "exact"):
        model = load_model(d, backend=backend)
        assert_matches(model, toks, truth, "zamba2 plain", chunkings=([1, 7, 30, 58],))
    cfg = model.config
    assert (cfg.n_kv_heads, cfg.position_embedding, cfg.shared_attention_adapter, cfg.bias, cfg.mlp_bias) == (
        2, "nope", False, True, True)
    assert model.module.backbone.layers[1].mixer.q_adapter is None and not cfg.tie_embeddings
    assert cfg.shared_blocks == 2
    assert [b.mixer.block for b in model.module.backbone.layers if b.kind == "shared"] == [0, 1]
    # transformers' untied blocks each also hold the other site's MLP adapter, which it never reads
    unused = 2 * (8 * 64 + 2 * 96 * 8)
    assert sum(p.numel() for p in model.module.parameters()) == sum(p.numel() for p in hf.parameters()) - unused
    assert_exact_chunking_and_batching(model, toks)


def test_max_positions_is_refused_typed(zamba):
    _, d, toks, _ = zamba
    model = load_model(d, backend="exact")
    state = model.advance(model.initial_state(), toks).state  # 96 of 128
    with pytest.raises(PositionLimit) as err:
        model.advance(state, toks[:33])
    assert (err.value.limit, err.value.actual) == (MAX_POSITIONS, 129)


@pytest.mark.parametrize("in_place", [False, True])
def test_the_slot_tables_step_gives_each_row_its_own_bits(zamba, in_place):
    """`step_rows` on buffers of three streams at positions 3, 17 and 40 (rows 0, 2, 1, then 0, 1,
    2): each row the bits of its own `advance` by that token, logits and every state tensor."""
    _, d, toks, _ = zamba
    assert_step_rows_bits(load_model(d, backend="exact"), toks, in_place)


@pytest.mark.parametrize(("changes", "field"), [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"use_long_context": True}, "use_long_context"),
    ({"use_shared_mlp_adapter": False}, "use_shared_mlp_adapter"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),  # the k/v adapters write 2 * hidden features
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor"),
    ({"layers_block_type": [M, "full_attention", M, M, H, M]}, "layers_block_type"),
    ({"layers_block_type": [M, H, M]}, "layers_block_type"),
    ({"n_mamba_heads": 5}, "n_mamba_heads"),
    ({"time_step_limit": [0.0, 0.1]}, "time_step_limit"),  # transformers clamps at (time_step_min, inf)
    ({"ffn_hidden_size": 80}, "ffn_hidden_size"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_what_is_not_computed_is_refused_typed_naming_the_field(zamba, tmp_path, changes, field):
    assert_refused(zamba[1], tmp_path / "bad", changes, field, "Zamba2")


@pytest.mark.parametrize(("fields", "field"), [
    ({"shared_blocks": 1}, "shared_blocks"),  # no layer is a shared one
    ({"layer_types": ("shared", "mamba2"), "shared_blocks": 3, "shared_adapter_rank": 8,
      "shared_attention_adapter": True}, "shared_blocks"),  # more blocks than sites
    ({"layer_types": ("shared", "mamba2"), "shared_blocks": 1, "shared_attention_adapter": True},
     "shared_adapter_rank"),
])
def test_the_config_refuses_inconsistent_shared_fields(fields, field):
    from mamba_stream.scan import ModelConfig

    attention = {"n_q_heads": 4, "n_kv_heads": 4, "attn_head_dim": 32, "attention_bias": False,
                 "position_embedding": "nope", "attention_multiplier": 0.25, "max_positions": 16,
                 "mlp_intermediate_size": 96, "mlp_activation": "gelu", "ffn_types": ("none", "none")}
    base = {"architecture": "mamba2", "d_model": 64, "n_layer": 2, "vocab_size": 256, "headdim": 16, "d_state": 16}
    extra = attention if "layer_types" in fields else {}
    with pytest.raises(ConfigError) as err:
        ModelConfig.create(**{**base, **extra, **fields})
    assert err.value.field == field


def test_bfloat16_and_q8_matrices_compute_their_own_function(zamba, tmp_path):
    """transformers' bfloat16 save is read as stored (the shared block's matrices and the adapters
    included), with the bits of its float32 widening, and matches transformers' float32 run of those
    rounded weights; q8 holds every matrix as block-int8, still chunks exactly, and stays within 0.1
    of transformers' logits."""
    from transformers import Zamba2ForCausalLM

    hf, d, toks, truth = zamba
    bf = tmp_path / "bf16"
    save_bfloat16(_hf_zamba2, hf, bf)
    kept, a = load_bfloat16_as_stored(bf, toks)
    lm = kept.module
    assert lm.backbone.shared[0].attn.q_proj.weight.dtype == torch.bfloat16
    assert lm.backbone.layers[1].mixer.mlp_adapter.up.weight.dtype == torch.bfloat16
    # transformers' own float32 model of the rounded weights (its rope buffer derived afresh)
    rounded = Zamba2ForCausalLM.from_pretrained(str(bf), dtype=torch.float32).eval()
    ref = hf_logits(rounded, toks)
    r = rel(a.logits, ref)
    print(f"CROSSCHECK HF zamba2 vs ours (exact, bfloat16 matrices): max rel {r:.2e}")
    assert r <= BOUND
    # q8 rounds the activations as well as the weights, each to 8 bits of its block's max: about
    # 3x what rounding the weights to bfloat16 does to transformers' own logits (0.014 here; this
    # tiny model's scaled-up q, k and adapters make it sensitive); over seeds 0-4 the max row is
    # 0.021-0.063 (bfloat16: 0.006-0.020), so the bound is 0.1
    assert_q8_chunks_exactly(d, toks, truth, "zamba2", 0.1, rounding=rel(ref, truth))


def test_the_hubs_config_spelling_loads_to_the_same_model(zamba, tmp_path):
    """The hub's Zamba2 config.json (transformers 4.x): the legacy layer name "mamba", rope_theta at
    the top, use_shared_mlp_adapter, ffn_hidden_size, time_step_limit null: the same config, schema
    and logits as transformers 5.24's save."""
    _, d, toks, _ = zamba
    hub = tmp_path / "hub"
    shutil.copytree(d, hub)
    cfg = json.loads((hub / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(layers_block_type=["mamba" if k == M else k for k in KINDS], rope_theta=theta,
               use_shared_mlp_adapter=True, ffn_hidden_size=96, time_step_limit=None)
    (hub / "config.json").write_text(json.dumps(cfg))
    new, old = load_model(d, backend="exact"), load_model(hub, backend="exact")
    assert old.config == new.config and old.schema.fingerprint() == new.schema.fingerprint()
    assert torch.equal(old.advance(old.initial_state(), toks).logits, new.advance(new.initial_state(), toks).logits)
