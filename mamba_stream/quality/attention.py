"""The attention baseline: a tiny causal transformer of the Mamba presets' width, with a KV cache.

It is trained on the same tasks by `quality.train --arch attention` so the quality table can put
its accuracy, and the cache it must keep, beside the constant-size Mamba state.

Dimension letters: B batch, L tokens, T cached positions, D d_model, H heads, E head dim (D / H),
F MLP width, V vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AttentionConfig", "KVCache", "TinyTransformer", "load_attention", "save_attention"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class AttentionConfig:
    d_model: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_mlp: int = 384
    vocab_size: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5


@dataclass
class KVCache:
    """Per layer: keys and values (B, H, T, E). `nbytes` is what a stream holds at position T."""

    keys: list[Tensor]
    values: list[Tensor]

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: Tensor, start: int, base: float) -> Tensor:
    """Rotate (B, H, L, E) by positions start..start+L-1 (pairs of halves)."""
    e = x.shape[-1]
    inv = base ** (-torch.arange(0, e // 2, dtype=torch.float32, device=x.device) / (e // 2))
    pos = torch.arange(start, start + x.shape[2], dtype=torch.float32, device=x.device)
    ang = pos[:, None] * inv[None, :]  # (L, E/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : e // 2], x[..., e // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class _Block(nn.Module):
    def __init__(self, cfg: AttentionConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.norm1 = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.Parameter(torch.ones(d))
        self.up = nn.Linear(d, cfg.d_mlp, bias=False)
        self.down = nn.Linear(cfg.d_mlp, d, bias=False)


class TinyTransformer(nn.Module):
    """Pre-norm decoder: RMSNorm, multi-head causal attention with rotary positions, GELU MLP;
    the output head is tied to the embedding."""

    def __init__(self, cfg: AttentionConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of n_head {cfg.n_head}")
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([_Block(cfg) for _ in range(cfg.n_layer)])
        self.norm_f = nn.Parameter(torch.ones(cfg.d_model))
        nn.init.normal_(self.embedding.weight, std=0.02)
        for blk in self.blocks:
            for lin in (blk.qkv, blk.proj, blk.up, blk.down):
                nn.init.normal_(lin.weight, std=0.02)
            blk.proj.weight.data /= (2 * cfg.n_layer) ** 0.5
            blk.down.weight.data /= (2 * cfg.n_layer) ** 0.5

    def forward(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        """Logits (B, L, V) for tokens (B, L); with a cache, continue after its T positions and
        append this chunk's keys and values to it."""
        cfg = self.cfg
        bsz, length = tokens.shape
        h, e = cfg.n_head, cfg.d_model // cfg.n_head
        start = cache.length if cache is not None else 0
        x = self.embedding(tokens)
        for i, blk in enumerate(self.blocks):
            q, k, v = blk.qkv(_rms(x, blk.norm1, cfg.norm_eps)).split(cfg.d_model, dim=-1)
            q, k, v = (t.view(bsz, length, h, e).transpose(1, 2) for t in (q, k, v))  # (B, H, L, E)
            q, k = _rope(q, start, cfg.rope_base), _rope(k, start, cfg.rope_base)
            if cache is not None:
                if len(cache.keys) > i:
                    k = torch.cat([cache.keys[i], k], dim=2)
                    v = torch.cat([cache.values[i], v], dim=2)
                    cache.keys[i], cache.values[i] = k, v
                else:
                    cache.keys.append(k)
                    cache.values.append(v)
            # causal within the chunk; every cached position is in the past
            mask = torch.ones(length, start + length, dtype=torch.bool, device=x.device).tril(start)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + blk.proj(att.transpose(1, 2).reshape(bsz, length, cfg.d_model))
            x = x + blk.down(F.gelu(blk.up(_rms(x, blk.norm2, cfg.norm_eps))))
        return F.linear(_rms(x, self.norm_f, cfg.norm_eps), self.embedding.weight)


def save_attention(model: TinyTransformer, directory: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(asdict(model.cfg), indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return out


def load_attention(directory: str | Path) -> TinyTransformer:
    from safetensors.torch import load_file

    d = Path(directory)
    cfg = AttentionConfig(**json.loads((d / "attention.json").read_text()))
    model = TinyTransformer(cfg)
    model.load_state_dict(load_file(str(d / "model.safetensors")))
    return model.eval()
