"""GraniteMoeHybrid (dense, NoPE) from a Hugging Face directory: a model as a list of typed layers.

The truth is transformers' own GraniteMoeHybrid, a tiny random one saved with `save_pretrained` and
run in float32 on its slow (pure PyTorch) path: Mamba-2 and attention layers (4 query heads sharing
2 key/value heads of 16), each followed by the shared MLP, with multipliers that are not 1 (a missed
one misses the bound). Ours must match it within 1e-4 of each row's logit scale, give the same bits
(logits and every state tensor: conv, SSM, k, v) under any chunking and batching on the exact
backend, and refuse typed what it does not compute: MoE, unknown layer kinds, positions past
`max_positions`, the slot table, a mamba-ssm checkpoint of a hybrid.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
from collections.abc import Iterator

import pytest
import torch

from mamba_stream.scan import PositionLimit, load_model, save_checkpoint
from mamba_stream.scan._errors import CheckpointError, ConfigError, UnsupportedBackend
from tests.scan._helpers import scan_chunks
from tests.scan._mamba_ssm import require

pytestmark = pytest.mark.crosscheck

N_TOKENS = 96
CHUNKINGS = [[N_TOKENS], [1, 7, 30, 58], [1] * N_TOKENS]
BOUND = 1e-4  # row-wise max |diff| / max |logit| against transformers, float32
KINDS_NEW = ["linear_attention", "full_attention", "linear_attention", "full_attention"]  # transformers >= 5.13
KINDS_HUB = ["mamba", "attention", "mamba", "attention"]  # the hub's Granite-4.0-H checkpoints
MULTIPLIERS = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25,
               "logits_scaling": 4.0}
MAX_POSITIONS = 128


#: transformers' GraniteMoeHybrid functions that dispatch to mamba-ssm or causal-conv1d where they
#: import: chosen once, when its modeling module is first imported, so a test run that imported
#: mamba-ssm earlier (tests/scan/_mamba_ssm.py stubs its CUDA modules) would send the truth to
#: mamba-ssm's Triton kernels, which need CUDA
_DISPATCHED = ("mamba2_chunk_scan", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined",
               "causal_conv1d_fn", "causal_conv1d_update")


@contextlib.contextmanager
def _torch_path() -> Iterator[None]:
    """transformers' GraniteMoeHybrid on its pure-PyTorch path whatever else is installed: each
    dispatching function replaced by the torch function it wraps, called as its wrapper calls it
    (keyword arguments it does not take dropped)."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as mod

    def plain(fn):
        torch_fn = inspect.unwrap(fn)
        params = set(inspect.signature(torch_fn).parameters)
        return lambda *a, **k: torch_fn(*a, **{n: v for n, v in k.items() if n in params})

    with pytest.MonkeyPatch.context() as mp:
        for name in _DISPATCHED:
            if hasattr(mod, name):
                mp.setattr(mod, name, plain(getattr(mod, name)))
        yield


def _hf_granite():
    """A seeded tiny dense GraniteMoeHybrid of transformers' own making: hidden 64, layers mamba,
    attention, mamba, attention; NoPE; Mamba-2 with 8 heads of 16, state 16."""
    require("transformers")
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = GraniteMoeHybridConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            layer_types=KINDS_HUB, num_local_experts=0, shared_intermediate_size=128, intermediate_size=128,
            position_embedding_type="nope", mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32, max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=True, **MULTIPLIERS)
        model = GraniteMoeHybridForCausalLM(cfg).eval()
        # transformers initializes A_log, D and dt_bias to constants and the norms to ones: random
        # values, so that a mixed-up head, a skipped D or a norm's weight shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("A_log", "D", "dt_bias", "norm.weight", "layernorm.weight")):
                    p.copy_(p + 0.3 * torch.randn_like(p))
        return model


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """(transformers' model, its float32 directory, the token ids, transformers' logits (L, V))."""
    hf = _hf_granite()
    d = tmp_path_factory.mktemp("granite-f32")
    hf.save_pretrained(str(d))  # config.json (layer_types in the new spelling) + model.safetensors
    ids = torch.randint(0, 256, (1, N_TOKENS), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), _torch_path():
        truth = hf(ids).logits[0].float()
    return hf, d, ids[0].tolist(), truth


def _rel(got: torch.Tensor, truth: torch.Tensor) -> float:
    """max over rows of max |got - truth| / max |truth|: (L, V) logits against the truth."""
    return float(((got - truth).abs().amax(-1) / truth.abs().amax(-1)).max())


