"""Random-weight checkpoints of real model shapes, in Hugging Face layout, for the size benchmarks.

No weights can be downloaded here, so the shapes of the models people serve are rebuilt from their
configs with random values (mamba-ssm-style init, deterministic in the seed): enough to measure
load time, memory and speed, which depend on the shapes and the format, not on the values.

    130m-mamba1   d_model 768, 24 layers, vocab 50280 (state-spaces/mamba-130m)
    130m-mamba2   d_model 768, 24 layers, d_state 128, headdim 64 (state-spaces/mamba2-130m)
    1.4b-mamba1   d_model 2048, 48 layers (state-spaces/mamba-1.4b)
    1.3b-mamba2   d_model 2048, 48 layers, d_state 128 (state-spaces/mamba2-1.3b)
    7b-mamba1     d_model 4096, 64 layers, vocab 65024, untied head (Falcon-Mamba-7B's shape; its
                  extra B/C/dt norms are not part of the `mamba` layout)
    7b-mamba2     d_model 4096, 64 layers, d_state 128, 8 groups, vocab 32768, untied head
                  (Codestral-Mamba-7B's shape)
    granite-micro Granite-4.0-H-Micro's shape (GraniteMoeHybrid, 3B dense): hidden 2048, 40 layers,
                  attention (32 q / 8 kv heads of 64, NoPE) at 5, 15, 25, 35, the rest Mamba-2 (64
                  heads x 64, state 128, 1 group), each followed by the shared MLP (8192), vocab
                  100352, tied; 131072 positions
    nemotron-h-8b Nemotron-H-8B's shape (NemotronH): hidden 4096, 52 layers "M-M-M-M*-...": 24
                  Mamba-2 (128 heads x 64, state 128, 8 groups), 4 attention (32 q / 8 kv heads of
                  128, NoPE), 24 MLP-only (relu2, 21504); vocab 131072, untied
    bamba-9b      Bamba-9B's shape (ibm-ai-platform/Bamba-9B, model_type "bamba"): hidden 4096, 32
                  layers, attention (32 q / 8 kv heads of 128, RoPE theta 10000 on half of each
                  head) at 9, 18, 27, the rest Mamba-2 (128 heads x 64, state 128, 1 group), each
                  followed by a gated SiLU MLP (14336); vocab 128256, untied; 4096 positions
    falcon-mamba-7b FalconMamba-7B's shape (tiiuae/falcon-mamba-7b, model_type "falcon_mamba"):
                  7b-mamba1's layers (hidden 4096, 64 layers, state 16, dt rank 256, vocab 65024,
                  untied) with the weightless RMS norms on B, C and dt (`mixer_rms_eps` 1e-6)

The hybrids and FalconMamba are written as transformers 5.24 saves them (its config.json fields,
`layer_types` / `layers_block_type` in its spelling, its tensor names: Bamba's MLP as separate
gate_proj / up_proj); `--tiny` writes the same layout (the same layer pattern, every kind of tensor)
at hidden 64, for tests.

The file is written tensor by tensor, a slab of rows at a time, so a 14.6 GB bfloat16 checkpoint
needs a few hundred MB of memory to make. `--dtype q8` writes the matrices as block-int8 (the
`<name>_q8` / `<name>_scale` tensors `scan.load_model` reads as q8, under the checkpoint's own
names: a hybrid's embedding pair is `model.embed_tokens.weight_q8` / `_scale`), the rest in float32.

    python bench/make_checkpoint.py 7b-mamba2 --dtype bfloat16 --out /tmp/ckpt/7b-mamba2-bf16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mamba_stream.scan import MambaLM, ModelConfig, Q8Weight, config_from_json, parameter_shapes, quantize_q8
from mamba_stream.scan._hf import ARCHITECTURES

QB = Q8Weight.block

SHAPES: dict[str, dict[str, Any]] = {
    "130m-mamba1": {"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280,
                    "tie_word_embeddings": True},
    "130m-mamba2": {"model_type": "mamba2", "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50288,
                    "state_size": 128, "head_dim": 64, "num_heads": 24, "n_groups": 1, "tie_word_embeddings": True},
    "1.4b-mamba1": {"model_type": "mamba", "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 50280,
                    "tie_word_embeddings": True},
    "1.3b-mamba2": {"model_type": "mamba2", "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 50288,
                    "state_size": 128, "head_dim": 64, "num_heads": 64, "n_groups": 1, "tie_word_embeddings": True},
    "7b-mamba1": {"model_type": "mamba", "hidden_size": 4096, "num_hidden_layers": 64, "vocab_size": 65024,
                  "tie_word_embeddings": False},
    "7b-mamba2": {"model_type": "mamba2", "hidden_size": 4096, "num_hidden_layers": 64, "vocab_size": 32768,
                  "state_size": 128, "head_dim": 64, "num_heads": 128, "n_groups": 8, "tie_word_embeddings": False},
    # FalconMambaConfig's own fields beside the Mamba-1 ones (its dt rank 256 = hidden / 16, as hf_config writes)
    "falcon-mamba-7b": {"model_type": "falcon_mamba", "hidden_size": 4096, "num_hidden_layers": 64,
                        "vocab_size": 65024, "tie_word_embeddings": False, "mixer_rms_eps": 1e-6},
}
_INF = {"__float__": "Infinity"}  # transformers 5.x writes +infinity so in config.json
#: Granite-4.0-H-Micro's layers: attention at 5, 15, 25, 35 (transformers' spelling of `layer_types`)
_GRANITE_KINDS = ["full_attention" if i % 10 == 5 else "linear_attention" for i in range(40)]
#: Nemotron-H-8B's `hybrid_override_pattern` (M Mamba-2, * attention, - MLP): 24 / 4 / 24
_NEMOTRON_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_NEMOTRON_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
HYBRIDS: dict[str, dict[str, Any]] = {
    # GraniteMoeHybridConfig's fields as transformers 5.24 saves them (dense: no experts, the MLP is
    # the shared one; llama.cpp's converter wants intermediate_size == shared_intermediate_size then)
    "granite-micro": {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "attention_bias": False, "attention_dropout": 0.0, "attention_multiplier": 0.015625, "bos_token_id": 100257,
        "embedding_multiplier": 12.0, "eos_token_id": 100257, "pad_token_id": 100256, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.1, "intermediate_size": 8192, "layer_types": _GRANITE_KINDS,
        "logits_scaling": 8.0, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_d_conv": 4,
        "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 64,
        "mamba_proj_bias": False, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_experts_per_tok": 0, "num_hidden_layers": 40, "num_key_value_heads": 8, "num_local_experts": 0,
        "output_router_logits": False, "position_embedding_type": "nope", "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.01, "shared_intermediate_size": 8192, "tie_word_embeddings": True,
        "time_step_limit": [0.0, _INF], "use_cache": True, "vocab_size": 100352,
    },
    # NemotronHConfig's fields as transformers 5.24 saves them (the pattern as `layers_block_type`)
    "nemotron-h-8b": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4,
        "eos_token_id": 2, "expand": 2, "head_dim": 128, "hidden_dropout": 0.0, "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 21504, "layer_norm_epsilon": 1e-5,
        "layers_block_type": [_NEMOTRON_KINDS[c] for c in _NEMOTRON_8B], "mamba_head_dim": 64,
        "mamba_hidden_act": "silu", "mamba_num_heads": 128, "mamba_proj_bias": False,
        "max_position_embeddings": 8192, "mlp_bias": False, "mlp_hidden_act": "relu2", "n_groups": 8,
        "num_attention_heads": 32, "num_hidden_layers": 52, "num_key_value_heads": 8, "pad_token_id": 0,
        "rescale_prenorm_residual": True, "residual_in_fp32": False, "sliding_window": None, "ssm_state_size": 128,
        "tie_word_embeddings": False, "time_step_floor": 1e-4, "time_step_limit": [0.0, _INF],
        "time_step_max": 0.1, "time_step_min": 0.001, "use_bias": False, "use_cache": True, "use_conv_bias": True,
        "vocab_size": 131072,
    },
    # BambaConfig's fields as transformers 5.24 saves them (Bamba-9B's values; the rotary factor
    # 0.5 is BambaConfig's, the hub's `attn_rotary_emb` 64 = 128 * 0.5)
    "bamba-9b": {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba",
        "attention_bias": False, "attention_dropout": 0.0, "attn_layer_indices": [9, 18, 27], "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_d_conv": 4,
        "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 128,
        "mamba_proj_bias": False, "max_position_embeddings": 4096, "mlp_bias": False, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_logits_to_keep": 1, "pad_token_id": 0,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "time_step_limit": [0.0, _INF], "use_cache": True, "vocab_size": 128256,
        "z_loss_coefficient": 0.0,
    },
}
#: `--tiny`: the same layouts at hidden 64 (4 q / 2 kv heads of 16, Mamba-2 8 heads x 16, state 16)
_TINY = {
    "granite-micro": {"hidden_size": 64, "intermediate_size": 128, "shared_intermediate_size": 128,
                      "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_heads": 8, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "max_position_embeddings": 2048, "vocab_size": 512,
                      "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
    "nemotron-h-8b": {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "mamba_head_dim": 16,
                      "mamba_num_heads": 8, "n_groups": 2, "ssm_state_size": 16, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "max_position_embeddings": 2048, "vocab_size": 512},
    "bamba-9b": {"hidden_size": 64, "intermediate_size": 128, "mamba_d_head": 16, "mamba_d_state": 16,
                 "mamba_n_heads": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 2048, "vocab_size": 512},
    # every FalconMamba layer is alike: 4 of them show the layout
    "falcon-mamba-7b": {"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 512},
}
_DTYPES = {"float32": (torch.float32, "F32"), "bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16"),
           "q8": (torch.int8, "I8")}
_SLAB = 1 << 24  # values generated at once


def hf_config(shape: str, tiny: bool = False) -> dict[str, Any]:
    if tiny and shape not in _TINY:
        raise ValueError(f"--tiny is for the shapes {sorted(_TINY)}")
    small = _TINY[shape] if tiny else {}
    if shape in HYBRIDS:
        return json.loads(json.dumps({**HYBRIDS[shape], **small}))
    fields = {**SHAPES[shape], **small}
    base = {"hidden_act": "silu", "conv_kernel": 4, "expand": 2, "use_bias": False, "use_conv_bias": True,
            "layer_norm_epsilon": 1e-5, "residual_in_fp32": True}
    if fields["model_type"] in ("mamba", "falcon_mamba"):
        # the rank written out, as the released Hugging Face configs do (llama.cpp's converter needs it)
        rank = -(-fields["hidden_size"] // 16)
        base.update(state_size=16, time_step_rank=rank, architectures=["MambaForCausalLM"])
        if fields["model_type"] == "falcon_mamba":
            # FalconMambaConfig writes d_inner as intermediate_size (llama.cpp's converter reads it)
            base.update(architectures=["FalconMambaForCausalLM"], intermediate_size=2 * fields["hidden_size"])
    else:
        base.update(time_step_limit=[0.0, float("inf")], architectures=["Mamba2ForCausalLM"])
    return {**base, **fields}


def _values(name: str, shape: tuple[int, ...], n_layer: int, seed: int, rows: slice) -> torch.Tensor:
    """Rows `rows` of the tensor `name`: mamba-ssm's init, deterministic in (seed, name, row)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
                                      + rows.start)
    sub = (rows.stop - rows.start, *shape[1:])
    if name.endswith("A_log"):
        if len(shape) == 2:  # Mamba-1: A = -(1 .. N) in every channel
            return torch.log(torch.arange(1, shape[1] + 1, dtype=torch.float32)).expand(sub).contiguous()
        return torch.log(torch.empty(sub).uniform_(1.0, 16.0, generator=g))
    if name.endswith((".D", "norm.weight")) or name.endswith("norm_f.weight"):
        return torch.ones(sub)
    if name.endswith(("dt_bias", "dt_proj.bias")):
        dt = torch.exp(torch.empty(sub).uniform_(math.log(1e-3), math.log(0.1), generator=g))
        return dt + torch.log(-torch.expm1(-dt))  # the inverse of softplus
    if name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(sub).uniform_(-bound, bound, generator=g)
    if name.endswith("conv1d.bias"):
        return torch.empty(sub).uniform_(-0.5, 0.5, generator=g)
    if name.endswith("dt_proj.weight"):
        bound = shape[1] ** -0.5
        return torch.empty(sub).uniform_(-bound, bound, generator=g)
    std = 0.02 / (math.sqrt(n_layer) if name.endswith("out_proj.weight") else 1.0)
    return torch.randn(sub, generator=g) * std


