"""Model configuration shared by the three architectures and the hybrids built of them.

One flat, frozen record; the model is built from it alone. Fields that only one architecture
reads are ignored by the others but still validated, so a config never means two things.

A hybrid is a list of typed layers: `layer_types` names each layer's kind (its Mamba
`architecture`, "attention", "mlp": a layer whose only sublayer is an MLP, "moe": one whose only
sublayer is routed experts), and `ffn_types` what
follows each layer's mixer ("none", "mlp", or "moe": routed experts, with the MLP beside them where
`moe_shared_mlp`). Its attention, MLP, MoE and multiplier fields are None on a plain Mamba model and
left out of its JSON (`model_dump`), so existing configs dump as they always did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from mamba_stream.scan._errors import ConfigError

__all__ = ["FFN_KINDS", "HYBRID_FIELDS", "LAYER_KINDS", "ModelConfig"]

#: the kinds a layer of a model can be (`ModelConfig.layer_types`)
LAYER_KINDS = ("mamba1", "mamba2", "mamba3", "attention", "mlp", "parallel", "moe", "shared")
#: what may follow a layer's mixer (`ModelConfig.ffn_types`)
FFN_KINDS = ("none", "mlp", "moe")
#: the optional fields of a hybrid model: None (unset) on a plain Mamba model, left out of its JSON
HYBRID_FIELDS = ("layer_types", "ffn_types", "n_q_heads", "n_kv_heads", "attn_head_dim", "attention_bias",
                 "position_embedding", "rope_theta", "rotary_dim", "mlp_intermediate_size", "mlp_activation",
                 "mlp_gated", "mlp_bias", "moe_experts", "moe_top_k", "moe_intermediate_size", "moe_router",
                 "moe_shared_mlp", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                 "logits_scaling", "max_positions", "ssm_in_multiplier", "ssm_multipliers", "ssm_out_multiplier",
                 "attention_in_multiplier", "attention_out_multiplier", "key_multiplier", "mlp_gate_multiplier",
                 "mlp_down_multiplier", "logits_multiplier", "moe_groups", "moe_topk_groups", "moe_norm_topk",
                 "moe_scaling", "moe_shared_intermediate_size", "moe_latent_size", "shared_blocks",
                 "shared_adapter_rank", "shared_attention_adapter")

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "mamba1": {"d_state": 16, "d_conv": 4},
    "mamba2": {"d_state": 128, "d_conv": 4, "headdim": 64},
    "mamba3": {"d_state": 128, "d_conv": 0, "headdim": 64},
}


class ModelConfig(BaseModel):
    """Everything needed to build a Mamba language model with explicit state."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Literal["mamba1", "mamba2", "mamba3"]
    d_model: int
    n_layer: int
    vocab_size: int  # before padding to pad_vocab_size_multiple
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    rms_norm: bool = True  # False: LayerNorm (with bias), as mamba-ssm allows
    norm_eps: float = 1e-5
    # Kept so that checkpoints round-trip; the engine computes in float32 or float64, where the
    # residual stream is already at least float32, so it changes no arithmetic today.
    residual_in_fp32: bool = True

    d_state: int = 0  # filled with the architecture's default by `create`
    d_conv: int = 0  # filled with the architecture's default by `create`
    expand: float = 2
    bias: bool = False  # in_proj / out_proj bias
    conv_bias: bool = True
    # Mamba-1
    dt_rank: int | None = None  # None: ceil(d_model / 16)
    # FalconMamba: an RMS norm without a learned weight, with this eps, over each of dt (its
    # dt_rank inputs, before dt_proj), B and C (each over d_state) after x_proj splits them; the
    # scan then reads other inputs than a plain Mamba-1's, so the state schema records it.
    # None: no such norms (Mamba-1 as mamba-ssm has it).
    bcdt_rms_eps: float | None = None
    # Jamba: those three norms each with a learned weight (`mixer.dt_norm.weight` (R,),
    # `mixer.b_norm.weight` (N,), `mixer.c_norm.weight` (N,)), applied as the last product of the
    # norm; needs bcdt_rms_eps. None: weightless (FalconMamba), and left out of the JSON
    bcdt_norm_weights: bool | None = None
    # Mamba-2 / Mamba-3
    headdim: int = 0  # filled with the architecture's default by `create`
    ngroups: int = 1
    chunk_size: int = 64  # block length of the chunked backend; no effect on results' meaning
    # Mamba-2
    d_ssm: int | None = None  # None: d_inner (no gated-MLP part)
    D_has_hdim: bool = False
    rmsnorm: bool = True  # gated RMSNorm before out_proj
    norm_before_gate: bool = False
    mixer_norm_eps: float = 1e-5
    dt_min_clamp: float = 0.0
    dt_max_clamp: float | None = None
    # Mamba-3
    rope_fraction: float = 0.5
    A_floor: float = 1e-4
    is_outproj_norm: bool = False
    mimo_rank: int = 1  # 1: SISO
    # --- hybrids; every field None on a plain Mamba model -------------------------------------
    # each layer's kind: `architecture` (its Mamba layers), "attention", or "mlp" (Nemotron-H's
    # MLP-only layers: norm, then the MLP as the layer's mixer); None: all `architecture`
    # "parallel" (Falcon-H1): a Mamba-2 mixer and attention side by side on the same normed input,
    # their outputs summed (`scan._parallel.ParallelMixer`)
    # "moe" (Nemotron-H's MoE layers): norm, then the routed experts (`scan._layers.Experts`, with
    # their shared MLP where moe_shared_mlp) as the layer's mixer; no state
    # "shared" (Zamba2's hybrid layers): a Mamba-2 layer whose input first gains the output of a
    # weight-shared transformer block (`scan._shared`; the fields shared_* below)
    layer_types: tuple[Literal["mamba1", "mamba2", "mamba3", "attention", "mlp", "parallel", "moe", "shared"],
                       ...] | None = None
    # what follows each layer's mixer, with its own norm: "none", "mlp" (the gated MLP), "moe" (the
    # routed experts); None: "mlp" on every layer where mlp_intermediate_size is set, else "none"
    ffn_types: tuple[Literal["none", "mlp", "moe"], ...] | None = None
    # grouped-query attention: n_q_heads query heads share n_kv_heads key/value heads of
    # attn_head_dim features (named apart from `headdim`, the Mamba-2/3 heads' size)
    n_q_heads: int | None = None
    n_kv_heads: int | None = None
    attn_head_dim: int | None = None
    attention_bias: bool | None = None  # q/k/v/o projections with a bias
    position_embedding: Literal["nope", "rope"] | None = None
    rope_theta: float | None = None
    # the leading features of each head that rope rotates (rotate-half pairs i, i + rotary_dim/2);
    # None: all attn_head_dim (Bamba rotates half)
    rotary_dim: int | None = None
    # the MLP (an "mlp" layer, an "mlp" ffn, the MLP beside routed experts), with its own RMS norm:
    # gated: out = W_out(act(gate) * up), [gate, up] = W_in x; not gated: out = W_out(act(W_in x)).
    # mlp_gated None: gated. mlp_bias None: no biases
    mlp_intermediate_size: int | None = None
    mlp_activation: Literal["silu", "relu2", "gelu"] | None = None  # gelu: the exact (erf) GELU
    mlp_gated: bool | None = None
    mlp_bias: bool | None = None
    # routed experts ("moe" ffn): a router W_r (E, D) scores each token; its top moe_top_k experts
    # (ties to the lower index) each run a gated MLP of moe_intermediate_size with mlp_activation,
    # weighted: "topk_softmax" (GraniteMoe: the softmax of the chosen logits) or "softmax_topk"
    # (Jamba: the chosen entries of the softmax over all E); summed in expert-index order.
    # moe_shared_mlp: the layer's MLP runs beside them on the same input and is added (Granite)
    moe_experts: int | None = None
    moe_top_k: int | None = None
    moe_intermediate_size: int | None = None
    moe_router: Literal["topk_softmax", "softmax_topk", "sigmoid_group_topk"] | None = None
    moe_shared_mlp: bool | None = None
    # "sigmoid_group_topk" (Nemotron-H, DeepSeek-V3's rule): scores = sigmoid(logits); the choice reads
    # scores + the block's correction bias (a tensor, E); the E experts split into moe_groups groups
    # of E / moe_groups, each scored by the sum of its top 2, the best moe_topk_groups kept; the top
    # moe_top_k experts among those; their weights the unbiased scores, divided by their sum (+1e-20)
    # where moe_norm_topk. These three: set exactly with that rule
    moe_groups: int | None = None
    moe_topk_groups: int | None = None
    moe_norm_topk: bool | None = None
    # the routing weights * moe_scaling (any rule; None: no operation)
    moe_scaling: float | None = None
    # the shared MLP's own intermediate size (None: mlp_intermediate_size)
    moe_shared_intermediate_size: int | None = None
    # the experts run in a latent width: x -> latent_in (D -> moe_latent_size) -> experts -> their
    # weighted sum -> latent_out (back to D); biases by mlp_bias. None: the experts read x itself
    moe_latent_size: int | None = None
    # Granite's scalars: embeddings * embedding_multiplier; every sublayer's output *
    # residual_multiplier before it joins the residual stream; attention scores * attention_multiplier
    # (the softmax scale); logits / logits_scaling. None: no such operation at all
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    # the per-stream bound on positions where a model has attention: its KV is preallocated at
    # this many rows, and a chunk that would pass it is refused (`scan.PositionLimit`)
    max_positions: int | None = None
    # Falcon-H1's multipliers, each one exact elementwise product where set (None: no operation):
    # a "parallel" layer's Mamba-2 input * ssm_in_multiplier and output * ssm_out_multiplier, its
    # attention's input * attention_in_multiplier and output * attention_out_multiplier; the Mamba-2
    # in_proj output's five parts (z, x, B, C, dt) each * its ssm_multipliers entry (their mup_vector,
    # before the conv); attention keys * key_multiplier (after k_proj, before rope); the gated MLP's
    # gate * mlp_gate_multiplier (before the activation) and its output * mlp_down_multiplier; the
    # logits * logits_multiplier (a product: not logits_scaling's division)
    ssm_in_multiplier: float | None = None
    ssm_multipliers: tuple[float, float, float, float, float] | None = None
    ssm_out_multiplier: float | None = None
    attention_in_multiplier: float | None = None
    attention_out_multiplier: float | None = None
    key_multiplier: float | None = None
    mlp_gate_multiplier: float | None = None
    mlp_down_multiplier: float | None = None
    logits_multiplier: float | None = None
    # Zamba2: shared_blocks transformer blocks (RMS norm over concat(hidden, embeddings), 2 * d_model
    # wide; attention from that width back to d_model; RMS norm; the gated MLP), held once and called
    # in rotation by the "shared" layers (the s-th such layer calls block s % shared_blocks) with the
    # call site's own KV; each site adds its own rank-shared_adapter_rank LoRA adapters to the MLP's
    # input_linear output and, where shared_attention_adapter, to q, k and v
    shared_blocks: int | None = None
    shared_adapter_rank: int | None = None
    shared_attention_adapter: bool | None = None

    @classmethod
    def create(cls, **fields: Any) -> ModelConfig:
        """Build and validate a config; every problem becomes a `ConfigError` naming its field."""
        arch = fields.get("architecture")
        if arch not in _ARCH_DEFAULTS:
            raise ConfigError(
                f"unsupported architecture {arch!r}; expected one of {sorted(_ARCH_DEFAULTS)}",
                field="architecture",
            )
        for key, value in _ARCH_DEFAULTS[arch].items():
            if fields.get(key) is None:
                fields[key] = value
        try:
            cfg = cls(**fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            raise ConfigError(err["msg"], field=loc) from None
        cfg._check()
        return cfg

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The fields; a hybrid field (or `bcdt_norm_weights`) that is unset (None) is left out, so
        a plain Mamba model's dump (and whatever is derived from it) is what it was before hybrids."""
        out = super().model_dump(**kwargs)
        for name in (*HYBRID_FIELDS, "bcdt_norm_weights"):
            if out.get(name, 0) is None:
                out.pop(name)
        return out

    @property
    def kv_segment_rows(self) -> int | None:
        """R, the KV rows of one segment at rest (`state_codec.codec`), where the model has a
        position bound: a power of two, an eighth of the bound or less, from 16 to 256. Derived from
        the bound (itself in the state schema), so it is no knob of its own: a bound of 4096 or more
        gives 256 (at Granite-4.0-H-Micro's shape a 4 MB segment, a tail of at most 4 MB beside 76 MB
        of Mamba states); a test model bound at 96, 16."""
        if self.max_positions is None:
            return None
        eighth = max(1, self.max_positions // 8)
        return min(256, max(16, 1 << (eighth.bit_length() - 1)))

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind: `layer_types`, or `architecture` for every layer."""
        return self.layer_types if self.layer_types is not None else (self.architecture,) * self.n_layer

    @cached_property
    def ffns(self) -> tuple[str, ...]:
        """What follows each layer's mixer: `ffn_types`, or "mlp" on every layer where
        `mlp_intermediate_size` is set (Granite dense), else "none"."""
        if self.ffn_types is not None:
            return self.ffn_types
        return ("mlp" if self.mlp_intermediate_size is not None else "none",) * self.n_layer

    @cached_property
    def is_hybrid(self) -> bool:
        """Whether the model has anything besides Mamba blocks (attention, an MLP, experts, a
        multiplier)."""
        return any(k not in ("mamba1", "mamba2", "mamba3") for k in self.kinds) or any(
            f != "none" for f in self.ffns) or any(
            getattr(self, m) is not None for m in ("embedding_multiplier", "residual_multiplier", "logits_scaling",
                                                   "logits_multiplier"))

    @cached_property
    def has_attention(self) -> bool:
        """Whether some layer attends: an "attention" layer, or a "parallel" one (Falcon-H1), whose
        KV rows are written by position."""
        return any(k in ("attention", "parallel", "shared") for k in self.kinds)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy; one with `update` derives its sizes afresh (pydantic copies the cached ones)."""
        out = super().model_copy(update=update, deep=deep)
        if update:
            for name, value in vars(ModelConfig).items():
                if isinstance(value, cached_property):
                    out.__dict__.pop(name, None)
        return out

    # --- derived sizes -------------------------------------------------------------------
    # cached: the config is frozen, and a step reads them many times (16 calls a 1-token chunk)

    @cached_property
    def d_inner(self) -> int:
        return int(self.expand * self.d_model)

    @cached_property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return self.vocab_size + (-self.vocab_size) % m if m > 1 else self.vocab_size

    @cached_property
    def resolved_dt_rank(self) -> int:
        return self.dt_rank if self.dt_rank is not None else math.ceil(self.d_model / 16)

    @cached_property
    def resolved_d_ssm(self) -> int:
        return self.d_inner if self.d_ssm is None else self.d_ssm

    @cached_property
    def nheads(self) -> int:
        if self.architecture == "mamba2":
            return self.resolved_d_ssm // self.headdim
        if self.architecture == "mamba3":
            return self.d_inner // self.headdim
        return 0

    @cached_property
    def conv_dim(self) -> int:
        if self.architecture == "mamba1":
            return self.d_inner
        if self.architecture == "mamba2":
            return self.resolved_d_ssm + 2 * self.ngroups * self.d_state
        return 0

    @cached_property
    def n_angles(self) -> int:
        if self.architecture != "mamba3":
            return 0
        split = int(self.d_state * self.rope_fraction)
        return (split - split % 2) // 2

    # --- validation ------------------------------------------------------------------------

    def _check(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                raise ConfigError(msg, field=field)

        need(self.d_model > 0, "d_model", f"must be positive, got {self.d_model}")
        need(self.n_layer > 0, "n_layer", f"must be positive, got {self.n_layer}")
        need(self.vocab_size > 0, "vocab_size", f"must be positive, got {self.vocab_size}")
        need(self.pad_vocab_size_multiple >= 1, "pad_vocab_size_multiple", "must be >= 1")
        need(self.d_state > 0, "d_state", f"must be positive, got {self.d_state}")
        need(self.norm_eps > 0, "norm_eps", "must be positive")
        need(
            float(self.expand * self.d_model).is_integer() and self.d_inner > 0,
            "expand",
            f"expand * d_model must be a positive integer, got {self.expand} * {self.d_model}",
        )
        need(self.chunk_size >= 1, "chunk_size", "must be >= 1")
        arch = self.architecture
        if arch in ("mamba1", "mamba2"):
            need(self.d_conv >= 2, "d_conv", f"must be >= 2 for {arch}, got {self.d_conv}")
        if arch == "mamba1":
            need(self.resolved_dt_rank > 0, "dt_rank", "must be positive")
        if self.bcdt_rms_eps is not None:
            need(arch == "mamba1", "bcdt_rms_eps", f"the dt/B/C RMS norms are a Mamba-1 option, not {arch}'s")
            need(math.isfinite(self.bcdt_rms_eps) and self.bcdt_rms_eps > 0, "bcdt_rms_eps",
                 f"must be positive and finite, got {self.bcdt_rms_eps}")
        if self.bcdt_norm_weights is not None:
            need(self.bcdt_norm_weights and self.bcdt_rms_eps is not None, "bcdt_norm_weights",
                 "the dt/B/C norms' weights need the norms (bcdt_rms_eps); unset it rather than False")
        if arch == "mamba2":
            d_ssm = self.resolved_d_ssm
            need(0 < d_ssm <= self.d_inner, "d_ssm", f"must be in (0, d_inner={self.d_inner}]")
            need(self.headdim > 0 and d_ssm % self.headdim == 0, "headdim",
                 f"d_ssm={d_ssm} is not a multiple of headdim={self.headdim}")
            need(self.ngroups >= 1 and self.nheads % self.ngroups == 0, "ngroups",
                 f"nheads={self.nheads} is not a multiple of ngroups={self.ngroups}")
            need(d_ssm % self.ngroups == 0, "ngroups", "d_ssm must be a multiple of ngroups")
            need(self.dt_min_clamp >= 0, "dt_min_clamp", "must be >= 0")
            if self.dt_max_clamp is not None:
                need(self.dt_max_clamp > self.dt_min_clamp, "dt_max_clamp", "must exceed dt_min_clamp")
        self._check_hybrid(need)
        if arch == "mamba3":
            need(self.d_conv == 0, "d_conv", "Mamba-3 has no conv; d_conv must be 0")
            need(self.headdim > 0 and self.d_inner % self.headdim == 0, "headdim",
                 f"d_inner={self.d_inner} is not a multiple of headdim={self.headdim}")
            need(self.ngroups >= 1 and self.nheads % self.ngroups == 0, "ngroups",
                 f"nheads={self.nheads} is not a multiple of ngroups={self.ngroups}")
            need(self.rope_fraction in (0.5, 1.0), "rope_fraction",
                 f"must be 0.5 or 1.0, got {self.rope_fraction}")
            need(self.n_angles > 0, "rope_fraction", "d_state * rope_fraction gives no angle")
            need(self.A_floor > 0, "A_floor", "must be positive")
            need(self.mimo_rank >= 1, "mimo_rank", "must be >= 1")
            need(not self.bias, "bias", "Mamba-3 projections have no bias")
            if self.mimo_rank > 1:
                need(self.d_state % 2 == 0, "d_state", "MIMO rotary needs an even d_state")

    def _check_hybrid(self, need: Any) -> None:
        """The hybrid fields: consistent with each other and with the layers that read them."""
        arch = self.architecture
        if self.layer_types is not None:
            need(len(self.layer_types) == self.n_layer, "layer_types",
                 f"{len(self.layer_types)} layer kinds for n_layer={self.n_layer}")
            need(all(k in (arch, "attention", "mlp", "moe") or (k in ("parallel", "shared") and arch == "mamba2")
                     for k in self.layer_types), "layer_types",
                 f"a {arch} model's layers are {arch}, attention, mlp or moe: got {sorted(set(self.layer_types))}")
        if self.ffn_types is not None:
            need(len(self.ffn_types) == self.n_layer, "ffn_types",
                 f"{len(self.ffn_types)} ffn kinds for n_layer={self.n_layer}")
        has_attention = self.has_attention
        attention_fields = ("n_q_heads", "n_kv_heads", "attn_head_dim", "attention_bias", "position_embedding",
                            "attention_multiplier", "max_positions")
        for name in attention_fields:
            if has_attention:
                need(getattr(self, name) is not None, name, "required by the attention layers")
            else:
                need(getattr(self, name) is None, name, "set, but no layer is an attention layer")
        if has_attention:
            assert self.n_q_heads is not None and self.n_kv_heads is not None and self.attn_head_dim is not None
            assert self.max_positions is not None
            need(self.n_kv_heads > 0, "n_kv_heads", f"must be positive, got {self.n_kv_heads}")
            need(self.n_q_heads > 0 and self.n_q_heads % self.n_kv_heads == 0, "n_q_heads",
                 f"{self.n_q_heads} query heads cannot share {self.n_kv_heads} key/value heads")
            need(self.attn_head_dim > 0, "attn_head_dim", f"must be positive, got {self.attn_head_dim}")
            if self.rotary_dim is not None:
                need(self.position_embedding == "rope", "rotary_dim", "set, but position_embedding is not rope")
                need(0 < self.rotary_dim <= self.attn_head_dim and self.rotary_dim % 2 == 0, "rotary_dim",
                     f"must be even and in (0, attn_head_dim={self.attn_head_dim}], got {self.rotary_dim}")
            need(self.max_positions >= 1, "max_positions", f"must be >= 1, got {self.max_positions}")
            rope = self.position_embedding == "rope"
            need((self.rope_theta is not None) == rope, "rope_theta",
                 "set exactly when position_embedding is 'rope'")
            if rope:
                assert self.rope_theta is not None
                need(self.rope_theta > 1.0 and math.isfinite(self.rope_theta), "rope_theta",
                     f"must be finite and above 1, got {self.rope_theta}")
                need(self.attn_head_dim % 2 == 0, "attn_head_dim", "rope rotates pairs: must be even")
        else:
            need(self.rope_theta is None, "rope_theta", "set, but no layer is an attention layer")
            need(self.rotary_dim is None, "rotary_dim", "set, but no layer is an attention layer")
        self._check_ffn(need)
        self._check_parallel(need)
        self._check_shared(need)
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is not None:
                need(math.isfinite(value) and value != 0.0, name, f"must be finite and non-zero, got {value}")
        if self.is_hybrid:
            need(self.rms_norm, "rms_norm", "a hybrid's norms are RMS norms")

    def _check_ffn(self, need: Any) -> None:
        """The MLP and expert fields: set exactly when some layer reads them."""
        moe = "moe" in self.ffns or "moe" in self.kinds
        # the shared MLP beside the experts is the MLP unless it has its own size
        uses_mlp = "mlp" in self.kinds or "shared" in self.kinds or "mlp" in self.ffns or (
            moe and bool(self.moe_shared_mlp) and self.moe_shared_intermediate_size is None)
        need(uses_mlp or moe or self.mlp_intermediate_size is None, "mlp_intermediate_size",
             "set, but no layer has an MLP")
        if uses_mlp:
            need(self.mlp_intermediate_size is not None, "mlp_intermediate_size", "required by the MLP layers")
        if self.mlp_intermediate_size is not None:
            need(self.mlp_intermediate_size > 0, "mlp_intermediate_size",
                 f"must be positive, got {self.mlp_intermediate_size}")
        need((self.mlp_activation is not None) == (uses_mlp or moe), "mlp_activation",
             "set exactly when a layer has an MLP or experts")
        for name in ("mlp_gated", "mlp_bias"):
            need(uses_mlp or moe or getattr(self, name) is None, name, "set, but no layer has an MLP")
        moe_fields = ("moe_experts", "moe_top_k", "moe_intermediate_size", "moe_router", "moe_shared_mlp")
        for name in moe_fields:
            if moe:
                need(getattr(self, name) is not None, name, "required by the expert layers")
            else:
                need(getattr(self, name) is None, name, "set, but no layer has experts")
        if moe:
            assert self.moe_experts is not None and self.moe_top_k is not None
            assert self.moe_intermediate_size is not None
            need(self.moe_experts >= 1, "moe_experts", f"must be >= 1, got {self.moe_experts}")
            need(1 <= self.moe_top_k <= self.moe_experts, "moe_top_k",
                 f"must be in [1, moe_experts={self.moe_experts}], got {self.moe_top_k}")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size",
                 f"must be positive, got {self.moe_intermediate_size}")
        self._check_routing(need, moe)

    def _check_routing(self, need: Any, moe: bool) -> None:
        """The group-limited sigmoid rule's fields, the scaling, the shared MLP's size and the latent width."""
        grouped = moe and self.moe_router == "sigmoid_group_topk"
        for name in ("moe_groups", "moe_topk_groups", "moe_norm_topk"):
            if grouped:
                need(getattr(self, name) is not None, name, "required by the sigmoid_group_topk router")
            else:
                need(getattr(self, name) is None, name, "set, but no expert layer routes by sigmoid_group_topk")
        if grouped:
            assert self.moe_experts is not None and self.moe_top_k is not None
            assert self.moe_groups is not None and self.moe_topk_groups is not None
            groups, experts = self.moe_groups, self.moe_experts
            # a group is scored by the sum of its top 2: it needs two experts
            need(groups >= 1 and experts % groups == 0 and experts // groups >= 2, "moe_groups",
                 f"{experts} experts do not split into {groups} groups of at least 2")
            need(1 <= self.moe_topk_groups <= groups, "moe_topk_groups",
                 f"must be in [1, moe_groups={groups}], got {self.moe_topk_groups}")
            kept = self.moe_topk_groups * (experts // groups)
            need(self.moe_top_k <= kept, "moe_top_k",
                 f"{self.moe_top_k} experts per token, but the kept groups hold {kept}")
        for name in ("moe_scaling", "moe_shared_intermediate_size", "moe_latent_size"):
            need(moe or getattr(self, name) is None, name, "set, but no layer has experts")
        if self.moe_scaling is not None:
            need(math.isfinite(self.moe_scaling) and self.moe_scaling != 0.0, "moe_scaling",
                 f"must be finite and non-zero, got {self.moe_scaling}")
        if self.moe_shared_intermediate_size is not None:
            need(bool(self.moe_shared_mlp), "moe_shared_intermediate_size", "set, but moe_shared_mlp is not")
            need(self.moe_shared_intermediate_size > 0, "moe_shared_intermediate_size",
                 f"must be positive, got {self.moe_shared_intermediate_size}")
        if self.moe_latent_size is not None:
            need(self.moe_latent_size > 0, "moe_latent_size", f"must be positive, got {self.moe_latent_size}")

    def _check_shared(self, need: Any) -> None:
        """Zamba2's shared blocks: their fields set exactly when some layer is a "shared" one."""
        shared = "shared" in self.kinds
        for name in ("shared_blocks", "shared_adapter_rank", "shared_attention_adapter"):
            if shared:
                need(getattr(self, name) is not None, name, "required by the shared layers")
            else:
                need(getattr(self, name) is None, name, "set, but no layer is a shared layer")
        if shared:
            assert self.shared_blocks is not None and self.shared_adapter_rank is not None
            sites = self.kinds.count("shared")
            need(1 <= self.shared_blocks <= sites, "shared_blocks",
                 f"must be in [1, the {sites} shared layers], got {self.shared_blocks}")
            need(self.shared_adapter_rank >= 1, "shared_adapter_rank",
                 f"must be positive, got {self.shared_adapter_rank}")
            need(self.mlp_gated is not False, "mlp_gated", "the shared blocks' MLP is gated")

    def _check_parallel(self, need: Any) -> None:
        """Falcon-H1's multipliers: finite and non-zero, and set only where a layer reads them."""
        parallel = "parallel" in self.kinds
        scalars = ("ssm_in_multiplier", "ssm_out_multiplier", "attention_in_multiplier", "attention_out_multiplier",
                   "key_multiplier", "mlp_gate_multiplier", "mlp_down_multiplier", "logits_multiplier")
        for name in scalars:
            value = getattr(self, name)
            if value is not None:
                need(math.isfinite(value) and value != 0.0, name, f"must be finite and non-zero, got {value}")
        for name in scalars[:4]:
            need(parallel or getattr(self, name) is None, name, "set, but no layer is a parallel layer")
        if self.ssm_multipliers is not None:
            need(self.architecture == "mamba2", "ssm_multipliers", "the in_proj multipliers are a Mamba-2 option")
            need(all(math.isfinite(v) and v != 0.0 for v in self.ssm_multipliers), "ssm_multipliers",
                 f"must be finite and non-zero, got {self.ssm_multipliers}")
        need(self.has_attention or self.key_multiplier is None, "key_multiplier",
             "set, but no layer has attention")
        has_mlp = self.mlp_intermediate_size is not None or self.moe_experts is not None
        for name in ("mlp_gate_multiplier", "mlp_down_multiplier"):
            need(has_mlp or getattr(self, name) is None, name, "set, but no layer has an MLP")
        need(self.mlp_gate_multiplier is None or self.mlp_gated is not False, "mlp_gate_multiplier",
             "the MLP is not gated")