def _edited(src, dst, **changes):
    """A copy of the checkpoint with config.json fields changed (a value None: the field dropped)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _state_equal(a, b) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_the_checkpoint_loads_as_typed_layers(granite):
    _, d, _, _ = granite
    assert json.loads((d / "config.json").read_text())["layer_types"] == KINDS_NEW  # as transformers saves it
    model = load_model(d, backend="exact")
    cfg = model.config
    assert cfg.kinds == ("mamba2", "attention", "mamba2", "attention") and cfg.is_hybrid
    assert (cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim, cfg.max_positions) == (4, 2, 16, MAX_POSITIONS)
    assert [blk.kind for blk in model.module.backbone.layers] == list(cfg.kinds)
    roles = [(t.layer, t.role, t.shape) for t in model.schema.tensors]
    kv = (MAX_POSITIONS, 2, 16)
    assert roles == [(0, "conv", (160, 4)), (0, "ssm", (8, 16, 16)), (1, "k", kv), (1, "v", kv),
                     (2, "conv", (160, 4)), (2, "ssm", (8, 16, 16)), (3, "k", kv), (3, "v", kv)]
    assert model.schema.state_bytes == 4 * (2 * (160 * 4 + 8 * 16 * 16) + 4 * MAX_POSITIONS * 2 * 16)
    layers = model.schema.layers
    assert layers is not None and layers.kinds == cfg.kinds and layers.max_positions == MAX_POSITIONS
    assert layers.residual_multiplier == 0.5 and layers.position_embedding == "nope"
    assert '"layers":' in model.schema.canonical_json()
    back = type(model.schema).model_validate_json(model.schema.model_dump_json())
    assert back == model.schema and back.fingerprint() == model.schema.fingerprint()


def test_a_plain_mamba_models_schema_and_config_have_no_hybrid_fields():
    model = load_model("tiny-mamba2")
    assert model.schema.layers is None and '"layers"' not in model.schema.canonical_json()
    assert not model.config.is_hybrid and "layer_types" not in model.config.model_dump()
    assert [blk.kind for blk in model.module.backbone.layers] == ["mamba2"] * model.config.n_layer
    assert all(blk.mlp is None for blk in model.module.backbone.layers)


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_logits_match_transformers_granite_hybrid(granite, backend):
    _, d, toks, truth = granite
    model = load_model(d, backend=backend)
    for chunks in ([N_TOKENS], [1, 7, 30, 58]):
        logits, _ = scan_chunks(model, model.initial_state(), toks, chunks)
        rel = _rel(logits, truth)
        print(f"CROSSCHECK HF granitemoehybrid vs ours ({backend}, chunks {chunks}): max rel {rel:.2e}")
        assert rel <= BOUND, (backend, chunks, rel)


@pytest.mark.parametrize("dropped", sorted(MULTIPLIERS))
def test_a_dropped_multiplier_misses_the_bound(granite, tmp_path, dropped):
    """The negative controls: each multiplier left at transformers' default 1.0 fails the comparison."""
    _, d, toks, truth = granite
    model = load_model(_edited(d, tmp_path / "m", **{dropped: None}), backend="exact")
    rel = _rel(model.advance(model.initial_state(), toks).logits, truth)
    print(f"CROSSCHECK HF granitemoehybrid vs ours without {dropped}: max rel {rel:.2e}")
    assert rel > 10 * BOUND  # attention_multiplier, the least: ~1e-2 (random weights give small scores)


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
def test_exact_chunking_gives_the_same_bits(granite, backend):
    """[96], [1, 7, 30, 58] and 96 x 1: the same logits and every state tensor (conv, SSM, k, v)
    bit for bit; the KV rows past the position stay zero."""
    _, d, toks, truth = granite
    model = load_model(d, backend=backend)
    runs = [scan_chunks(model, model.initial_state(), toks, chunks) for chunks in CHUNKINGS]
    for (logits, state), chunks in zip(runs[1:], CHUNKINGS[1:], strict=True):
        assert torch.equal(logits, runs[0][0]), chunks[:4]
        assert _state_equal(state, runs[0][1]), chunks[:4]
    state = runs[0][1]
    assert state.position == N_TOKENS
    for name in ("layers.1.k", "layers.1.v", "layers.3.k", "layers.3.v"):
        assert bool(state.tensors[name][N_TOKENS:].eq(0).all()) and bool(state.tensors[name][:N_TOKENS].ne(0).any())
    assert _rel(runs[-1][0], truth) <= BOUND
    assert model.advance(model.initial_state(), toks[:1]).path == model.exact_probe.path


def test_streams_at_different_positions_advanced_together_keep_their_own_bits(granite):
    """advance_batch of two streams at positions 5 and 40 (one forward, one chunk length): each the
    bits of its own advance."""
    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    a = model.advance(model.initial_state(), toks[:5]).state
    b = model.advance(model.initial_state(), toks[:40]).state
    ra, rb = model.advance_batch([a, b], [toks[50:60], toks[60:70]])
    sa, sb = model.advance(a, toks[50:60]), model.advance(b, toks[60:70])
    assert torch.equal(ra.logits, sa.logits) and _state_equal(ra.state, sa.state)
    assert torch.equal(rb.logits, sb.logits) and _state_equal(rb.state, sb.state)
    assert (ra.state.position, rb.state.position) == (15, 50)


