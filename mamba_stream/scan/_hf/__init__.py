"""The Hugging Face hybrid architectures: each `model_type`'s config parser and tensor names.

An architecture maps its config.json onto `ModelConfig` fields (refusing, typed and named, every
field it cannot map: `ConfigError.field`) and its checkpoint's tensors onto our names (`scan._lm`),
splitting or joining where their layout differs from ours. `scan._loading` dispatches here by
`model_type`; Mamba-1/2 and FalconMamba, which share HF's Mamba layout, stay there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._hf._bamba import bamba_fields, bamba_tensors
from mamba_stream.scan._hf._common import is_inf
from mamba_stream.scan._hf._falcon_h1 import falcon_h1_fields, falcon_h1_tensors
from mamba_stream.scan._hf._granite import granite_fields, granite_tensors
from mamba_stream.scan._hf._jamba import jamba_fields, jamba_tensors
from mamba_stream.scan._hf._nemotron_h import nemotron_h_fields, nemotron_h_tensors
from mamba_stream.scan._hf._zamba2 import zamba2_fields, zamba2_tensors

__all__ = ["ARCHITECTURES", "HFArchitecture", "is_inf"]


@dataclass(frozen=True)
class HFArchitecture:
    """One `model_type`: `fields(config_json)` -> `ModelConfig.create` fields; `tensors(sd, cfg)`
    -> the checkpoint's tensors under our names (views where the layout allows)."""

    name: str
    fields: Callable[[dict[str, Any]], dict[str, Any]]
    tensors: Callable[[dict[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]


#: by config.json's `model_type`
ARCHITECTURES: dict[str, HFArchitecture] = {
    "bamba": HFArchitecture("Bamba", bamba_fields, bamba_tensors),
    "falcon_h1": HFArchitecture("FalconH1", falcon_h1_fields, falcon_h1_tensors),
    "granitemoehybrid": HFArchitecture("GraniteMoeHybrid", granite_fields, granite_tensors),
    "jamba": HFArchitecture("Jamba", jamba_fields, jamba_tensors),
    "nemotron_h": HFArchitecture("NemotronH", nemotron_h_fields, nemotron_h_tensors),
    "zamba2": HFArchitecture("Zamba2", zamba2_fields, zamba2_tensors),
}
