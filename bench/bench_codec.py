"""Checkpoint encode/decode throughput beside torch.save/torch.load and safetensors.

The state is shaped like a 130M-parameter Mamba-2 (24 layers, d_model 768, headdim 64,
d_state 128, d_conv 4: about 19 MB in float32), filled with random values. Ours does
sha256 + AES-256-GCM + framing (decode: authenticate, decrypt, checksum, view tensors); the
others only serialize. Median MB/s over interleaved rounds, all in one run.

    python bench/bench_codec.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from mamba_stream.scan import MambaLM, ModelConfig
from mamba_stream.scan._model import build_schema
from mamba_stream.state_codec import Receipt
from mamba_stream.state_codec.codec import (
    CODE_REVISION,
    Keyring,
    decode_checkpoint,
    encode_checkpoint,
    plaintext_checksum,
)


def _state_130m() -> tuple[dict[str, torch.Tensor], Receipt]:
    cfg = ModelConfig.create(architecture="mamba2", d_model=768, n_layer=24, vocab_size=50280, d_state=128,
                             headdim=64, d_conv=4)
    with torch.device("meta"):
        lm = MambaLM(cfg)
    schema = build_schema(cfg, torch.float32, lm)
    g = torch.Generator().manual_seed(0)
    tensors = {t.name: torch.randn(t.shape, generator=g) for t in schema.tensors}
    receipt = Receipt(
        stream_id="bench", principal="bench", model_id="mamba2-130m-shape", model_revision="sha256:" + "0" * 64,
        code_revision=CODE_REVISION, input_transform="bytes", input_transform_revision="utf-8/v1",
        schema_fingerprint=schema.fingerprint(), schema_version=schema.schema_version, architecture="mamba2",
        dtype="float32", n_layer=24, d_state=128, state_bytes=schema.state_bytes, position=1000, chunk_seq=10,
        epoch=0, state_key="bench.e0.c10", checksum=plaintext_checksum(tensors), backend="bench",
    )
    return tensors, receipt


def _hash_alone(tensors: dict[str, torch.Tensor], make: Callable[[], Any]) -> float:
    """Median seconds of one hash (`make()`, e.g. hashlib.sha256) over the state: the floor under
    any encode that must report that digest of the plaintext."""
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors.values()]
    times = []
    for _ in range(7):
        t = time.perf_counter()
        h = make()
        for v in views:
            h.update(v)
        h.digest()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    tensors, receipt = _state_130m()
    ring = Keyring.generate()
    mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6

    blob = encode_checkpoint(tensors, receipt, ring)
    buf = io.BytesIO()
    torch.save(tensors, buf)
    pickled = buf.getvalue()
    st_bytes = st_save(tensors)
    back = decode_checkpoint(blob, receipt, ring)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())

    def torch_save() -> object:
        b = io.BytesIO()
        torch.save(tensors, b)
        return b.getbuffer()

    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "ours (blake3 + AES-256-GCM + frame)": (
            lambda: encode_checkpoint(tensors, receipt, ring),
            lambda: decode_checkpoint(blob, receipt, ring),
        ),
        "ours, decode with rehash=True": (
            lambda: None,
            lambda: decode_checkpoint(blob, receipt, ring, rehash=True),
        ),
        "torch.save / torch.load": (torch_save, lambda: torch.load(io.BytesIO(pickled), weights_only=True)),
        "safetensors save / load": (lambda: st_save(tensors), lambda: st_load(st_bytes)),
    }
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in cases}
    for fn_enc, fn_dec in cases.values():  # warm-up
        fn_enc()
        fn_dec()
    for _ in range(args.rounds):
        for name, (fn_enc, fn_dec) in cases.items():
            for fn, bucket in ((fn_enc, times[name][0]), (fn_dec, times[name][1])):
                t = time.perf_counter()
                fn()
                bucket.append(time.perf_counter() - t)

    print(f"state shaped like Mamba-2 130M: 24 layers, {mb:.1f} MB float32; median of {args.rounds} "
          "interleaved rounds; CPU, MB/s = state MB / time")
    print(f"{'implementation':<38} {'encode MB/s':>12} {'decode MB/s':>12}")
    rates = {}
    for name, (enc, dec) in times.items():
        rates[name] = (mb / statistics.median(enc), mb / statistics.median(dec))
        enc_txt = "-" if name.endswith("rehash=True") else f"{rates[name][0]:,.0f}"
        print(f"{name:<38} {enc_txt:>12} {rates[name][1]:>12,.0f}")
    import hashlib

    import blake3

    for label, make in (("blake3", blake3.blake3), ("sha256", hashlib.sha256)):
        print(f"{f'({label} of the state alone)':<38} {mb / _hash_alone(tensors, make):>12,.0f} {'':>12}")
    ours = rates["ours (blake3 + AES-256-GCM + frame)"]
    others = [v for k, v in rates.items() if not k.startswith("ours")]
    best_enc, best_dec = max(v[0] for v in others), max(v[1] for v in others)
    st = rates["safetensors save / load"]
    print(f"ours vs safetensors: encode {ours[0] / st[0]:.2f}x (target >= 0.5x), decode {ours[1] / st[1]:.2f}x "
          f"(target >= 0.9x); vs fastest other: encode {ours[0] / best_enc:.2f}x, decode {ours[1] / best_dec:.2f}x; "
          f"blob {len(blob) / 1e6:.2f} MB vs safetensors {len(st_bytes) / 1e6:.2f} MB")
    print()
    _keyed_header(args.rounds, ring, tensors, receipt)


def _keyed_header(rounds: int, ring: Keyring, big: dict[str, torch.Tensor], big_receipt: Receipt) -> None:
    """What sealing a checkpoint's header (envelope v2: bound fields and schema under AES-GCM,
    padded to 256 bytes) costs per checkpoint, beside the clear header of v1: bytes, and the time
    of sealing and opening it against that of encoding and decoding the whole checkpoint."""
    import msgpack

    from mamba_stream.scan import load_model
    from mamba_stream.state_codec.codec import _open_head, _seal_head  # the header alone: nothing public does only that

    m = load_model("tiny-mamba2")
    st = m.advance(m.initial_state(), list(range(64))).state
    small = dict(st.tensors)
    small_receipt = big_receipt.model_copy(update={
        "schema_fingerprint": m.schema.fingerprint(), "state_bytes": m.schema.state_bytes,
        "checksum": plaintext_checksum(small), "n_layer": m.schema.n_layer, "d_state": 32})
    kid, key = ring.active_id, ring.key(ring.active_id)
    print("the keyed header (envelope v2) per checkpoint, beside the clear one of v1; median of "
          f"{rounds} rounds")
    print(f"{'state':<26} {'v1 header B':>12} {'v2 header B':>12} {'+B':>6} {'blob B':>12} "
          f"{'seal+open us':>13} {'encode+decode us':>17} {'share':>7}")
    for name, tensors, receipt, schema in (("tiny-mamba2", small, small_receipt, m.schema),
                                           ("Mamba-2 130M shape", big, big_receipt, None)):
        schema_json = schema.canonical_json() if schema is not None else ""
        bound = receipt.bound()
        clear = len(msgpack.packb("bound") + msgpack.packb(bound) + msgpack.packb("schema")
                    + msgpack.packb(schema_json))
        head = _seal_head(key, kid, bound, schema_json)
        keyed = len(msgpack.packb("head") + msgpack.packb(head))
        blob = encode_checkpoint(tensors, receipt, ring, schema=schema)
        heads, whole = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(100):
                _open_head(key, kid, _seal_head(key, kid, bound, schema_json))
            heads.append((time.perf_counter() - t) / 100)
            t = time.perf_counter()
            decode_checkpoint(encode_checkpoint(tensors, receipt, ring, schema=schema), receipt, ring)
            whole.append(time.perf_counter() - t)
        h, w = statistics.median(heads), statistics.median(whole)
        print(f"{name:<26} {clear:>12,} {keyed:>12,} {keyed - clear:>+6,} {len(blob):>12,} {h * 1e6:>13,.1f} "
              f"{w * 1e6:>17,.0f} {h / w:>7.2%}")


if __name__ == "__main__":
    main()
