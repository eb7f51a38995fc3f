"""A hybrid's KV by position: the bytes a checkpoint writes (KV segments against the whole KV),
and what a decode step costs at that context.

A stream of a Granite-4.0-H-Micro-shaped model (bench/make_checkpoint.py's `granite-micro`: 36
Mamba-2 layers of 64 heads x 64 x 128, 4 attention layers of 8 KV heads of 64; 75.5 MB of Mamba
states, 16 KB of KV a position in float32) is committed through the workers' commit protocol
(`ChunkCommit`, a file store in a temporary directory, the exact backend's path) at positions 1k,
8k and 32k: first the state at the position (its segments written), then `--chunks` chunks of
`--chunk` tokens after it, each a commit continuing the one before. The weights are zeros (a
sparse file: what is measured is the state's bytes, not the model's arithmetic), the states random
values of the schema's shapes.

Printed per position, medians over the chunks: the bytes a chunk's commit wrote (its checkpoint:
the Mamba states, the KV's tail of at most R - 1 rows plus the chunk's, the segments' digests; and
the segments that became full), the commit's wall time, and what a checkpoint holding the whole KV
would be (the Mamba states and every row: what the commit wrote before segments). Target (issue 45
item 4): the bytes per checkpoint flat in the position.

Then, per position, a decode step from a state at it (a random state: a step's cost depends on the
shapes and the weight format, not on the values; no prefill of 32k tokens): the median of
`--steps` 1-token steps through `Model.advance` (a stream's one-token chunk: the state's P KV rows
read and its next state's P + 1 written) and through `Model.step_rows` (the slot table's decode
step: the rows in the slot's buffers, each token's row written in place). The weights are zeros in
the checkpoint's own format (bfloat16): a step reads them as it would random ones.

    python bench/bench_segments.py [--positions 1024,8192,32768] [--chunk 16] [--chunks 8] [--steps 5] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.make_checkpoint import hf_config, layout
from mamba_stream.activities import open_store, tune_allocator
from mamba_stream.activities._commit import ChunkCommit
from mamba_stream.scan import State, load_model
from mamba_stream.state_codec.codec import Keyring, segment_rows

log = logging.getLogger("bench_segments")


def zero_checkpoint(shape: str, out: Path, tiny: bool) -> Path:
    """config.json and a model.safetensors of zeros (sparse: no disk, no time) in `out`."""
    cfg_json = hf_config(shape, tiny)
    out.mkdir(parents=True, exist_ok=True)
    header: dict = {"__metadata__": {"format": "pt", "made_by": "bench/bench_segments.py"}}
    offset = 0
    for name, (shp, _) in sorted(layout(cfg_json, "bfloat16").items()):
        nbytes = math.prod(shp) * 2
        header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with (out / "model.safetensors").open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + offset)
    (out / "config.json").write_text(json.dumps(cfg_json))
    return out


def _random_state(model, position: int, g: torch.Generator, like: State | None = None) -> State:
    """A state at `position`: random Mamba states; the KV rows of `like` (the state continued)
    then random rows up to `position`."""
    tensors = {}
    for spec in model.schema.tensors:
        dtype = getattr(torch, spec.dtype)
        shape = spec.shape_at(position)
        if spec.rows == "position" and like is not None:
            old = like.tensors[spec.name]
            new = torch.randn((position - old.shape[0], *shape[1:]), generator=g).to(dtype)
            tensors[spec.name] = torch.cat([old, new])
        else:
            tensors[spec.name] = torch.randn(shape, generator=g).to(dtype)
    return model.restore_state(position, tensors)


def measure(model, position: int, chunk: int, chunks: int, root: Path) -> dict:
    store = open_store(f"file://{root / f'store-{position}'}")
    commits = ChunkCommit(store, Keyring.generate())
    g = torch.Generator().manual_seed(position)
    state = _random_state(model, position, g)
    key = commits.state_key("bench", 0, 0, "open|bench")
    done = commits.commit(model, state, stream_id="bench", principal="bench", chunk_seq=0, epoch=0, key=key,
                          backend="exact", before=None)
    wrote, checkpoint, seconds = [], [], []
    for seq in range(1, chunks + 1):
        before = done.receipt
        nxt = _random_state(model, before.position + chunk, g, like=done.state)
        key = commits.chunk_key("bench", before, seq, f"chunk {seq}")
        used = store.usage().bytes
        t0 = time.perf_counter()
        done = commits.commit(model, nxt, stream_id="bench", principal="bench", chunk_seq=seq, epoch=0, key=key,
                              backend="exact", before=before)
        seconds.append(time.perf_counter() - t0)
        wrote.append(store.usage().bytes - used)
        checkpoint.append(len(store.get(key=key, owner=commits.owner("bench"))))
    whole = model.schema.bytes_at(position + chunk)
    return {"position": position, "checkpoint": statistics.median(checkpoint), "wrote": statistics.median(wrote),
            "max_wrote": max(wrote), "whole": whole, "ms": 1e3 * statistics.median(seconds)}


def decode(model, position: int, steps: int) -> dict:
    """Median seconds of a 1-token step at `position`: `advance` and the slot table's `step_rows`."""
    g = torch.Generator().manual_seed(position + 1)
    state = _random_state(model, position, g)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        model.advance(state, [1 + i])
        times.append(time.perf_counter() - t0)
    advance = statistics.median(times[1:])
    buffers = {}
    for spec in model.schema.tensors:
        buf = torch.zeros((1, *spec.shape), dtype=getattr(torch, spec.dtype))
        src = state.tensors[spec.name]
        buf[0, : src.shape[0]].copy_(src)  # a KV tensor's first P rows; a Mamba state whole
        buffers[spec.name] = buf
    rows = torch.tensor([0])
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        model.step_rows(buffers, rows, torch.tensor([1 + i]), in_place=True, positions=torch.tensor([position + i]))
        times.append(time.perf_counter() - t0)
    return {"advance": advance, "step_rows": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", default="1024,8192,32768")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="decode steps timed per position (after one untimed)")
    ap.add_argument("--tiny", action="store_true", help="granite-micro's layout at hidden 64 (a quick check)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    tune_allocator()  # as a worker's engine does: state-sized temporaries reused, not faulted in afresh
    positions = [int(p) for p in args.positions.split(",")]
    bound = max(positions) + max(args.chunk * (args.chunks + 1), args.steps + 2)
    with tempfile.TemporaryDirectory(prefix="bench-segments-") as tmp:
        root = Path(tmp)
        model = load_model(zero_checkpoint("granite-micro", root / "ckpt", args.tiny), backend="exact",
                           max_positions=min(bound, hf_config("granite-micro", args.tiny)["max_position_embeddings"]))
        rows = segment_rows(model.schema)
        mamba = sum(t.nbytes for t in model.schema.tensors if t.rows is None)
        kv_row = sum(t.nbytes // t.shape[0] for t in model.schema.tensors if t.rows == "position")
        name = "granite-micro" + (" (tiny)" if args.tiny else "")
        print(f"{name}: Mamba states {mamba / 1e6:.1f} MB, KV {kv_row / 1e3:.1f} KB a position, segments of "
              f"R = {rows} rows ({rows * kv_row / 1e6:.2f} MB); chunks of {args.chunk} tokens, medians over "
              f"{args.chunks}")
        print()
        print("| position | checkpoint MB | written per chunk MB (max) | whole-KV checkpoint MB | ratio | commit ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        for p in positions:
            r = measure(model, p, args.chunk, args.chunks, root)
            print(f"| {p:,} | {r['checkpoint'] / 1e6:.2f} | {r['wrote'] / 1e6:.2f} ({r['max_wrote'] / 1e6:.2f}) | "
                  f"{r['whole'] / 1e6:.2f} | {r['whole'] / r['wrote']:.1f}x | {r['ms']:.0f} |")
        print()
        print(f"decode at a context ({torch.get_num_threads()} threads, {model.arithmetic().id}), medians of "
              f"{args.steps} steps")
        print()
        print("| context | advance ms/token | step_rows ms/token | step_rows tok/s |")
        print("|---:|---:|---:|---:|")
        for p in positions:
            d = decode(model, p, args.steps)
            print(f"| {p:,} | {1e3 * d['advance']:.0f} | {1e3 * d['step_rows']:.0f} | {1 / d['step_rows']:.2f} |")


if __name__ == "__main__":
    main()