def test_max_positions_is_refused_typed_and_nothing_advances(granite):
    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    state = model.advance(model.initial_state(), toks).state  # 96 of 128
    before = {k: v.clone() for k, v in state.tensors.items()}
    with pytest.raises(PositionLimit) as err:
        model.advance(state, toks[:33])
    assert (err.value.field, err.value.limit, err.value.actual) == ("max_positions", MAX_POSITIONS, 129)
    with pytest.raises(PositionLimit):  # one bad stream fails the batch, the other does not advance either
        model.advance_batch([model.initial_state(), state], [toks[:2], toks[:40]])
    assert state.position == N_TOKENS and all(torch.equal(before[k], state.tensors[k]) for k in before)
    full = model.advance(state, toks[:32])  # exactly up to the bound: taken
    assert full.state.position == MAX_POSITIONS


def test_both_layer_type_spellings_load_to_the_same_logits(granite, tmp_path):
    _, d, toks, _ = granite
    new = load_model(d, backend="exact")
    hub = load_model(_edited(d, tmp_path / "hub", layer_types=KINDS_HUB), backend="exact")
    assert hub.config == new.config and hub.schema.fingerprint() == new.schema.fingerprint()
    assert torch.equal(hub.advance(hub.initial_state(), toks).logits, new.advance(new.initial_state(), toks).logits)


@pytest.mark.parametrize(("changes", "field"), [
    ({"layer_types": ["mamba", "attention", "mamba", "sliding_attention"]}, "layer_types"),
    ({"num_local_experts": 4}, "num_local_experts"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"mamba_n_heads": 5}, "mamba_n_heads"),
    ({"some_new_field": 1}, "some_new_field"),
])
def test_what_is_not_computed_is_refused_typed_naming_the_field(granite, tmp_path, changes, field):
    _, d, _, _ = granite
    with pytest.raises(ConfigError) as err:
        load_model(_edited(d, tmp_path / "bad", **changes))
    assert err.value.field == field and "GraniteMoeHybrid" in str(err.value)


