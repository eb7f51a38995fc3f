"""The attention baseline: its KV cache continues a sequence exactly and grows with it."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.quality.attention import AttentionConfig, KVCache, TinyTransformer, load_attention, save_attention


def test_feeding_through_the_cache_equals_one_forward_and_the_cache_grows(tmp_path):
    torch.manual_seed(0)
    tf = TinyTransformer(AttentionConfig(d_model=64, n_layer=2, n_head=4, d_mlp=96)).eval()
    x = torch.randint(0, 256, (2, 41))
    with torch.no_grad():
        full = tf(x)
        cache = KVCache([], [])
        sizes = []
        parts = []
        for a, b in [(0, 9), (9, 10), (10, 30), (30, 41)]:
            parts.append(tf(x[:, a:b], cache))
            sizes.append(cache.nbytes)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=2e-5)
    # 2 (K, V) x layers x batch x positions x d_model x 4 bytes
    assert sizes == [2 * 2 * 2 * n * 64 * 4 for n in (9, 10, 30, 41)]
    save_attention(tf, tmp_path / "a")
    again = load_attention(tmp_path / "a")
    with torch.no_grad():
        assert torch.equal(again(x), full)


def test_a_width_that_does_not_split_into_heads_is_refused():
    with pytest.raises(ValueError):
        TinyTransformer(AttentionConfig(d_model=66, n_head=4))
