"""Helpers shared by the hybrid architectures' tests: transformers' model run on its pure-PyTorch
path, the row-wise relative error, edited copies of a checkpoint, state equality, and the checks
every architecture passes (chunking and batching bit for bit, a bound against transformers, the
slot table's step, the bfloat16 and q8 weight formats, the typed refusal of a config field)."""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from mamba_stream.scan import Model, State, load_model
from mamba_stream.scan._errors import ConfigError
from tests.scan._helpers import scan_chunks

N_TOKENS = 96
CHUNKINGS = [[N_TOKENS], [1, 7, 30, 58], [1] * N_TOKENS]
BOUND = 1e-4  # row-wise max |diff| / max |logit| against transformers, float32

#: functions of transformers' Mamba-bearing modeling modules that dispatch to mamba-ssm or
#: causal-conv1d where those import: chosen once, when the module is first imported, so a test run
#: that imported mamba-ssm earlier (tests/scan/_mamba_ssm.py stubs its CUDA modules) would send the
#: truth to mamba-ssm's Triton kernels, which need CUDA
DISPATCHED = ("mamba2_chunk_scan", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined",
              "causal_conv1d_fn", "causal_conv1d_update", "mamba_chunk_scan_combined", "selective_state_update",
              "mamba_split_conv1d_scan_combined", "selective_scan_fn", "mamba_inner_fn")


@contextlib.contextmanager
def torch_path(*modules: ModuleType) -> Iterator[None]:
    """transformers' modeling `modules` on their pure-PyTorch path whatever else is installed: each
    dispatching function replaced by the torch function it wraps, called as its wrapper calls it
    (keyword arguments it does not take dropped)."""

    def plain(fn):
        torch_fn = inspect.unwrap(fn)
        params = set(inspect.signature(torch_fn).parameters)
        return lambda *a, **k: torch_fn(*a, **{n: v for n, v in k.items() if n in params})

    with pytest.MonkeyPatch.context() as mp:
        for mod in modules:
            for name in DISPATCHED:
                fn = getattr(mod, name, None)
                if fn is not None and callable(fn):
                    mp.setattr(mod, name, plain(fn))
        yield


def hf_logits(hf: torch.nn.Module, toks: Sequence[int]) -> torch.Tensor:
    """transformers' logits (L, V) of `toks`, float32, its model run on the pure-PyTorch path (of
    the modeling module its class comes from)."""
    with torch.no_grad(), torch_path(sys.modules[type(hf).__module__]):
        return hf(torch.tensor([list(toks)])).logits[0].float()