def test_the_slot_tables_step_and_mamba_ssm_checkpoints_refuse_a_hybrid(granite, tmp_path):
    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    state = model.advance(model.initial_state(), toks[:3]).state
    buffers = {k: v.unsqueeze(0).clone() for k, v in state.tensors.items()}
    with pytest.raises(UnsupportedBackend, match="slot table"):
        model.step_rows(buffers, torch.tensor([0]), torch.tensor([7]))
    with pytest.raises(CheckpointError, match="hybrid"):
        save_checkpoint(model, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


def test_bfloat16_and_q8_matrices_compute_their_own_function(granite, tmp_path):
    """transformers' bfloat16 save is read as stored (the attention and MLP matrices included), with
    the bits of its float32 widening; q8 holds every matrix as block-int8 and still chunks exactly."""
    hf, d, toks, truth = granite
    bf = tmp_path / "bf16"
    rounded = _hf_granite()
    rounded.load_state_dict(hf.state_dict())
    rounded.to(torch.bfloat16).save_pretrained(str(bf))
    kept = load_model(bf, backend="exact")
    wide = load_model(bf, backend="exact", weights="float32")
    assert kept.weight_format == "bfloat16"
    assert kept.module.backbone.layers[1].mixer.q_proj.weight.dtype == torch.bfloat16
    a, b = kept.advance(kept.initial_state(), toks), wide.advance(wide.initial_state(), toks)
    assert torch.equal(a.logits, b.logits) and _state_equal(a.state, b.state)
    with torch.no_grad(), _torch_path():
        ref = rounded.float()(torch.tensor([toks])).logits[0]
    assert _rel(a.logits, ref) <= BOUND
    q8 = load_model(d, backend="exact", weights="q8")
    assert q8.weight_format == "q8" and q8.schema.weights == "q8"
    runs = [scan_chunks(q8, q8.initial_state(), toks, chunks) for chunks in CHUNKINGS[:2]]
    assert torch.equal(runs[0][0], runs[1][0]) and _state_equal(runs[0][1], runs[1][1])
    rel = _rel(runs[0][0], truth)
    print(f"CROSSCHECK HF granitemoehybrid vs ours (exact, q8 matrices): max rel {rel:.2e}")
    assert rel < 0.05


def test_the_one_call_decode_step_runs_the_mamba2_layers_only(granite, monkeypatch):
    """A Granite Mamba-2 layer is a plain Mamba-2 mixer (the same function: gated RMS norm over
    d_ssm / ngroups, no dt clamp), so the exact backend's one-call step (`mamba2_step_f32`) takes
    its decode tokens, two calls a token here; the attention layers and the MLP sublayers run on
    the primitives around it. The bits are the chunk's (test_exact_chunking_gives_the_same_bits)."""
    from mamba_stream.scan.exact._kernels import _kernel_ops

    _, d, toks, _ = granite
    model = load_model(d, backend="exact")
    ops = _kernel_ops()
    if ops is None or not model.exact_probe.kernels:
        pytest.skip("the exact kernels do not run here: the twins take every token")
    calls: list[int] = []
    real = ops.lib.mamba2_step_f32
    monkeypatch.setattr(ops.lib, "mamba2_step_f32", lambda *a: (calls.append(1), real(*a))[1])
    one = model.advance(model.initial_state(), toks[:1])
    assert len(calls) == 2 and one.path == "exact"
    chunk = model.advance(model.initial_state(), toks[:2])
    two = model.advance(one.state, toks[1:2])
    assert torch.equal(two.logits[0], chunk.logits[1]) and _state_equal(two.state, chunk.state)


def test_a_rope_checkpoint_matches_and_read_as_nope_misses(tmp_path):
    """position_embedding_type "rope" (rope_parameters default, theta 10000): the exact RoPE on q and
    k at each token's own position. q and k scaled up so that positions move the scores; the same
    checkpoint read as NoPE misses the bound."""
    require("transformers")
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        cfg = GraniteMoeHybridConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["attention", "mamba"], num_local_experts=0, shared_intermediate_size=64,
            position_embedding_type="rope", mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
            max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, **MULTIPLIERS)
        hf = GraniteMoeHybridForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(20)
    hf.save_pretrained(str(tmp_path / "rope"))
    toks = torch.randint(0, 256, (N_TOKENS,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad(), _torch_path():
        truth = hf(torch.tensor([toks])).logits[0]
    for backend in ("reference", "exact"):
        model = load_model(tmp_path / "rope", backend=backend)
        assert (model.config.position_embedding, model.config.rope_theta) == ("rope", 10000.0)
        logits, _ = scan_chunks(model, model.initial_state(), toks, [1, 7, 30, 58])
        rel = _rel(logits, truth)
        print(f"CROSSCHECK HF granitemoehybrid rope vs ours ({backend}): max rel {rel:.2e}")
        assert rel <= BOUND
    nope = load_model(_edited(tmp_path / "rope", tmp_path / "nope", position_embedding_type="nope"), backend="exact")
    assert _rel(nope.advance(nope.initial_state(), toks).logits, truth) > 100 * BOUND


def test_the_hybrid_config_fields_are_validated_naming_the_field(granite):
    from mamba_stream.scan import ModelConfig, init_model

    _, d, _, _ = granite
    cfg = load_model(d, backend="exact").config
    fields = {k: v for k, v in cfg.model_dump().items()}
    for change, field in [({"layer_types": ("mamba2", "attention")}, "layer_types"),
                          ({"layer_types": ("mamba2", "mamba1", "mamba2", "attention")}, "layer_types"),
                          ({"max_positions": None}, "max_positions"),
                          ({"n_kv_heads": 3}, "n_q_heads"),
                          ({"rope_theta": 10000.0}, "rope_theta"),
                          ({"mlp_activation": None}, "mlp_activation"),
                          ({"logits_scaling": 0.0}, "logits_scaling")]:
        with pytest.raises(ConfigError) as err:
            ModelConfig.create(**{**fields, **change})
        assert err.value.field == field, change
    plain = {k: v for k, v in fields.items() if k not in ("layer_types", "n_q_heads", "n_kv_heads")}
    with pytest.raises(ConfigError) as err:  # attention fields without an attention layer
        ModelConfig.create(**plain)
    assert err.value.field == "attn_head_dim"
    with pytest.raises(ConfigError) as err:
        init_model(cfg)
    assert err.value.field == "layer_types"


@pytest.mark.parametrize("backend", ["reference", "exact"])
def test_a_bfloat16_state_rounds_the_kv_rows_before_they_are_read(granite, backend):
    """A narrow state dtype: the chunk's own k and v rows are rounded before its queries read them,
    as a later chunk reads them, so the bits still do not depend on the chunking."""
    _, d, toks, _ = granite
    model = load_model(d, backend=backend, state_dtype=torch.bfloat16)
    runs = [scan_chunks(model, model.initial_state(), toks, chunks) for chunks in CHUNKINGS[:2]]
    assert torch.equal(runs[0][0], runs[1][0]) and _state_equal(runs[0][1], runs[1][1])
    assert runs[0][1].tensors["layers.1.k"].dtype == torch.bfloat16


def test_the_triton_backend_refuses_a_hybrid_at_load(granite):
    _, d, _, _ = granite
    with pytest.raises(UnsupportedBackend, match="no attention kernel"):
        load_model(d, backend="triton")
