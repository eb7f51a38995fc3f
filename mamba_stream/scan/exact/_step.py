"""A Mamba-1 or Mamba-2 layer's decode step (one token) in one kernel call.

`mamba1_step_f32` / `mamba2_step_f32` of `_step.c` run the mixer's forward for one token of B
streams with the kernels above, in the order the primitives compute it: the same operations on
the same values, so the same bits. One call instead of about twelve: a decode step of a 130M
model spent half its time between kernels, in Python.

It has no twin of its own: its twin is the primitives' path through the mixer (`_primitives`),
which the tests (tests/scan/exact/test_step.py) and the load-time probe hold it to. A change to
a mixer's forward must be made in `_step.c` too, or the layout taken off the one call (`_layer`
returns None, and the primitives run), as a FalconMamba's is (a Mamba-1 with dt/B/C norms,
`bcdt_rms_eps`, which the one call does not compute; a Jamba's too, with learned weights), and a
Falcon-H1's Mamba-2 (its in_proj multipliers, `ssm_multipliers`; its parallel layer's input and
output multipliers are applied around the mixer, `scan._parallel`, so they never concern the
call). A hybrid's (GraniteMoeHybrid's) Mamba-2 layers are plain Mamba-2 mixers and take it; its attention layers
and MLP sublayers never reach it (the forward pass runs them on the primitives, `scan._forward`).

Separate because it is the one kernel that knows a mixer's layout (its modules, its config),
where the others know tensors only.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from mamba_stream.scan._mamba1 import Mamba1Mixer
from mamba_stream.scan._mamba2 import Mamba2Mixer
from mamba_stream.scan._mixer import States
from mamba_stream.scan._quant import Q8Weight
from mamba_stream.scan.exact import _threading
from mamba_stream.scan.exact._build import _D, _I, _P, _Library

Tensor = torch.Tensor

log = logging.getLogger(__name__)


class _ExactWeight(ctypes.Structure):
    """`struct exact_weight` of _step.c: a product's weight as held, and its bias."""

    _fields_ = [("format", _I), ("fused", _I), ("w", _P), ("q", _P), ("d", _P), ("d8", _P), ("bias", _P), ("n", _I),
                ("k", _I)]


class _Mamba1Layer(ctypes.Structure):
    """`struct mamba1_layer` of _step.c: what a Mamba-1 mixer's decode step reads."""

    _fields_ = [("in_proj", _ExactWeight), ("x_proj", _ExactWeight), ("dt_proj", _ExactWeight),
                ("out_proj", _ExactWeight), ("conv_taps", _P), ("conv_bias", _P), ("at", _P), ("dskip", _P),
                ("c", _I), ("n", _I), ("r", _I), ("w", _I), ("threaded_work", _I), ("threads", _I)]


class _Mamba2Layer(ctypes.Structure):
    """`struct mamba2_layer` of _step.c: what a Mamba-2 mixer's decode step reads."""

    _fields_ = [("in_proj", _ExactWeight), ("out_proj", _ExactWeight), ("conv_taps", _P), ("conv_bias", _P),
                ("dt_bias", _P), ("a", _P), ("dskip", _P), ("norm_w", _P), ("norm_eps", _D), ("e", _I), ("h", _I),
                ("p", _I), ("g", _I), ("n", _I), ("w", _I), ("d_per_channel", _I), ("norm_before_gate", _I),
                ("threaded_work", _I), ("threads", _I)]


_WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

#: the layouts already logged as decoding through the primitives (once per process each: a model
#: has one layout in every layer, and a worker loads it once)
_REFUSED_LOGGED: set[str] = set()


def _log_refused(layout: str) -> None:
    """Record that a layer of `layout` decodes through the primitives, not the one call."""
    if layout not in _REFUSED_LOGGED:
        _REFUSED_LOGGED.add(layout)
        log.info("exact decode step: %s takes the primitives' path, not the one-call step", layout)


def _version(t: Any) -> int | None:
    """A tensor's version counter; None for a value without one (an inference tensor, a
    `Q8Weight`), which is then never taken as unchanged."""
    try:
        return t._version if isinstance(t, Tensor) else (0 if t is None or isinstance(t, Q8Weight) else None)
    except RuntimeError:  # inference tensors count no versions
        return None


