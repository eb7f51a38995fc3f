"""The one-call decode steps (`_step`): a Mamba-1 or Mamba-2 layer's step in one kernel call gives
the primitives' bits (its twin: the primitives' path), a whole model's gives the forward pass's
loop's, and both reread weights that changed."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan import load_model
from mamba_stream.scan._backends import FixedBackend
from mamba_stream.scan._forward import forward
from mamba_stream.scan.exact import TWIN_PRIMITIVES, _primitives, _threading, twin_primitives
from mamba_stream.scan.exact._kernels import _kernel_ops
from mamba_stream.scan.exact._primitives import _KernelBackend
from mamba_stream.scan.exact._probe import _states_equal
from tests.scan._helpers import model_for
from tests.scan.exact._helpers import NEEDS_KERNELS

pytestmark = NEEDS_KERNELS


def _states(lm, batch: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn((batch, *shape), generator=g) * 0.5 for _, shape in blk.mixer.state_shapes())
            for blk in lm.backbone.layers]


@pytest.mark.parametrize("whole", ["model", "layers"])
@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float32/bfloat16", "float32/float16", "float32/q8"])
@pytest.mark.parametrize("preset", ["tiny-mamba1", "tiny-mamba2"])
def test_a_decode_step_in_one_kernel_call_gives_the_primitives_bits(monkeypatch, preset, dtype, threads, backend,
                                                                     whole):
    """`model_step_f32` (a whole model's decode step in one call) and, with it held off,
    `mamba1_step_f32` / `mamba2_step_f32` (a layer's in one call, the forward pass's loop around
    them) against the same step through the kernels' primitives and through the twins: logits and
    every layer's states, for one stream and for five, out of place and in place, on 1-3 threads,
    in every weight format. The one call must have run: once a step, or once a layer and step."""
    monkeypatch.setattr(_threading, "_THREADED_WORK", 0 if threads > 1 else 1 << 62)
    monkeypatch.setattr(_threading, "_THREADS", threads)
    lib = _kernel_ops(backend == "exact-fma").lib
    if whole == "layers":
        monkeypatch.setattr(_KernelBackend, "decode", lambda self, lm, hidden, states: None)
        name = "mamba1_step_f32" if preset == "tiny-mamba1" else "mamba2_step_f32"
    else:
        name = "model_step_f32"
    real, calls = getattr(lib, name), []
    monkeypatch.setattr(lib, name, lambda *a: (calls.append(1), real(*a))[1])
    fused = backend == "exact-fma"
    model = model_for(preset, backend, dtype)
    lm = model.module
    for batch in (1, 5):
        states = _states(lm, batch, 40 + batch)
        hidden = torch.randn((batch, 1, lm.cfg.d_model), generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            calls.clear()
            got, got_states, path = forward(lm, hidden, states, _KernelBackend(fused=fused))
            assert len(calls) == (lm.cfg.n_layer if whole == "layers" else 1) and path == "exact"
            plain, plain_states, _ = forward(lm, hidden, states,
                                             FixedBackend(_primitives._kernel_primitives(fused=fused)))
            twin, twin_states, _ = forward(lm, hidden, states, FixedBackend(twin_primitives(fused)))
            work = [tuple(t.clone() for t in st) for st in states]
            in_place, in_place_states, _ = forward(lm, hidden, work, _KernelBackend(in_place=True, fused=fused))
            other, _, _ = forward(lm, hidden, states, _KernelBackend(fused=not fused))
        assert torch.equal(got, plain) and torch.equal(got, twin) and torch.equal(in_place, got), (dtype, batch)
        assert not torch.equal(other, got)  # the one call computes the arithmetic it was asked for
        assert _states_equal(got_states, plain_states) and _states_equal(got_states, twin_states)
        assert _states_equal(in_place_states, got_states)
        assert all(a is b for st, st_w in zip(in_place_states, work, strict=True)
                   for a, b in zip(st, st_w, strict=True))  # written in place
        assert not _states_equal(got_states, states)  # and the step did move them


def test_a_copied_model_steps_on_its_own_weights():
    """A model copied after it stepped (the slot table's tests deepcopy one) carries no C pointer
    into the original: the copy's one-call step reads the copy's weights."""
    import copy

    model = load_model("tiny-mamba1", backend="exact")
    lm = model.module
    states = _states(lm, 1, 51)
    hidden = torch.randn((1, 1, lm.cfg.d_model), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        original, _, _ = forward(lm, hidden, states, _KernelBackend())
    twin = copy.deepcopy(lm)
    with torch.inference_mode():
        for blk in twin.backbone.layers:
            blk.mixer.in_proj.weight.mul_(2.0)
        changed, _, _ = forward(twin, hidden, states, _KernelBackend())
        want, _, _ = forward(twin, hidden, states, FixedBackend(TWIN_PRIMITIVES))
        again, _, _ = forward(lm, hidden, states, _KernelBackend())
    assert torch.equal(changed, want) and not torch.equal(changed, original) and torch.equal(again, original)


@pytest.mark.parametrize("how", ["written-in-place", "replaced"])
@pytest.mark.parametrize("preset", ["tiny-mamba1", "tiny-mamba2"])
def test_the_one_call_step_rereads_a_mixer_whose_weights_changed(preset, how):
    """The C description of a mixer (and of a model, for its whole step) is kept while its tensors
    are unchanged: a weight written in place (a fine-tune, a test) or a parameter replaced by
    another (`module.weight = ...`, which the step finds in the modules' dicts, not through
    nn.Module's attribute lookup) is seen by the next step, with the primitives' bits."""
    model = load_model(preset, backend="exact")
    lm = model.module
    states = _states(lm, 1, 50)
    hidden = torch.randn((1, 1, lm.cfg.d_model), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        before, _, _ = forward(lm, hidden, states, _KernelBackend())
    for blk in lm.backbone.layers:
        mixer = blk.mixer
        if how == "replaced":
            mixer.out_proj.weight = torch.nn.Parameter(mixer.out_proj.weight.detach() * 0.5)
            mixer.D = torch.nn.Parameter(mixer.D.detach() + 1.0)
            blk.norm.weight = torch.nn.Parameter(blk.norm.weight.detach() * 1.5)
        else:
            with torch.no_grad():
                mixer.out_proj.weight.mul_(0.5)
                mixer.D.add_(1.0)
                blk.norm.weight.mul_(1.5)
    if how == "replaced":  # and the model's own: the final norm's (the whole model's step reads it)
        lm.backbone.norm_f.weight = torch.nn.Parameter(lm.backbone.norm_f.weight.detach() * 0.75)
    else:
        with torch.no_grad():
            lm.backbone.norm_f.weight.mul_(0.75)
    with torch.inference_mode():
        after, _, _ = forward(lm, hidden, states, _KernelBackend())
        want, _, _ = forward(lm, hidden, states, FixedBackend(TWIN_PRIMITIVES))
    assert not torch.equal(after, before) and torch.equal(after, want)
