"""Model configuration shared by the three architectures.

One flat, frozen record; the model is built from it alone. Fields that only one architecture
reads are ignored by the others but still validated, so a config never means two things.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from mamba_stream.scan._errors import ConfigError

__all__ = ["ModelConfig"]

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

    # --- derived sizes -------------------------------------------------------------------

    @property
    def d_inner(self) -> int:
        return int(self.expand * self.d_model)

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return self.vocab_size + (-self.vocab_size) % m if m > 1 else self.vocab_size

    @property
    def resolved_dt_rank(self) -> int:
        return self.dt_rank if self.dt_rank is not None else math.ceil(self.d_model / 16)

    @property
    def resolved_d_ssm(self) -> int:
        return self.d_inner if self.d_ssm is None else self.d_ssm

    @property
    def nheads(self) -> int:
        if self.architecture == "mamba2":
            return self.resolved_d_ssm // self.headdim
        if self.architecture == "mamba3":
            return self.d_inner // self.headdim
        return 0

    @property
    def conv_dim(self) -> int:
        if self.architecture == "mamba1":
            return self.d_inner
        if self.architecture == "mamba2":
            return self.resolved_d_ssm + 2 * self.ngroups * self.d_state
        return 0

    @property
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
