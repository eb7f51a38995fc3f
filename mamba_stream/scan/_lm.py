"""The language model around the mixers, with mamba-ssm's `MambaLMHeadModel` parameter names.

    backbone.embedding.weight                  (V, D)
    backbone.layers.{i}.norm.weight[/bias]     (D,)
    backbone.layers.{i}.mixer.*                see the mixer modules (an attention layer's:
                                               q_proj, k_proj, v_proj, o_proj, `scan._layers`)
    backbone.layers.{i}.mlp_norm.weight        (D,)      a hybrid's MLP sublayer: its RMS norm,
    backbone.layers.{i}.mlp.input_linear.weight (2I, D)   and its gated MLP
    backbone.layers.{i}.mlp.output_linear.weight (D, I)
    backbone.norm_f.weight[/bias]              (D,)
    lm_head.weight                             (V, D), tied to the embedding unless configured

Dimension letters: B batch, L tokens, D d_model, V padded vocabulary.
Block order (mamba-ssm's "add -> norm -> mixer"): residual = hidden + residual;
hidden = mixer(norm(residual)); after the last block, logits = lm_head(norm_f(hidden + residual)).

A model is a list of typed blocks (`_Block.kind`: "mamba1", "mamba2", "mamba3" or "attention",
`ModelConfig.kinds`); a hybrid's block may carry an MLP sublayer (`mlp_norm`, `mlp`). A plain Mamba
model's blocks hold exactly the parameters they always held, under the same names.
"""

from __future__ import annotations

import torch
from torch import nn

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._layers import AttentionMixer, GatedMLP
from mamba_stream.scan._mamba1 import Mamba1Mixer
from mamba_stream.scan._mamba2 import Mamba2Mixer
from mamba_stream.scan._mamba3 import Mamba3Mixer
from mamba_stream.scan._mixer import Mixer
from mamba_stream.scan._quant import Q8Weight

__all__ = ["MambaLM"]

_MIXERS: dict[str, type[Mixer]] = {
    "mamba1": Mamba1Mixer,
    "mamba2": Mamba2Mixer,
    "mamba3": Mamba3Mixer,
    "attention": AttentionMixer,
}


class _Norm(nn.Module):
    def __init__(self, dim: int, rms: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        if not rms:
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("bias", None)


class _Block(nn.Module):
    """One layer: norm + mixer of its `kind`, and for a hybrid an MLP sublayer with its own norm
    (`mlp_norm`, `mlp`; None otherwise)."""

    def __init__(self, cfg: ModelConfig, kind: str | None = None) -> None:
        super().__init__()
        self.kind: str = kind or cfg.architecture
        self.norm = _Norm(cfg.d_model, cfg.rms_norm)
        self.mixer = _MIXERS[self.kind](cfg)
        self.mlp_norm: _Norm | None = None
        self.mlp: GatedMLP | None = None
        if cfg.mlp_intermediate_size is not None:
            self.mlp_norm = _Norm(cfg.d_model, cfg.rms_norm)
            self.mlp = GatedMLP(cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Built on the meta device (`scan._loading` does, then assigns the weights), the
        # embedding's random init would run torch's Python reference of normal_, whose first call
        # imports torch._dynamo: about a second of every process that loads a model. There it is
        # given its (meta) weight instead; on a real device it is initialized as torch does.
        meta = torch.get_default_device().type == "meta"
        weight = torch.empty(cfg.padded_vocab_size, cfg.d_model) if meta else None
        self.embedding = nn.Embedding(cfg.padded_vocab_size, cfg.d_model, _weight=weight)
        self.layers = nn.ModuleList([_Block(cfg, kind) for kind in cfg.kinds])
        self.norm_f = _Norm(cfg.d_model, cfg.rms_norm)


class MambaLM(nn.Module):
    """Parameters only; `scan._model.Model` runs them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = _Backbone(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the computation: the norms' (the matrices may be held narrower)."""
        return self.backbone.norm_f.weight.dtype

    @property
    def weight_format(self) -> str:
        """The format the matrices are held in (`scan.load_model(weights=...)`): "float32",
        "float64", "bfloat16", "float16" or "q8"."""
        w = self.lm_head.weight
        return "q8" if isinstance(w, Q8Weight) else str(w.dtype).removeprefix("torch.")

    @property
    def mixers(self) -> list[Mixer]:
        return [blk.mixer for blk in self.backbone.layers]  # type: ignore[misc]
