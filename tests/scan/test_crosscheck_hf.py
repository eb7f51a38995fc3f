"""Hugging Face transformers checkpoints, saved with `save_pretrained`, loaded through `load_model`.

HF's full forward is the truth here; our chunked results must match it for every chunking, also
where HF's own cached continuation does not (transformers 5.24's Mamba-1 restarts the selective
scan at each chunk: its cached continuation is printed, not asserted, since a fix upstream is
welcome).
"""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan import load_model
from tests.scan._mamba_ssm import require

pytestmark = pytest.mark.crosscheck

ATOL = 2e-5  # largest difference seen here: 9e-7 (printed with `make crosscheck`)
CHUNKINGS = [[64], [1, 7, 13, 43], [32, 32], [3] * 21 + [1], [1] * 64]


def _hf_model(kind: str):
    require("transformers")
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "mamba":
            cfg = MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                              conv_kernel=4)
            return MambaForCausalLM(cfg).eval()
        cfg = Mamba2Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                           head_dim=16, num_heads=8, n_groups=2, conv_kernel=4, chunk_size=16)
        return Mamba2ForCausalLM(cfg).eval()


def _hf_cached(hf, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor | None:
    """HF's own chunked continuation through its cache, or None if this version's API differs."""
    try:
        from transformers import DynamicCache

        cache, pos, rows = DynamicCache(config=hf.config), 0, []
        for c in chunks:
            out = hf(ids[:, pos : pos + c], cache=cache, use_cache=True)
            cache = out.cache
            rows.append(out.logits[0])
            pos += c
        return torch.cat(rows)
    except Exception:  # noqa: BLE001 - informational only
        return None


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_hf_full_forward_equals_our_chunked_scan(tmp_path, kind):
    hf = _hf_model(kind)
    hf.save_pretrained(str(tmp_path))  # HF layout: config.json + model.safetensors
    ours = load_model(tmp_path, backend="reference")
    assert ours.config.architecture == {"mamba": "mamba1", "mamba2": "mamba2"}[kind]
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        truth = hf(ids).logits[0].float()
    toks = ids[0].tolist()
    for backend in ("reference", "chunked"):
        model = ours.with_backend(backend)
        for chunks in CHUNKINGS:
            s, rows, pos = model.initial_state(), [], 0
            for c in chunks:
                step = model.advance(s, toks[pos : pos + c])
                rows.append(step.logits)
                s, pos = step.state, pos + c
            diff = float((torch.cat(rows) - truth).abs().max())
            print(f"CROSSCHECK HF {kind} full forward vs ours ({backend}, chunks {chunks[:4]}...): {diff:.2e}")
            assert diff <= ATOL, f"{backend} {chunks}: {diff:.3e}"
    with torch.no_grad():
        theirs = _hf_cached(hf, ids, [1, 7, 13, 43])
    if theirs is not None:
        print(f"CROSSCHECK HF {kind} own cached continuation [1,7,13,43] vs its full forward: "
              f"{float((theirs - truth).abs().max()):.2e} (informational)")


def test_hf_checkpoint_revision_is_stable_and_layout_independent(tmp_path):
    hf = _hf_model("mamba2")
    hf.save_pretrained(str(tmp_path))
    a, b = load_model(tmp_path), load_model(tmp_path)
    assert a.revision == b.revision and a.revision.startswith("sha256:")
    # the same weights in float64 keep the revision (weights identity) but not the schema
    c = load_model(tmp_path, dtype=torch.float64)
    assert c.revision == a.revision
    assert c.schema.fingerprint() != a.schema.fingerprint()


def test_sharded_hf_checkpoint_loads_like_a_single_file(tmp_path):
    hf = _hf_model("mamba")
    hf.save_pretrained(str(tmp_path / "one"))
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    one, sharded = load_model(tmp_path / "one"), load_model(tmp_path / "sharded")
    assert one.revision == sharded.revision
    toks = list(range(30))
    assert torch.equal(one.advance(one.initial_state(), toks).logits,
                       sharded.advance(sharded.initial_state(), toks).logits)
