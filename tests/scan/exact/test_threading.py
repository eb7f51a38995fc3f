"""The threads (`_threading`): the C pool under many callers and across a fork, and torch's threads
off while the kernels run; none of it changes a bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mamba_stream.scan.exact import TWIN_OPS, _threading
from mamba_stream.scan.exact._kernels import _kernel_ops
from tests.scan.exact._helpers import _SPLIT_SHAPES, NEEDS_KERNELS, ROOT, _equal, _r, _weights_in_every_format

pytestmark = NEEDS_KERNELS


def test_products_called_from_many_threads_at_once_each_get_their_own_bits(monkeypatch):
    """Eight Python threads run products at once (the engine's and activities' threads): one at a
    time has the pool, the others run theirs on their own thread; every result has its bits."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(_threading, "_THREADED_WORK", 0)
    monkeypatch.setattr(_threading, "_THREADS", 2)
    g = torch.Generator().manual_seed(10)
    ops = _kernel_ops()
    cases = []
    for m, k, n in _SPLIT_SHAPES:
        x = _r(g, m, k, dtype=torch.float32)
        cases += [(x, w, TWIN_OPS.linear(x, w, None)) for w in _weights_in_every_format(g, n, k)]

    def run(i: int) -> bool:
        return all(_equal(ops.linear(x, w, None), want) for x, w, want in cases[i % 3 :] * 4)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(run, range(16)))


def test_a_forked_child_runs_threaded_products_without_the_parents_helpers():
    """The helper threads do not survive a fork: a child forked after the parent used the pool
    starts its own, and its products finish with the parent's bits (a child that waited on the
    parent's helpers would hang; the join's timeout fails the test instead)."""
    script = """
import os, sys, torch
from mamba_stream.scan.exact import _threading
from mamba_stream.scan.exact._kernels import _kernel_ops
from mamba_stream.scan._quant import quantize_q8
torch.set_num_threads(1)  # libgomp's own threads do not survive a fork either
_threading._THREADED_WORK, _threading._THREADS = 0, 2
ops = _kernel_ops()
g = torch.Generator().manual_seed(11)
x, w = torch.randn(2, 512, generator=g), torch.randn(300, 512, generator=g)
qw = quantize_q8(w)
want = [ops.linear(x, w, None), ops.linear(x, qw, None)]  # the parent's pool is running
r, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    ok = torch.equal(ops.linear(x, w, None), want[0]) and torch.equal(ops.linear(x, qw, None), want[1])
    os.write(wfd, b"1" if ok else b"0")
    os._exit(0)
os.close(wfd)
print(os.read(r, 1).decode())
os.waitpid(pid, 0)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the hung child too, not only its parent
        proc.communicate()
        pytest.fail("a forked child's threaded product did not finish in 120 s")
    assert proc.returncode == 0, err
    assert out.strip() == "1"


def test_a_forward_on_the_kernels_turns_torchs_threads_off_for_its_thread_only(monkeypatch):
    """While the exact backend runs (its kernels split work on their own pool), torch's OpenMP
    threads are off for the calling thread, so they do not spin beside the pool; a thread started
    meanwhile, and the caller afterwards, have torch's setting as it was."""
    import threading

    from mamba_stream.scan import ModelConfig, init_model

    if _threading._openmp() is None or torch.get_num_threads() < 2:
        pytest.skip("torch runs no OpenMP threads here")
    monkeypatch.setattr(_threading, "_THREADS", 2)
    model = init_model(ModelConfig.create(architecture="mamba2", d_model=64, n_layer=2, vocab_size=300,
                                          d_state=16, headdim=16), seed=0).with_backend("exact")
    ops = _kernel_ops()
    seen: list[int] = []
    other: list[int] = []
    real_lib = ops.lib

    class Lib:
        def __getattr__(self, name: str):
            return getattr(real_lib, name)

        def linear_threads(self, *a):
            seen.append(torch.get_num_threads())
            probe = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
            probe.start()
            probe.join()
            return real_lib.linear_threads(*a)

    monkeypatch.setattr(ops, "lib", Lib())
    n = torch.get_num_threads()
    tokens = list(range(1, 40))
    out = model.advance(model.initial_state(), tokens)
    assert seen and all(t == 1 for t in seen), seen
    assert other and all(t == n for t in other), other
    assert torch.get_num_threads() == n
    monkeypatch.setattr(ops, "lib", real_lib)
    again = model.advance(model.initial_state(), tokens)  # and the bits are the bits
    assert torch.equal(out.logits, again.logits)
