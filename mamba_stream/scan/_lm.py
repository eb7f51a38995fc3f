"""The language model around the mixers, with mamba-ssm's `MambaLMHeadModel` parameter names.

    backbone.embedding.weight                  (V, D)
    backbone.layers.{i}.norm.weight[/bias]     (D,)
    backbone.layers.{i}.mixer.*                see the mixer modules (an attention layer's:
                                               q_proj, k_proj, v_proj, o_proj, `scan._layers`)
    backbone.layers.{i}.mlp_norm.weight        (D,)      a hybrid's ffn sublayer: its RMS norm,
    backbone.layers.{i}.mlp.input_linear.weight (2I, D)   its MLP (gated; (I, D) not gated)
    backbone.layers.{i}.mlp.output_linear.weight (D, I)   (an "mlp" layer's: under mixer.)
    backbone.layers.{i}.moe.router.weight      (E, D)    its routed experts, each a gated MLP
    backbone.layers.{i}.moe.experts.{e}.input_linear.weight (2I', D), .output_linear.weight (D, I')
    backbone.layers.{i}.mixer.router.weight, .correction_bias (E,), .latent_in / .latent_out,
        .experts.{e}.*, .shared.*              an "moe" layer's (Nemotron-H): the experts block
                                               as its mixer (`scan._layers.Experts`)
    backbone.norm_f.weight[/bias]              (D,)
    backbone.shared.{j}.*                      Zamba2's weight-shared transformer blocks (`scan._shared`)
    lm_head.weight                             (V, D), tied to the embedding unless configured

Dimension letters: B batch, L tokens, D d_model, V padded vocabulary.
Block order (mamba-ssm's "add -> norm -> mixer"): residual = hidden + residual;
hidden = mixer(norm(residual)); after the last block, logits = lm_head(norm_f(hidden + residual)).

A model is a list of typed blocks (`_Block.kind`: "mamba1", "mamba2", "mamba3", "attention",
"mlp" or "parallel": a Mamba-2 and attention side by side, `scan._parallel`, `ModelConfig.kinds`);
a hybrid's block may carry an ffn sublayer (`_Block.ffn`: "mlp" or
"moe", `ModelConfig.ffns`) with its own norm. A plain Mamba model's blocks hold exactly the
parameters they always held, under the same names.
"""

from __future__ import annotations

import torch
from torch import nn

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._layers import MLP, AttentionMixer, Experts
from mamba_stream.scan._mamba1 import Mamba1Mixer
from mamba_stream.scan._mamba2 import Mamba2Mixer
from mamba_stream.scan._mamba3 import Mamba3Mixer
from mamba_stream.scan._mixer import Mixer
from mamba_stream.scan._parallel import ParallelMixer
from mamba_stream.scan._quant import Q8Weight
from mamba_stream.scan._shared import SharedBlock, SharedMixer

__all__ = ["MambaLM"]

_MIXERS: dict[str, type[Mixer]] = {
    "mamba1": Mamba1Mixer,
    "mamba2": Mamba2Mixer,
    "mamba3": Mamba3Mixer,
    "attention": AttentionMixer,
    "parallel": ParallelMixer,  # Falcon-H1: mixer.mamba.* and mixer.attn.*
    "shared": SharedMixer,  # Zamba2: mixer.mamba.*, mixer.linear, the site's adapters; calls backbone.shared.{j}
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
    """One layer: norm + mixer of its `kind` (an "mlp" layer's mixer is an `MLP`, an "moe" layer's
    an `Experts` block with its shared MLP), then, where its
    `ffn` is not "none", an ffn sublayer with its own norm (`mlp_norm`): the MLP (`mlp`), or routed
    experts (`moe`) with the MLP beside them where `moe_shared_mlp` (None where absent)."""

    def __init__(self, cfg: ModelConfig, kind: str | None = None, ffn: str = "none") -> None:
        super().__init__()
        self.kind: str = kind or cfg.architecture
        self.ffn = ffn
        self.norm = _Norm(cfg.d_model, cfg.rms_norm)
        self.mixer: Mixer | MLP | Experts
        if self.kind == "mlp":
            self.mixer = MLP(cfg)
        elif self.kind == "moe":  # Nemotron-H: the experts block, its shared MLP inside it
            self.mixer = Experts(cfg, shared=bool(cfg.moe_shared_mlp))
        else:
            self.mixer = _MIXERS[self.kind](cfg)
        self.mlp_norm: _Norm | None = None
        self.mlp: MLP | None = None
        self.moe: Experts | None = None
        if ffn != "none":
            self.mlp_norm = _Norm(cfg.d_model, cfg.rms_norm)
        if ffn == "mlp":
            self.mlp = MLP(cfg)
        elif ffn == "moe" and cfg.moe_shared_mlp:
            self.mlp = MLP(cfg, cfg.moe_shared_intermediate_size)
        if ffn == "moe":
            self.moe = Experts(cfg)


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
        self.layers = nn.ModuleList([_Block(cfg, kind, ffn) for kind, ffn in zip(cfg.kinds, cfg.ffns, strict=True)])
        self.norm_f = _Norm(cfg.d_model, cfg.rms_norm)
        if "shared" in cfg.kinds:  # Zamba2: the blocks held once, called in rotation by the "shared" layers
            assert cfg.shared_blocks is not None
            self.shared = nn.ModuleList([SharedBlock(cfg) for _ in range(cfg.shared_blocks)])
            sites = [blk.mixer for blk in self.layers if blk.kind == "shared"]
            for s, site in enumerate(sites):
                assert isinstance(site, SharedMixer)
                site.block = s % cfg.shared_blocks


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
        """Each layer's mixer (an "mlp" layer's is its `MLP`, which holds no state)."""
        return [blk.mixer for blk in self.backbone.layers]  # type: ignore[misc]