def saved_with_truth(hf: torch.nn.Module, d: Path, seed: int = 5
                     ) -> tuple[torch.nn.Module, Path, list[int], torch.Tensor]:
    """`hf` saved to `d` (`save_pretrained`), and (hf, d, N_TOKENS token ids drawn with `seed`,
    transformers' logits of them): a fixture's checkpoint."""
    hf.save_pretrained(str(d))
    toks = torch.randint(0, 256, (N_TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()
    return hf, d, toks, hf_logits(hf, toks)


def perturb(model: torch.nn.Module, suffixes: Sequence[str], scale: float = 0.3) -> None:
    """Add seeded noise to the parameters whose names end with `suffixes`: transformers initializes
    A_log, D, dt_bias and the norms to constants, where a mixed-up head, a skipped D or a norm's
    weight would not show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(tuple(suffixes)):
                p.copy_(p + scale * torch.randn_like(p))


def rel(got: torch.Tensor, truth: torch.Tensor) -> float:
    """max over rows of max |got - truth| / max |truth|: (L, V) logits against the truth."""
    return float(((got.float() - truth.float()).abs().amax(-1) / truth.float().abs().amax(-1)).max())


def rel_of(directory: Path, toks: list[int], truth: torch.Tensor, backend: str = "exact") -> float:
    """`rel` of the checkpoint in `directory`, loaded on `backend`, over `toks` in one advance."""
    model = load_model(directory, backend=backend)
    return rel(model.advance(model.initial_state(), toks).logits, truth)


def edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of the checkpoint with config.json fields changed (a value None: the field dropped)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def state_equal(a: State, b: State) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def assert_matches(model: Model, toks: list[int], truth: torch.Tensor, label: str,
                   chunkings: Sequence[Sequence[int]] = ([N_TOKENS], [1, 7, 30, 58])) -> None:
    """The model's logits under each chunking within BOUND of transformers' (printed for the log)."""
    for chunks in chunkings:
        logits, _ = scan_chunks(model, model.initial_state(), toks, list(chunks))
        r = rel(logits, truth)
        print(f"CROSSCHECK HF {label} vs ours ({model.backend}, chunks {list(chunks)[:4]}): max rel {r:.2e}")
        assert r <= BOUND, (label, model.backend, chunks, r)


def assert_exact_chunking(model: Model, toks: list[int]) -> list[tuple[torch.Tensor, State]]:
    """[96], [1, 7, 30, 58] and 96 x 1 give the same logits and every state tensor bit for bit.
    Returns the runs' (logits, final state), in CHUNKINGS' order."""
    runs = [scan_chunks(model, model.initial_state(), toks, chunks) for chunks in CHUNKINGS]
    for (logits, state), chunks in zip(runs[1:], CHUNKINGS[1:], strict=True):
        assert torch.equal(logits, runs[0][0]), chunks[:4]
        assert state_equal(state, runs[0][1]), chunks[:4]
    return runs


def assert_batching_keeps_bits(model: Model, toks: list[int]) -> tuple[State, State]:
    """Two streams at positions 5 and 40 advanced together (one forward) keep their own bits: each
    the logits and state of its own advance, and with logits="last" its last row. Returns their
    states after."""
    a = model.advance(model.initial_state(), toks[:5]).state
    b = model.advance(model.initial_state(), toks[:40]).state
    ra, rb = model.advance_batch([a, b], [toks[50:60], toks[60:70]])
    sa, sb = model.advance(a, toks[50:60]), model.advance(b, toks[60:70])
    assert torch.equal(ra.logits, sa.logits) and state_equal(ra.state, sa.state)
    assert torch.equal(rb.logits, sb.logits) and state_equal(rb.state, sb.state)
    # a prefill's last row only (logits="last"): that row's bits, the same states, batched or not
    la, lb = model.advance_batch([a, b], [toks[50:60], toks[60:70]], logits="last")
    assert torch.equal(la.logits, sa.logits[-1:]) and state_equal(la.state, sa.state)
    assert torch.equal(lb.logits, sb.logits[-1:]) and state_equal(lb.state, sb.state)
    return ra.state, rb.state


def assert_exact_chunking_and_batching(model: Model, toks: list[int]) -> State:
    """`assert_exact_chunking` and `assert_batching_keeps_bits`. Returns the final state."""
    runs = assert_exact_chunking(model, toks)
    assert_batching_keeps_bits(model, toks)
    return runs[0][1]


def slot_buffers(model: Model, states: Sequence[State]) -> dict[str, torch.Tensor]:
    """Slot-table buffers (K, *spec.shape) holding `states`: a growing tensor's (an attention
    layer's k, v) rows past a state's position zero, as the slot table keeps them."""
    out = {}
    for spec in model.schema.tensors:
        buf = torch.zeros((len(states), *spec.shape), dtype=model.state_dtype)
        for i, s in enumerate(states):
            t = s.tensors[spec.name]
            buf[i, : t.shape[0]] = t
        out[spec.name] = buf
    return out


def slot_row(model: Model, buffers: dict[str, torch.Tensor], row: int, position: int) -> dict[str, torch.Tensor]:
    """Row `row` of slot buffers as a State's tensors at `position` (a growing tensor's first rows)."""
    grows = {t.name for t in model.schema.tensors if t.rows == "position"}
    return {k: b[row, :position] if k in grows else b[row] for k, b in buffers.items()}


def assert_schema_round_trips(model: Model) -> None:
    """The schema's JSON reads back to the same schema, with the same fingerprint."""
    back = type(model.schema).model_validate_json(model.schema.model_dump_json())
    assert back == model.schema and back.fingerprint() == model.schema.fingerprint()


def assert_refused(d: Path, dst: Path, changes: dict, field: str, arch: str) -> None:
    """The checkpoint with config.json `changes` (`edited`) is refused at load: a ConfigError naming
    `field` and the architecture."""
    with pytest.raises(ConfigError) as err:
        load_model(edited(d, dst, **changes))
    assert err.value.field == field and arch in str(err.value)


def assert_step_rows_bits(model: Model, toks: list[int], in_place: bool) -> dict[str, torch.Tensor]:
    """`step_rows` on buffers of three streams at positions 3, 40 and 17 (rows 0, 2, 1: not a span,
    then rows 0, 1, 2: a span): each row the bits of its own `advance` by that token, its logits and
    every state tensor (a growing one's row written at its position). Returns the buffers (unstepped)."""
    states = [model.advance(model.initial_state(), toks[:n]).state for n in (3, 40, 17)]
    buffers = slot_buffers(model, states)
    for rows in ([0, 2, 1], [0, 1, 2]):
        b = {k: v.clone() for k, v in buffers.items()}
        positions = torch.tensor([states[r].position for r in rows])
        nxt = torch.tensor([toks[60 + r] for r in rows])
        logits, _ = model.step_rows(b, torch.tensor(rows), nxt, in_place=in_place, positions=positions)
        for i, r in enumerate(rows):
            want = model.advance(states[r], [toks[60 + r]])
            assert torch.equal(logits[i], want.logits[0]), r
            got = slot_row(model, b, r, want.state.position)
            for k, t in want.state.tensors.items():
                assert torch.equal(got[k], t), (r, k)
    return buffers


def save_bfloat16(make: Callable[[], torch.nn.Module], hf: torch.nn.Module, dst: Path) -> torch.nn.Module:
    """A fresh `make()` holding `hf`'s weights, cast to bfloat16 (in place) and saved to `dst`;
    returned (in bfloat16)."""
    rounded = make()
    rounded.load_state_dict(hf.state_dict())
    rounded.to(torch.bfloat16).save_pretrained(str(dst))
    return rounded


def load_bfloat16_as_stored(bf: Path, toks: list[int]):
    """The bfloat16 checkpoint `bf` loaded as stored (weight format "bfloat16") and widened to
    float32: the same logits and state bits. Returns (the model as stored, its `advance` of `toks`)."""
    kept = load_model(bf, backend="exact")
    wide = load_model(bf, backend="exact", weights="float32")
    assert kept.weight_format == "bfloat16"
    a, b = kept.advance(kept.initial_state(), toks), wide.advance(wide.initial_state(), toks)
    assert torch.equal(a.logits, b.logits) and state_equal(a.state, b.state)
    return kept, a


def assert_q8_chunks_exactly(d: Path, toks: list[int], truth: torch.Tensor, label: str, bound: float,
                             rounding: float | None = None) -> None:
    """q8 holds every matrix as block-int8 (the schema says so), still chunks exactly ([96] and
    [1, 7, 30, 58]: the same logits and state bits), and stays under `bound` of transformers'
    logits (`rounding`: transformers' own error with bfloat16-rounded weights, printed beside)."""
    q8 = load_model(d, backend="exact", weights="q8")
    assert q8.weight_format == "q8" and q8.schema.weights == "q8"
    runs = [scan_chunks(q8, q8.initial_state(), toks, chunks) for chunks in CHUNKINGS[:2]]
    assert torch.equal(runs[0][0], runs[1][0]) and state_equal(runs[0][1], runs[1][1])
    r = rel(runs[0][0], truth)
    beside = "" if rounding is None else f"; transformers' own with bfloat16-rounded weights: {rounding:.2e}"
    print(f"CROSSCHECK HF {label} vs ours (exact, q8 matrices): max rel {r:.2e}{beside}")
    assert r < bound


def save_tiny_granite(d: Path, max_positions: int = 96) -> Path:
    """A seeded tiny dense GraniteMoeHybrid saved by transformers into `d` (layers mamba, attention,
    mamba, attention; NoPE; multipliers not 1), its KV bounded at `max_positions`: at 96, KV
    segments of 16 rows (`scan.ModelConfig.kv_segment_rows`)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = GraniteMoeHybridConfig(
            vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=0,
            shared_intermediate_size=128, position_embedding_type="nope", mamba_n_heads=8, mamba_d_head=16,
            mamba_d_state=16, max_position_embeddings=max_positions, tie_word_embeddings=True,
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=4.0)
        GraniteMoeHybridForCausalLM(cfg).save_pretrained(str(d))
    return d


def seal_and_unseal(model: Model, state: State, principal: str = "alice") -> tuple[State, int]:
    """`state` sealed (its KV segments sealed into a dict, as a store would hold them) and unsealed
    again with every check; the state read back and how many segments it took."""
    from mamba_stream.state_codec.codec import Keyring, seal, seal_segment, segment_key, split_state, unseal

    ring = Keyring.generate()
    stored = {}
    segments = split_state(model.schema, state.tensors, state.position)[1]
    for seg in segments:
        key = segment_key(ring, ring.principal_tag(principal), model.schema.fingerprint(), seg.first, seg.digest)
        stored[key] = seal_segment(seg, key, ring)
    receipt, blob = seal(model, state, stream_id="s", principal=principal, chunk_seq=1, epoch=1, keyring=ring,
                         segments=segments)
    back = unseal(blob, receipt, ring, model=model, principal=principal, segments=lambda ref: stored.get(ref.key))
    return back, len(stored)
