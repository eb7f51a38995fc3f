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

The file is written tensor by tensor, a slab of rows at a time, so a 14.6 GB bfloat16 checkpoint
needs a few hundred MB of memory to make. `--dtype q8` writes the matrices as block-int8 (the
`<name>_q8` / `<name>_scale` tensors `scan.load_model` reads as q8), the rest in float32.

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

from mamba_stream.scan import Q8Weight, config_from_json, parameter_shapes, quantize_q8

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
}
_DTYPES = {"float32": (torch.float32, "F32"), "bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16"),
           "q8": (torch.int8, "I8")}
#: the matrices a q8 checkpoint holds as blocks (`scan.load_model`'s weight formats)
_MATRICES = ("proj.weight", "embeddings.weight", "lm_head.weight")
_SLAB = 1 << 24  # values generated at once


def hf_config(shape: str) -> dict[str, Any]:
    base = {"hidden_act": "silu", "conv_kernel": 4, "expand": 2, "use_bias": False, "use_conv_bias": True,
            "layer_norm_epsilon": 1e-5, "residual_in_fp32": True}
    if SHAPES[shape]["model_type"] == "mamba":
        # the rank written out, as the released Hugging Face configs do (llama.cpp's converter needs it)
        rank = -(-SHAPES[shape]["hidden_size"] // 16)
        base.update(state_size=16, time_step_rank=rank, architectures=["MambaForCausalLM"])
    else:
        base.update(time_step_limit=[0.0, float("inf")], architectures=["Mamba2ForCausalLM"])
    return {**base, **SHAPES[shape]}


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


def make(shape: str, dtype: str, out: Path, seed: int = 0) -> Path:
    """Write `out`/config.json and `out`/model.safetensors; returns `out`. Kept if already made."""
    cfg_json = hf_config(shape)
    marker = out / ".made"
    want = json.dumps({"shape": shape, "dtype": dtype, "seed": seed, "config": cfg_json}, sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg, _ = config_from_json(cfg_json)
    names = {("backbone.embeddings.weight" if k == "backbone.embedding.weight" else k): v
             for k, v in parameter_shapes(cfg).items()}
    # the entries of the file: (name, safetensors dtype, shape, what fills it)
    entries: list[tuple[str, str, list[int], str, str]] = []
    for name in sorted(names):
        shp = list(names[name])
        if dtype == "q8" and name.endswith(_MATRICES):
            nb = (shp[1] + QB - 1) // QB
            entries += [(name + "_q8", "I8", [shp[0], nb * QB], name, "q"),
                        (name + "_scale", "F16", [shp[0], nb], name, "d")]
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
                if dtype == "q8" and name.endswith(_MATRICES):
                    qw = quantize_q8(vals)
                    for part, t in (("_q8", qw.q), ("_scale", qw.d)):
                        row_bytes = t[0].numel() * t.element_size()
                        fh.seek(base + where[name + part] + r0 * row_bytes)
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
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = make(args.shape, args.dtype, args.out, args.seed)
    size = (path / "model.safetensors").stat().st_size
    print(f"{path}: {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
