"""Presets: small models built from a config and a fixed seed (no downloads).

The initialization follows mamba-ssm's (dt bias from a log-uniform dt, S4D-real or uniform A,
D = 1, out_proj scaled by 1/sqrt(n_layer)), so the untrained models still have the decay
spectrum of real ones and their outputs depend on history.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scan._config import ModelConfig
from scan._lm import MambaLM
from scan._mamba1 import Mamba1Mixer
from scan._mamba2 import Mamba2Mixer
from scan._mamba3 import Mamba3Mixer

__all__ = ["PRESETS", "TRAINED_PRESETS", "build_preset", "init_weights", "initial_weights", "trained_preset_dir"]

_TINY = {"d_model": 64, "n_layer": 2, "vocab_size": 256}

#: name -> (config fields, seed)
PRESETS: dict[str, tuple[dict[str, Any], int]] = {
    "tiny-mamba1": ({"architecture": "mamba1", **_TINY, "d_state": 16, "d_conv": 4}, 1),
    "tiny-mamba2": (
        {"architecture": "mamba2", **_TINY, "d_state": 32, "d_conv": 4, "headdim": 16, "ngroups": 2,
         "chunk_size": 16},
        2,
    ),
    "tiny-mamba3": (
        {"architecture": "mamba3", **_TINY, "d_state": 32, "headdim": 16, "chunk_size": 16},
        3,
    ),
    "tiny-mamba3-mimo": (
        {"architecture": "mamba3", **_TINY, "d_state": 32, "headdim": 16, "chunk_size": 16,
         "mimo_rank": 2, "is_outproj_norm": True},
        4,
    ),
}


#: Trained presets: weights shipped in the package (scan/presets/<name>/: config.json,
#: model.safetensors, card.json), trained by `python -m quality.train` on the tasks of
#: `quality.tasks`. name -> architecture. Only presets that pass the quality bar (held-out
#: recall >= 90% at the shortest delay, tests/quality/test_presets.py) ship.
TRAINED_PRESETS: dict[str, str] = {
    "recall-mamba1": "mamba1",
    "recall-mamba2": "mamba2",
    "recall-mamba3": "mamba3",
}


def trained_preset_dir(name: str) -> Path:
    """Where a trained preset's files live (inside the installed package)."""
    return Path(__file__).resolve().parent / "presets" / name


def _inv_softplus_dt(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> torch.Tensor:
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


def init_weights(lm: MambaLM, seed: int, *, dt_max: float = 0.1) -> None:
    """Deterministic mamba-ssm-style initialization of every parameter, from `seed` alone.

    `dt_max` is the top of the log-uniform range of initial step sizes (mamba-ssm's 0.1 by
    default); it changes the values drawn, not how many.
    """
    cfg = lm.cfg
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        nn.init.normal_(lm.backbone.embedding.weight, std=0.02)
        if not cfg.tie_embeddings:
            nn.init.normal_(lm.lm_head.weight, std=0.02)
        for blk in lm.backbone.layers:
            m = blk.mixer
            for name, mod in m.named_children():
                if isinstance(mod, (nn.Linear, nn.Conv1d)):
                    mod.reset_parameters()
                    if isinstance(mod, nn.Linear) and mod.bias is not None and name != "dt_proj":
                        nn.init.zeros_(mod.bias)
            nn.init.kaiming_uniform_(m.out_proj.weight, a=math.sqrt(5))
            m.out_proj.weight /= math.sqrt(cfg.n_layer)
            if isinstance(m, Mamba1Mixer):
                std = cfg.resolved_dt_rank**-0.5
                nn.init.uniform_(m.dt_proj.weight, -std, std)
                m.dt_proj.bias.copy_(_inv_softplus_dt(cfg.d_inner, dt_max=dt_max))
                a = torch.arange(1, cfg.d_state + 1, dtype=torch.float32).repeat(cfg.d_inner, 1)
                m.A_log.copy_(torch.log(a))
                m.D.fill_(1.0)
            elif isinstance(m, Mamba2Mixer):
                m.dt_bias.copy_(_inv_softplus_dt(cfg.nheads, dt_max=dt_max))
                m.A_log.copy_(torch.log(torch.empty(cfg.nheads).uniform_(1.0, 16.0)))
                m.D.fill_(1.0)
            elif isinstance(m, Mamba3Mixer):
                m.dt_bias.copy_(_inv_softplus_dt(cfg.nheads, dt_max=dt_max))
                m.D.fill_(1.0)


def initial_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Float32 weights of a freshly initialized model (mamba-ssm names, tied head omitted)."""
    with torch.random.fork_rng(devices=[]):  # building must not move the caller's RNG
        lm = MambaLM(cfg)
    init_weights(lm, seed)
    sd = {k: v.detach().clone() for k, v in lm.state_dict().items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def build_preset(name: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and weights of a preset."""
    fields, seed = PRESETS[name]
    cfg = ModelConfig.create(**fields)
    return cfg, initial_weights(cfg, seed)