_ABSENT = object()


def _field(mod: torch.nn.Module, name: str) -> Any:
    """`getattr(mod, name)` for a parameter, buffer or plain attribute, by the dicts nn.Module
    keeps them in (it keeps a name in one of them only), without its `__getattr__`."""
    v = mod._parameters.get(name, _ABSENT)
    if v is _ABSENT:
        v = mod._buffers.get(name, _ABSENT)
        if v is _ABSENT:
            v = getattr(mod, name)
    return v


class _Step(_Library):
    """The kernel call `step`: a float32 Mamba-1 or Mamba-2 mixer's decode step in one call (A from
    `exp`, another part of `_kernels._Kernels`)."""

    def _weight(self, lin: torch.nn.Module, keep: list[Tensor]) -> _ExactWeight | None:
        w, bias = lin.weight, lin.bias
        if bias is not None and bias.dtype != torch.float32:
            return None
        if isinstance(w, Q8Weight):
            keep += [w.q, w.d, w.d8]
            out = _ExactWeight(3, int(self.fused), None, w.q.data_ptr(), w.d.data_ptr(), w.d8.data_ptr(), None,
                               w.shape[0], w.shape[1])
        else:
            if w.dtype not in _WEIGHT_CODES:
                return None
            if not w.is_contiguous():
                w = self._cached(w, "contiguous", w.contiguous)
            keep.append(w)
            out = _ExactWeight(_WEIGHT_CODES[w.dtype], int(self.fused), w.data_ptr(), None, None, None, None,
                               w.shape[0], w.shape[1])
        if bias is not None:
            keep.append(bias)
            out.bias = bias.data_ptr()
        return out

    @staticmethod
    def _step_tensors(m: Mamba1Mixer | Mamba2Mixer) -> list[Any]:
        """The tensors a mixer's decode step reads, as `m.in_proj.weight`... finds them, taken from
        the modules' dicts: checked before every decode step of every layer, where nn.Module's
        `__getattr__` cost a 130M model 0.8 ms a token."""
        mods = m._modules
        if isinstance(m, Mamba1Mixer):
            ip, cv, xp, dp, op = mods["in_proj"], mods["conv1d"], mods["x_proj"], mods["dt_proj"], mods["out_proj"]
            return [_field(ip, "weight"), _field(ip, "bias"), _field(cv, "weight"), _field(cv, "bias"),
                    _field(xp, "weight"), _field(dp, "weight"), _field(dp, "bias"), _field(m, "A_log"),
                    _field(m, "D"), _field(op, "weight"), _field(op, "bias")]
        ip, cv, op = mods["in_proj"], mods["conv1d"], mods["out_proj"]
        return [_field(ip, "weight"), _field(ip, "bias"), _field(cv, "weight"), _field(cv, "bias"),
                _field(m, "dt_bias"), _field(m, "A_log"), _field(m, "D"),
                _field(mods["norm"], "weight") if m.cfg.rmsnorm else None, _field(op, "weight"), _field(op, "bias")]

    def _layer(self, m: Mamba1Mixer | Mamba2Mixer) -> tuple[str, ctypes.Structure, list[Tensor]] | None:
        """The C description of a float32 Mamba-1 or Mamba-2 mixer for its one-call decode step
        (None: the mixer has a tensor or a layout the call does not take), kept on the mixer while
        none of its tensors changes."""
        tensors = self._step_tensors(m)
        versions = [_version(t) for t in tensors]
        hit = self._layers.get(m)
        # the entry holds the tensors it was made from: none of them can be freed and its id reused
        if (hit is not None and None not in versions
                and all(a is b for a, b in zip(hit[0], tensors, strict=False)) and hit[1] == versions):
            return hit[2]
        built = None
        linears = ([m.in_proj, m.x_proj, m.dt_proj, m.out_proj] if isinstance(m, Mamba1Mixer)
                   else [m.in_proj, m.out_proj])
        vectors = [t for t in tensors if isinstance(t, Tensor) and not any(t is lin.weight for lin in linears)]
        keep: list[Tensor] = []
        ws = [self._weight(lin, keep) for lin in linears]
        if all(t.dtype == torch.float32 for t in vectors) and all(w is not None for w in ws):
            cfg = m.cfg
            taps = self._cached(m.conv1d.weight, "taps", lambda: m.conv1d.weight.detach()[:, 0, :].contiguous())
            neg_a = -self.exp(m.A_log)  # what the mixer hands its scan
            dskip = m.D.detach().contiguous()
            conv_bias = None if m.conv1d.bias is None else m.conv1d.bias.data_ptr()
            keep += [taps, neg_a, dskip, *vectors]
            if isinstance(m, Mamba1Mixer) and cfg.bcdt_rms_eps is not None:
                # `mamba1_step_f32` has no dt/B/C norms (FalconMamba's, or Jamba's with weights):
                # the primitives run, which do; the one call would compute a plain Mamba-1, another
                # function
                _log_refused("a Mamba-1 with dt/B/C RMS norms (bcdt_rms_eps"
                             + (", weighted)" if cfg.bcdt_norm_weights else ")"))
            elif isinstance(m, Mamba2Mixer) and cfg.ssm_multipliers is not None:
                # `mamba2_step_f32` has no in_proj multipliers (Falcon-H1's mup_vector): the
                # primitives run, which do; the one call would compute a plain Mamba-2's function
                _log_refused("a Mamba-2 with in_proj multipliers (ssm_multipliers, Falcon-H1)")
            elif isinstance(m, Mamba1Mixer):
                at = neg_a.t().contiguous()
                keep.append(at)
                built = ("mamba1", _Mamba1Layer(*ws, taps.data_ptr(), conv_bias, at.data_ptr(), dskip.data_ptr(),
                                                cfg.d_inner, cfg.d_state, cfg.resolved_dt_rank, cfg.d_conv, 0, 1), keep)
            elif (cfg.rmsnorm and cfg.d_inner == cfg.resolved_d_ssm and cfg.dt_min_clamp == 0.0
                  and cfg.dt_max_clamp is None):
                built = ("mamba2", _Mamba2Layer(*ws, taps.data_ptr(), conv_bias, m.dt_bias.data_ptr(), neg_a.data_ptr(),
                                                dskip.data_ptr(), m.norm.weight.data_ptr(), cfg.mixer_norm_eps,
                                                cfg.resolved_d_ssm, cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state,
                                                cfg.d_conv, int(cfg.D_has_hdim), int(cfg.norm_before_gate), 0, 1),
                         keep)
        self._layers[m] = (tensors, versions, built)
        return built

    def step(self, m: Mamba1Mixer | Mamba2Mixer, u: Tensor, states: States, in_place: bool
             ) -> tuple[Tensor, States] | None:
        """`forward` of a Mamba-1 or Mamba-2 mixer over one token of B streams, u (B, 1, D)
        float32, in one kernel call (`mamba1_step_f32`, `mamba2_step_f32`): the primitives'
        bits. None where it does not apply (then the primitives run). `in_place`: the new states
        are written over `states`."""
        conv, ssm = states
        if u.dtype != torch.float32 or conv.dtype != torch.float32 or ssm.dtype != torch.float32:
            return None
        built = self._layer(m)
        if built is None:
            return None
        kind, layer, _ = built
        bsz = u.shape[0]
        u = u.contiguous()
        if in_place and conv.is_contiguous() and ssm.is_contiguous():
            new_conv, new_ssm = conv, ssm
        else:
            conv, ssm = conv.contiguous(), ssm.contiguous()
            new_conv, new_ssm = torch.empty_like(conv), torch.empty_like(ssm)
        layer.threaded_work, layer.threads = _threading._THREADED_WORK, _threading._THREADS
        ref = ctypes.addressof(layer)
        work = torch.empty(getattr(self.lib, f"{kind}_step_work")(ref, bsz), dtype=torch.float32)
        out = torch.empty((bsz, 1, layer.out_proj.n), dtype=torch.float32)
        getattr(self.lib, f"{kind}_step_f32")(ref, u.data_ptr(), bsz, conv.data_ptr(), new_conv.data_ptr(),
                                              ssm.data_ptr(), new_ssm.data_ptr(), out.data_ptr(), work.data_ptr())
        if in_place and new_conv is not states[0]:
            states[0].copy_(new_conv)
            states[1].copy_(new_ssm)
            new_conv, new_ssm = states
        return out, (new_conv, new_ssm)
