"""Presets: small models built from a config and a fixed seed (no downloads).

The initialization follows mamba-ssm's (dt bias from a log-uniform dt, S4D-real or uniform A,
D = 1, out_proj scaled by 1/sqrt(n_layer)), so the untrained models still have the decay
spectrum of real ones and their outputs depend on history. It is computed by `scan._init` in
integer and IEEE float64 arithmetic, so a preset is the same bytes (the same `revision`) on every
CPU, instruction set and thread count; tests/scan/test_init.py pins each preset's revision.

Every preset, built or trained, renders conversations with the plain chat template
(`scan.PLAIN_CHAT_TEMPLATE`: `<|role|>`, a newline, the text, a newline; docs/chat-templates.md),
made for their byte vocabulary: `load_model` attaches it as `Model.chat_template`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._init import init_weights
from mamba_stream.scan._lm import MambaLM

__all__ = ["PRESETS", "TRAINED_PRESETS", "build_preset", "initial_weights", "trained_preset_dir"]

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


#: Trained presets: weights shipped in the package (mamba_stream/scan/presets/<name>/: config.json,
#: model.safetensors, card.json, card.md), trained by `python -m quality.train`. name ->
#: architecture. `recall-*` learned the tasks of `quality.tasks` and ship only past the quality bar
#: (held-out recall >= 90% at the shortest delay, tests/quality/test_presets.py); `kjv-mamba2`
#: learned English text (`--task text`, `quality.corpus`) and ships only while its greedy sample
#: reads as English (tests/quality/test_text_preset.py). `recall-hybrid` is three Mamba-2 layers
#: and one attention layer (`quality.train --arch hybrid`), saved in NemotronH's Hugging Face
#: layout; its architecture here is its Mamba layers'. New ones go last: the order seeds
#: bench/measure_drift.py's draws, which the declared tolerances were measured on.
TRAINED_PRESETS: dict[str, str] = {
    "recall-mamba1": "mamba1",
    "recall-mamba2": "mamba2",
    "recall-mamba3": "mamba3",
    "kjv-mamba2": "mamba2",
    "recall-hybrid": "mamba2",
}


def trained_preset_dir(name: str) -> Path:
    """Where a trained preset's files live (inside the installed package)."""
    return Path(__file__).resolve().parent / "presets" / name


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
