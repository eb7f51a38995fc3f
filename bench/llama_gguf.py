"""A bench/make_checkpoint.py hybrid (or FalconMamba) -> GGUF with llama.cpp's own converter, for
the llama.cpp rows of bench/bench_sizes.py.

llama.cpp's `convert_hf_to_gguf.py` (the tree vendored by the llama-cpp-python sdist,
docs/llamacpp.md) reads the hub's spellings of the layer layout only, so it converts from a
directory beside the checkpoint (config.json rewritten, model.safetensors linked) where:

- GraniteMoeHybrid's `layer_types` are mapped back (`linear_attention` -> `mamba`,
  `full_attention` -> `attention`): with transformers' spelling it writes every layer as recurrent;
- Bamba's rotary width (transformers: `rope_parameters.partial_rotary_factor`, 0.5 by default) is
  written as the hub's `attn_rotary_emb`: without it the converter rotates whole heads;
- NemotronH's `layers_block_type` list becomes the hub's `hybrid_override_pattern` ("M*-"): with
  the list its non-MoE reader finds no MLP layers; the converter reads config.json as written (via
  transformers it gains NemotronHConfig's MoE defaults and is written as `nemotron_h_moe`, which
  fails to load: `blk.1.ssm_in.weight not found`); and its vocabulary is taken as Granite's is
  (its own `set_vocab` needs a tokenizer beside the config).

Without a tokenizer file the converter takes its bundled GPT-NeoX vocabulary (50,280 tokens) cut to
the vocabulary size; the shapes here have more ids (65,024; 100,352; 128,256; 131,072), so the list
is padded with unused tokens to the embedding's rows (the values are random: no text is read,
llama-bench feeds random ids). FalconMamba (arch `mamba`, its B/C/dt norms on) converts as saved
but for that padding.

    python bench/llama_gguf.py CKPT --llama-dir $LC/llama_cpp_python-*/vendor/llama.cpp \\
        --outtype bf16|q8_0 --outfile CKPT/model-bfloat16.gguf
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
from pathlib import Path

_GRANITE_KINDS = {"linear_attention": "mamba", "full_attention": "attention"}
_NEMOTRON_KINDS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-"}


def hub_config(cfg: dict) -> dict:
    """config.json in the spelling llama.cpp's converter reads."""
    cfg = dict(cfg)
    if cfg.get("model_type") == "granitemoehybrid" and isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = [_GRANITE_KINDS.get(k, k) for k in cfg["layer_types"]]
    if cfg.get("model_type") == "nemotron_h" and isinstance(cfg.get("layers_block_type"), list):
        kinds = cfg.pop("layers_block_type")
        cfg["hybrid_override_pattern"] = "".join(_NEMOTRON_KINDS[k] for k in kinds)
        # transformers 5.24 saves the layer count as the pattern's length only; the converter reads it
        cfg.setdefault("num_hidden_layers", len(kinds))
    if cfg.get("model_type") == "bamba" and "attn_rotary_emb" not in cfg:
        # the converter takes the rotary width from the hub's `attn_rotary_emb` only (else it rotates
        # whole heads); transformers saves it as rope_parameters' factor (BambaConfig's default 0.5)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)
        cfg["attn_rotary_emb"] = int(head_dim * factor)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--llama-dir", type=Path, required=True, help="llama.cpp's source tree")
    ap.add_argument("--outtype", default="bf16")
    ap.add_argument("--outfile", type=Path, required=True)
    args = ap.parse_args()
    tree = args.llama_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="llama-gguf-") as tmp:
        d = Path(tmp)
        cfg = hub_config(json.loads((args.ckpt / "config.json").read_text()))
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (d / "model.safetensors").symlink_to((args.ckpt / "model.safetensors").resolve())
        sys.path[:0] = [str(tree), str(tree / "gguf-py")]  # the converter finds models/ under sys.path[0]
        import gguf
        from conversion.base import TextModel

        builtin = TextModel._set_vocab_builtin

        def padded(self, model_name, vocab_size):
            w = self.gguf_writer
            add_list, add_types = w.add_token_list, w.add_token_types
            w.add_token_list = lambda toks: add_list(
                [*toks, *(f"<unused_{i}>".encode() for i in range(len(toks), vocab_size))])
            w.add_token_types = lambda types: add_types(
                [*types, *([gguf.TokenType.UNUSED] * (vocab_size - len(types)))])
            try:
                builtin(self, model_name, vocab_size)
            finally:
                del w.add_token_list, w.add_token_types

        TextModel._set_vocab_builtin = padded
        if cfg.get("model_type") == "nemotron_h":
            from conversion.base import ModelBase
            from conversion.granite import GraniteHybridModel
            from conversion.nemotron import NemotronHModel

            # its own set_vocab needs a tokenizer: Granite's takes the builtin one
            NemotronHModel.set_vocab = GraniteHybridModel.set_vocab
            # config.json as written: through transformers' AutoConfig it gains NemotronHConfig's
            # MoE defaults (`num_experts_per_tok`, which makes the converter write nemotron_h_moe)
            # and the pattern as a list again
            ModelBase.load_hparams = staticmethod(lambda dir_model, is_mistral_format: dict(cfg))
        sys.argv = ["convert_hf_to_gguf.py", str(d), "--outtype", args.outtype, "--outfile", str(args.outfile)]
        runpy.run_path(str(tree / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
