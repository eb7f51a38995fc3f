"""A Mamba-1 or Mamba-2 layer's decode step (one token) in one kernel call, and a whole plain
Mamba-1 or Mamba-2 model's (`step_model`: every layer's, with the norms, the residual sums and the
head, as `scan._forward.forward`'s loop computes them; its twin is that loop).

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

import contextlib
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


class _ModelStep(ctypes.Structure):
    """`struct model_step` of _step.c: a plain Mamba-1 or Mamba-2 model's decode step."""

    _fields_ = [("n_layer", _I), ("kind", _I), ("d", _I), ("vocab", _I), ("layers", _P), ("norm_w", _P),
                ("normf_w", _P), ("eps", _D), ("head", _ExactWeight), ("threaded_work", _I), ("threads", _I)]


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

    def _weight(self, lin: Any, keep: list[Tensor]) -> _ExactWeight | None:
        w, bias = lin.weight, getattr(lin, "bias", None)
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

    # --- a whole model's decode step ------------------------------------------------------------

    @staticmethod
    def _model_tensors(lm: Any) -> list[Any] | None:
        """What a plain Mamba-1 or Mamba-2 model's decode step reads: every block's norm weight
        and its mixer's tensors (`_step_tensors`), norm_f's weight and the head's; None for any
        other model (a hybrid, multipliers, a LayerNorm or a norm bias, a block with an ffn)."""
        cfg = lm.cfg
        if (not cfg.rms_norm or cfg.architecture not in ("mamba1", "mamba2") or cfg.embedding_multiplier is not None
                or cfg.residual_multiplier is not None or cfg.logits_scaling is not None
                or cfg.logits_multiplier is not None):
            return None
        mixer_type = Mamba1Mixer if cfg.architecture == "mamba1" else Mamba2Mixer
        bb = lm.backbone
        out: list[Any] = []
        for blk in bb.layers:
            norm = blk.norm
            if (blk.kind != cfg.architecture or blk.mlp_norm is not None or type(blk.mixer) is not mixer_type
                    or _field(norm, "bias") is not None):
                return None
            out.append(_field(norm, "weight"))
            out += _Step._step_tensors(blk.mixer)
        if bb.norm_f.bias is not None:
            return None
        out += [bb.norm_f.weight, lm.lm_head.weight]
        return out

    def _model(self, lm: Any) -> tuple[_ModelStep, list[Any], list[_Mamba1Layer | _Mamba2Layer]] | None:
        """The C description of a model for its one-call decode step (None where it does not
        apply), kept beside the model (not on it: a copy of the module must not carry pointers
        into the original) while none of the tensors it reads changes; a model that cannot be
        weakly referenced (the probe's view of one) is described afresh each time."""
        tensors = self._model_tensors(lm)
        if tensors is None:
            return None
        versions = [_version(t) for t in tensors]
        try:
            hit = self._models.get(lm)
        except TypeError:
            hit = None
        if (hit is not None and None not in versions and hit[1] == versions
                and all(a is b for a, b in zip(hit[0], tensors, strict=True))):
            return hit[2]
        built = None
        layers = [self._layer(blk.mixer) for blk in lm.backbone.layers]
        keep: list[Any] = []
        head = self._weight(lm.lm_head, keep)
        norms = [blk.norm.weight for blk in lm.backbone.layers] + [lm.backbone.norm_f.weight]
        if (head is not None and layers and all(x is not None for x in layers)
                and all(w.dtype == torch.float32 and w.is_contiguous() for w in norms)):
            structs = [x[1] for x in layers]  # type: ignore[index]
            kind = 1 if layers[0][0] == "mamba1" else 2  # type: ignore[index]
            ptrs = (ctypes.c_void_p * len(structs))(*[ctypes.addressof(x) for x in structs])
            nws = (ctypes.c_void_p * (len(norms) - 1))(*[w.data_ptr() for w in norms[:-1]])
            cfg = lm.cfg
            desc = _ModelStep(len(structs), kind, cfg.d_model, head.n, ctypes.addressof(ptrs), ctypes.addressof(nws),
                              norms[-1].data_ptr(), cfg.norm_eps, head, 0, 1)
            # the pointer arrays and every tensor they point into live as long as the entry
            built = (desc, [ptrs, nws, *keep, *norms, *(x[2] for x in layers)], structs)  # type: ignore[index]
        with contextlib.suppress(TypeError):  # the probe's view: not kept
            self._models[lm] = (tensors, versions, built)
        return built

    def step_model(self, lm: Any, hidden: Tensor, layer_states: list[States], in_place: bool
                   ) -> tuple[Tensor, list[States]] | None:
        """`scan._forward.forward` of a plain Mamba-1 or Mamba-2 model over one token of B
        streams, hidden (B, 1, D) float32 embeddings -> logits (B, 1, V), in one kernel call
        (`model_step_f32`): the loop's bits. None where it does not apply (then the loop runs).
        `in_place`: the new states are written over `layer_states`."""
        if hidden.dtype != torch.float32 or hidden.shape[1] != 1:
            return None
        built = self._model(lm)
        if built is None:
            return None
        desc, _, structs = built
        flat = [t for st in layer_states for t in st]
        if len(flat) != 2 * len(structs) or not all(t.dtype == torch.float32 and t.is_contiguous() for t in flat):
            return None
        bsz = hidden.shape[0]
        work_t, threads = _threading._THREADED_WORK, _threading._THREADS
        for x in structs:
            x.threaded_work, x.threads = work_t, threads
        desc.threaded_work, desc.threads = work_t, threads
        new = flat if in_place else [torch.empty_like(t) for t in flat]
        n = len(structs)
        conv_in = (ctypes.c_void_p * n)(*[flat[2 * i].data_ptr() for i in range(n)])
        h_in = (ctypes.c_void_p * n)(*[flat[2 * i + 1].data_ptr() for i in range(n)])
        conv_out = conv_in if in_place else (ctypes.c_void_p * n)(*[new[2 * i].data_ptr() for i in range(n)])
        h_out = h_in if in_place else (ctypes.c_void_p * n)(*[new[2 * i + 1].data_ptr() for i in range(n)])
        ref = ctypes.addressof(desc)
        work = torch.empty(self.lib.model_step_work(ref, bsz), dtype=torch.float32)
        logits = torch.empty((bsz, 1, desc.vocab), dtype=torch.float32)
        u = hidden.contiguous()
        self.lib.model_step_f32(ref, u.data_ptr(), bsz, ctypes.addressof(conv_in), ctypes.addressof(conv_out),
                                ctypes.addressof(h_in), ctypes.addressof(h_out), logits.data_ptr(), work.data_ptr())
        return logits, [(new[2 * i], new[2 * i + 1]) for i in range(n)]