def _hf_names(ours: str, shape: tuple[int, ...], cfg_json: dict[str, Any], kinds: tuple[str, ...]
              ) -> list[tuple[str, tuple[int, ...]]]:
    """Our parameter (`scan._lm`) -> the checkpoint tensors that hold it, (name, shape) each:
    mamba-ssm's names (Mamba-1/2, FalconMamba, but for the embedding), or transformers' for a hybrid
    (the inverse of `scan._hf`'s renaming). One tensor, but for Bamba's MLP input (2I, D), which
    transformers stores as gate_proj and up_proj (I, D) each, gate rows first."""
    model_type = cfg_json["model_type"]
    layer = None
    if ours.startswith("backbone.layers."):
        index, _, rest = ours[len("backbone.layers."):].partition(".")
        layer = int(index)
    if model_type in ("granitemoehybrid", "bamba"):
        top = {"backbone.embedding.weight": "model.embed_tokens.weight"}
        top["backbone.norm_f.weight"] = "model.norm.weight" if model_type == "granitemoehybrid" \
            else "model.final_layernorm.weight"
        if layer is None:
            return [(top.get(ours, ours), shape)]
        mixer = "self_attn." if kinds[layer] == "attention" else "mamba."
        if model_type == "bamba":
            if rest.startswith("mlp.input_linear."):
                half = (shape[0] // 2, *shape[1:])
                leaf = rest[len("mlp.input_linear."):]
                return [(f"model.layers.{layer}.feed_forward.{proj}.{leaf}", half) for proj in ("gate_proj", "up_proj")]
            pairs = (("norm.", "input_layernorm."), ("mlp_norm.", "pre_ff_layernorm."),
                     ("mlp.output_linear.", "feed_forward.down_proj."), ("mixer.", mixer))
        else:
            pairs = (("norm.", "input_layernorm."), ("mlp_norm.", "post_attention_layernorm."),
                     ("mlp.", "shared_mlp."), ("mixer.", mixer))
        for mine, theirs in pairs:
            if rest.startswith(mine):
                return [(f"model.layers.{layer}.{theirs}{rest[len(mine):]}", shape)]
        return [(ours, shape)]
    if model_type == "nemotron_h" and layer is not None and kinds[layer] == "mlp":
        for mine, theirs in (("mixer.input_linear.", "mixer.up_proj."), ("mixer.output_linear.", "mixer.down_proj.")):
            if rest.startswith(mine):
                return [(f"backbone.layers.{layer}.{theirs}{rest[len(mine):]}", shape)]
    return [("backbone.embeddings.weight" if ours == "backbone.embedding.weight" else ours, shape)]


def _as_read(files: dict[str, tuple[tuple[int, ...], torch.dtype]], cfg_json: dict[str, Any], cfg: ModelConfig
             ) -> dict[str, tuple[int, ...]]:
    """The names and shapes `scan.load_model` reads a file's tensors as, by its own renaming
    (`_loading._canonical_weights`, `scan._hf`: a hybrid's joins and all), before the q8 pairs fold."""
    sd = {name.replace("backbone.embeddings.weight", "backbone.embedding.weight"):
          torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in files.items()}
    arch = ARCHITECTURES.get(cfg_json["model_type"])
    if arch is not None:
        sd = arch.tensors(sd, cfg)
    return {name: tuple(t.shape) for name, t in sd.items()}


def _q8_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A (rows, cols) matrix's q8 pair: int8 values padded to whole blocks, one scale a block."""
    nb = (shape[1] + QB - 1) // QB
    return (shape[0], nb * QB), (shape[0], nb)


def layout(cfg_json: dict[str, Any], dtype: str) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """The tensors a checkpoint of `cfg_json` holds: file name -> (shape, the stem of its q8 pair
    where `dtype` is q8 and it is (part of) a matrix, else None). Checked: the loader reads the
    file's tensors back as exactly the parameters they were made for, in their shapes."""
    cfg, _ = config_from_json(cfg_json)
    with torch.device("meta"):  # the matrices `scan.load_model` holds in the weight format
        matrices = {f"{n}.weight" for n, m in MambaLM(cfg).named_modules()
                    if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    params = parameter_shapes(cfg)
    out: dict[str, tuple[tuple[int, ...], str | None]] = {}
    for ours, shape in params.items():
        for name, part in _hf_names(ours, shape, cfg_json, cfg.kinds):
            out[name] = (part, name if dtype == "q8" and ours in matrices else None)
    want = dict(params)
    files: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, stem) in out.items():
        if stem is None:
            files[name] = (shape, torch.float32)
        else:
            q, d = _q8_shapes(shape)
            files[stem + "_q8"], files[stem + "_scale"] = (q, torch.int8), (d, torch.float16)
    if dtype == "q8":
        for ours in matrices & set(params):
            want[ours + "_q8"], want[ours + "_scale"] = _q8_shapes(want.pop(ours))
    got = _as_read(files, cfg_json, cfg)
    if got != want:
        wrong = sorted(set(got.items()) ^ set(want.items()))
        raise AssertionError(f"the loader would read these tensors otherwise than made: {wrong[:8]}")
    return out


def make(shape: str, dtype: str, out: Path, seed: int = 0, tiny: bool = False) -> Path:
    """Write `out`/config.json and `out`/model.safetensors; returns `out`. Kept if already made."""
    cfg_json = hf_config(shape, tiny)
    marker = out / ".made"
    want = json.dumps({"shape": shape, "dtype": dtype, "seed": seed, "config": cfg_json}, sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg, _ = config_from_json(cfg_json)
    tensors = layout(cfg_json, dtype)
    names = {k: v[0] for k, v in tensors.items()}
    # the entries of the file: (name, safetensors dtype, shape, what fills it)
    entries: list[tuple[str, str, list[int], str, str]] = []
    for name in sorted(names):
        shp = list(names[name])
        stem = tensors[name][1]
        if stem is not None:
            q, d = _q8_shapes(names[name])
            entries += [(stem + "_q8", "I8", list(q), name, "q"), (stem + "_scale", "F16", list(d), name, "d")]
        else:
            entries.append((name, "F32" if dtype == "q8" else _DTYPES[dtype][1], shp, name, "v"))
    entries.sort()
    item = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "made_by": "bench/make_checkpoint.py"}}
    offset, where = 0, {}
    for ename, st_dtype, shp, _, _ in entries:
        nbytes = math.prod(shp) * item[st_dtype]
        header[ename] = {"dtype": st_dtype, "shape": shp, "data_offsets": [offset, offset + nbytes]}
        where[ename] = offset
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned
    base = 8 + len(raw)
    with (out / "model.safetensors").open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(base + offset)
        for name in sorted(names):
            shp = names[name]
            per_row = max(1, math.prod(shp[1:]))
            step = max(1, _SLAB // per_row)
            for r0 in range(0, shp[0], step):
                rows = slice(r0, min(shp[0], r0 + step))
                vals = _values(name, shp, cfg.n_layer, seed, rows)
                stem = tensors[name][1]
                if stem is not None:
                    qw = quantize_q8(vals)
                    for part, t in (("_q8", qw.q), ("_scale", qw.d)):
                        row_bytes = t[0].numel() * t.element_size()
                        fh.seek(base + where[stem + part] + r0 * row_bytes)
                        fh.write(t.contiguous().view(torch.uint8).numpy().tobytes())
                else:
                    t = vals.to(torch.float32 if dtype == "q8" else _DTYPES[dtype][0]).contiguous()
                    fh.seek(base + where[name] + r0 * per_row * t.element_size())
                    fh.write(t.view(torch.uint8).numpy().tobytes())
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    marker.write_text(want)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted([*SHAPES, *HYBRIDS]))
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a hybrid's layout at hidden 64 (for tests)")
    args = ap.parse_args()
    path = make(args.shape, args.dtype, args.out, args.seed, args.tiny)
    size = (path / "model.safetensors").stat().st_size
    print(f"{path}: {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
