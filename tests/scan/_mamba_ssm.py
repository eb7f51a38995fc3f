"""mamba-ssm's own pure-PyTorch reference functions, made callable on a CPU-only machine.

mamba-ssm 2.3.2's package `__init__` imports a CUDA extension that a CPU install lacks, its
modules call Triton or CUDA kernels, and its Mamba-3 step reference sits in a module that needs
the CUTLASS DSL. This helper stubs the extension, rebinds each kernel name a module looks up to
mamba-ssm's own reference twin, and lifts the Mamba-3 step reference out of its file with `ast`,
so the comparisons run mamba-ssm's math and none of ours.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import math
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

REQUIRED = os.environ.get("MAMBA_STREAM_REQUIRE_CROSSCHECK") == "1"


def require(module: str) -> Any:
    """Import `module`, or skip (fail under `make test`, which installs every cross-check tool)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if REQUIRED:
            raise
        pytest.skip(f"{module} is not installed ({exc}); see DEVELOPERS.md")


def import_mamba_ssm() -> types.ModuleType:
    # transformers binds mamba-ssm's kernels when its modeling modules are first imported;
    # importing them while mamba-ssm is still unimportable makes them keep their own fallbacks.
    for mod in ("transformers.models.mamba.modeling_mamba", "transformers.models.mamba2.modeling_mamba2",
                "transformers.models.falcon_mamba.modeling_falcon_mamba"):
        with contextlib.suppress(ImportError):
            importlib.import_module(mod)
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    return require("mamba_ssm")


def _fused_step_ref() -> Any:
    """`selective_state_update_fused_ref_v2` from mamba_ssm/ops/cute/mamba3/mamba3_step_fn.py."""
    spec = importlib.util.find_spec("mamba_ssm")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "ops/cute/mamba3/mamba3_step_fn.py"
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body
              if isinstance(n, ast.FunctionDef) and n.name == "selective_state_update_fused_ref_v2")
    ns: dict[str, Any] = {"torch": torch, "F": F, "math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
    return ns[fn.name]


def ssd_minimal_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                     dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False, **_):
    """`mamba_chunk_scan_combined`'s contract, computed by mamba-ssm's `ssd_minimal_discrete`."""
    from mamba_ssm.modules.ssd_minimal import ssd_minimal_discrete

    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    _bsz, length, h, _p = x.shape
    g = B.shape[2]
    pad = (-length) % chunk_size
    xs, a = x * dt.unsqueeze(-1), A * dt
    b = B.repeat_interleave(h // g, dim=2)
    c = C.repeat_interleave(h // g, dim=2)
    if pad:
        xs, a, b, c = (F.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad)) for t in (xs, a, b, c))
    y, final = ssd_minimal_discrete(xs, a, b, c, chunk_size, initial_states=None if initial_states is None
                                    else initial_states.unsqueeze(1))
    y = y[:, :length]
    if D is not None:
        y = y + (D.unsqueeze(-1) if D.dim() == 1 else D) * x
    if z is not None:
        y = y * F.silu(z)
    return (y, final) if return_final_states else y


def patch_to_references(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """Point every kernel name mamba-ssm's modules call at mamba-ssm's reference twin."""
    import_mamba_ssm()
    from mamba_ssm.modules import mamba2, mamba3, mamba_simple
    from mamba_ssm.ops import selective_scan_interface as ssi
    from mamba_ssm.ops.triton import layer_norm, layernorm_gated
    from mamba_ssm.ops.triton import selective_state_update as ssu
    from mamba_ssm.ops.triton.mamba3 import mamba3_mimo_rotary_step as rot

    fused = _fused_step_ref()

    def step_fn(ssm_state, k_state, v_state, A, B, C, D, x, DT, trap, xpj, outproj=None, state_out=None,
                out=None, z=None, zproj=None, **_):
        y, new = fused(ssm_state, A, B, C, xpj, x, zproj, z, DT, k_state, v_state, trap, D, outproj)
        ssm_state.copy_(new)
        out.copy_(y)

    def rotary(q, k, angle_state, angle_proj, dt, bias_q=None, bias_k=None, conjugate=False, inplace=False,
               rotate_pairwise=True):
        return rot.apply_rotary_qk_inference_reference(q, k, angle_state, angle_proj, dt, bias_q, bias_k,
                                                       conjugate, rotate_pairwise)

    def gated_norm(self, x, z=None):
        return layernorm_gated.rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps,
                                            group_size=self.group_size, norm_before_gate=self.norm_before_gate)

    def rms_norm(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return layer_norm.rms_norm_ref(x, self.weight, self.bias, residual=residual, eps=self.eps,
                                       prenorm=prenorm, upcast=True)

    monkeypatch.setattr(mamba_simple, "selective_scan_fn", ssi.selective_scan_ref)
    monkeypatch.setattr(mamba_simple, "selective_state_update", ssu.selective_state_update_ref)
    monkeypatch.setattr(mamba2, "mamba_chunk_scan_combined", ssd_minimal_scan)
    monkeypatch.setattr(mamba2, "selective_state_update", ssu.selective_state_update_ref)
    monkeypatch.setattr(mamba3, "mamba3_step_fn", step_fn)
    monkeypatch.setattr(mamba3, "apply_rotary_qk_inference_fwd", rotary)
    # MIMO construction asserts its TileLang kernel imported; only the step path runs here.
    monkeypatch.setattr(mamba3, "mamba3_mimo_combined", object())
    monkeypatch.setattr(layernorm_gated.RMSNorm, "forward", gated_norm)
    monkeypatch.setattr(layer_norm.RMSNorm, "forward", rms_norm)
    return types.SimpleNamespace(mamba_simple=mamba_simple, mamba2=mamba2, mamba3=mamba3)
