"""The benchmark and measurement scripts: argument parsing, and a small run on CPU."""

from __future__ import annotations

import pytest

from tests.bench._load import load_bench


def test_kernel_matrix_arguments_and_a_cpu_smoke_run(tmp_path):
    mod = load_bench("bench_kernels")
    args = mod.parse_args(["--quick", "--device", "cpu", "--archs", "mamba2", "--out", str(tmp_path / "k.md")])
    assert args.lengths == [1, 4, 16, 64] and args.batches == [1, 4]
    for bad in (["--lengths", "0,2"], ["--batches", "x"], ["--dtypes", "float8"], ["--archs", "rwkv"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
    text = mod.run(args)
    assert "## Prefill" in text and "## Decode" in text and "## Crossover" in text
    assert "| mamba2 | float32 | 16 | 64 |" in text and "error" not in text


def test_drift_measurement_arguments_and_a_cpu_run(tmp_path):
    mod = load_bench("measure_drift")
    with pytest.raises(SystemExit):
        mod.parse_args(["--dtypes", "float8"])
    with pytest.raises(SystemExit):
        mod.parse_args(["--tokens", "1"])
    args = mod.parse_args(["--tokens", "40", "--presets", "tiny-mamba2", "--backends", "reference,chunked",
                           "--dtypes", "float32", "--device", "cpu"])
    text = mod.run(args)
    rows = [line for line in text.splitlines() if line.startswith("| tiny-mamba2 |")]
    assert len(rows) == 2 and all("| ok |" in r for r in rows)
    assert "## tiny-mamba2, chunked, float32" in text


def test_serving_tables_on_a_small_cpu_run(tmp_path):
    mod = load_bench("bench_serving")
    a = mod.table_a(3, tmp_path)
    turns = [line for line in a if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in turns] == [1, 2, 3]
    new = [int(r.split("|")[2]) for r in turns]
    history = [int(r.split("|")[3]) for r in turns]
    assert history == [sum(new[: i + 1]) for i in range(3)]  # HF re-feeds all of it; we feed only `new`
    assert any(line.startswith("least-squares slope") for line in a)

    import asyncio

    b = asyncio.run(mod._throughput([1, 2], 2, 4, tmp_path))
    rows = [line.split("|") for line in b if line.startswith("| ") and line[2].isdigit()]
    assert [int(r[1]) for r in rows] == [1, 2]
    assert all(float(r[5].replace(",", "")) > 0 for r in rows)  # decode tokens/s
    assert 1.0 <= float(rows[1][9]) <= 2.0  # batch occupancy at 2 streams
    eng = [[c.strip() for c in line.split("|")] for line in mod.table_b_engine([1, 2], 4, tmp_path)
           if line.startswith("| ") and line.split("|")[3].strip().isdigit()]
    assert [(r[1], r[2], int(r[3])) for r in eng] == [
        (backend, sampling, n) for backend in ("exact", "chunked") for sampling in ("batched", "per row")
        for n in (1, 2)]
    assert all(0 < float(r[7]) <= float(r[6]) for r in eng)  # the batched step is part of the round

    c = mod.table_c(6_000)
    rows = [line.split("|") for line in c if line.startswith("| ") and line[2].isdigit()]
    assert [r[1].strip() for r in rows] == ["4,096", "8,192"]  # whole chunks
    assert len({r[2] for r in rows}) == 1  # state bytes do not depend on position
    kv = [float(r[7].replace(",", "")) for r in rows]
    assert kv[1] > kv[0]


def test_temporal_latency_table_on_a_small_run():
    mod = load_bench("bench_temporal")
    with pytest.raises(SystemExit):
        mod.parse_args(["--sizes", "0"])
    text = mod.run(mod.parse_args(["--n", "2", "--warmup", "1", "--sizes", "1", "--generate", "4"]))
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| row")]
    names = [r.split("|")[1].strip() for r in rows]
    assert names[:2] == ["no-op update round trip", "no-op update + no-op local activity"]
    assert "advance, 1-token chunk: local activity" in names and "advance, 1-token chunk: worker queue" in names
    assert "generate 4, streamed: first token at the caller" in names
    for r in rows:  # both server settings measured, every cell a number
        cells = [c.strip() for c in r.split("|")[2:6]]
        assert all(float(c) > 0 for c in cells), r
    assert "1-token advance, local:" in text and "generate 4, first token:" in text


def test_readers_table_on_a_small_run():
    mod = load_bench("bench_readers")
    with pytest.raises(SystemExit):
        mod.parse_args(["--tokens", "0"])
    text = mod.run(mod.parse_args(["--tokens", "8", "--readers", "0,2", "--idle", "0.3"]))
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| readers")]
    assert [r[0] for r in rows] == ["0", "2"]
    assert float(rows[1][1]) > 0 and float(rows[1][3]) >= 0 and float(rows[1][4]) > 0  # the readers read the log
    assert rows[0][-1] == rows[1][-1]  # the same history events over the generate, readers or not



def test_agent_turn_table_on_a_small_run():
    mod = load_bench("bench_agent")
    with pytest.raises(SystemExit):
        mod.parse_args(["--feed", "0"])
    text = mod.run(mod.parse_args(["--n", "2", "--warmup", "1", "--feed", "4", "--generate", "2"]))
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| path")]
    assert [r[0] for r in rows] == list(mod.ROWS)
    assert all(float(c.rstrip("x")) > 0 for r in rows for c in r[1:])
    assert "in-workflow / child path:" in text and "in-workflow / stream workflow's own" in text


def test_prefix_states_table_on_a_small_run():
    mod = load_bench("prefix_states")
    for bad in (["--agents", "1"], ["--prefix-tokens", "0"], ["--modes", "both"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
    agents, prefix = 3, 40
    text = mod.run(mod.parse_args(["--model", "tiny-mamba2", "--agents", str(agents), "--prefix-tokens", str(prefix),
                                   "--gen-tokens", "3", "--solo", "1", "--noop-n", "3", "--steps", "2"]))
    rows = {r[0]: r for r in ([c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
                              if line.startswith("| prefix states"))
            if len(r) > 10}  # the first table (the second has 6 columns)
    on, off = rows[mod.MODE_NAMES["on"]], rows[mod.MODE_NAMES["off"]]

    def tokens(r: list[str]) -> int:  # prefill tokens through the model
        return int(r[8].replace(",", ""))

    assert tokens(on) == prefix  # computed once, for agent 1; the others loaded it
    assert tokens(off) == agents * prefix  # computed for every agent
    assert on[10] == f"{prefix} / {(agents - 1) * prefix}" and on[11] == f"{agents - 1} / 1"  # the library's counts
    assert on[12] == off[12] == str(agents)  # one attempt per open
    assert on[13].startswith(f"{2 * agents} (") and off[13].startswith(f"{2 * agents} (")  # open + generate each
    assert on[14].startswith(tuple("123456789")) and on[14].endswith("(1 entry)")  # one entry, its bytes
    assert off[14] == "0 (0 entries)"
    assert all(float(c) > 0 for r in (on, off) for c in r[1:4])  # TTFTs
    # agent 1 computed; 2..3 and the solo one loaded
    assert f"(0, -) 1 agents, ({prefix}, principal) {agents} agents" in text
    assert "generated the same 3 tokens: yes" in text


def test_conversation_table_on_a_small_run():
    """Two turns of each conversation: ours feeds the second turn only its new items, stateless
    the whole conversation again; every turn calls the tool (the forced call held to its schema)."""
    mod = load_bench("bench_conversations")
    for bad in (["--turns", "0"], ["--max-tokens", "32"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
    text = mod.run(mod.parse_args(["--turns", "2", "--model", "tiny-mamba2", "--max-tokens", "96"]))
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    first, second = ([c.strip() for c in rows[t].split("|")[2:4]] for t in ("1", "2"))
    assert first[0] == first[1] and int(second[1]) > 2 * int(second[0]) > 0  # tokens fed: ours, stateless
    for mode in ("ours", "stateless"):
        cells = [c.strip() for c in rows[mode].split("|")]
        assert cells[-3:-1] == ["4", "2"], rows[mode]  # model calls, tool calls


def test_the_size_tables_child_measures_a_small_checkpoint_with_the_engines_batch(tmp_path):
    """bench_sizes' row on a tiny checkpoint: prefill (the last row's logits), decode, and decode
    through the engine with 1 and 4 streams at once (every stream's tokens counted)."""
    from mamba_stream.scan import load_model, save_checkpoint

    mod = load_bench("bench_sizes")
    save_checkpoint(load_model("tiny-mamba2", backend="exact"), tmp_path)
    r = mod.child(tmp_path, "float32", prefill=24, steps=4, runs=1, batch=4)
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["path"] == "exact"
    assert set(r["batched"]) == {"1", "4"} and all(v > 0 for v in r["batched"].values())


def test_the_size_tables_llama_rows_go_on_without_repacking_after_llama_bench_dies(tmp_path, monkeypatch):
    """A llama-bench that dies on a signal (a native build's AMX kernel on a VM that does not hand
    out AMX's state) is run again with --repack 0, and the row says so; a missing GGUF gives None."""
    mod = load_bench("bench_sizes")
    fake = tmp_path / "llama-bench"
    rows = '[{"n_prompt": 8, "n_gen": 0, "avg_ts": 100.0}, {"n_prompt": 0, "n_gen": 4, "avg_ts": 9.0}]'
    fake.write_text(f'#!/bin/sh\ncase "$*" in *"--repack 0"*) ;; *) kill -ILL $$ ;; esac\necho \'{rows}\'\n')
    fake.chmod(0o755)
    gguf = tmp_path / "model-q8.gguf"
    assert mod._llama(str(fake), gguf, 8, 4) is None
    gguf.write_bytes(b"GGUF")
    monkeypatch.delenv("LLAMA_BENCH_ARGS", raising=False)
    assert mod._llama(str(fake), gguf, 8, 4) == {"prefill_tok_s": 100.0, "decode_tok_s": 9.0, "args": "--repack 0"}


def test_the_size_tables_gguf_files_are_made_by_llama_cpps_converter_where_missing(tmp_path):
    """`_convert` runs the converter on a copy of the checkpoint's config (a Mamba-2's vocabulary
    padded to a multiple of 8) beside its weights, in the format's outtype, and leaves the GGUF in
    place only when the converter succeeded; a failure is one line naming the converter."""
    import json

    mod = load_bench("bench_sizes")
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "mamba2", "vocab_size": 50277}))
    (src / "model.safetensors").write_bytes(b"weights")
    conv = tmp_path / "convert_hf_to_gguf.py"
    conv.write_text("import json, sys, pathlib\n"
                    "d, t, out = pathlib.Path(sys.argv[1]), sys.argv[3], sys.argv[5]\n"
                    "cfg = json.loads((d / 'config.json').read_text())\n"
                    "if t == 'bad': sys.exit('no such outtype')\n"
                    "pathlib.Path(out).write_text(json.dumps([t, cfg, (d / 'model.safetensors').read_text()]))\n")
    gguf = src / "model-q8.gguf"
    mod._convert(conv, src, "q8", gguf)
    outtype, cfg, weights = json.loads(gguf.read_text())
    assert outtype == "q8_0" and cfg["pad_vocab_size_multiple"] == 8 and weights == "weights"
    assert "pad_vocab_size_multiple" not in json.loads((src / "config.json").read_text())  # a copy was changed
    mod._OUTTYPES["float16"] = "bad"
    with pytest.raises(RuntimeError, match=r"convert_hf_to_gguf\.py failed"):
        mod._convert(conv, src, "float16", src / "model-float16.gguf")
    assert not (src / "model-float16.gguf").exists() and sorted(p.name for p in src.iterdir()) == [
        "config.json", "model-q8.gguf", "model.safetensors"]


def test_the_fair_tenants_table_on_a_small_flood():
    """bench_fairness on a flood of 4 streams: a worker process and a dev server are started, the
    quiet tenant's chunks are timed alone and beside the flood, every flood chunk is counted, and a
    policy the bench does not know is refused in one line."""
    mod = load_bench("bench_fairness")
    for bad in (["--policies", "fast"], ["--streams", "0"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
    text = mod.run(mod.parse_args(["--streams", "4", "--chunks", "1", "--tenants", "1", "--policies", "full",
                                   "--alone-s", "1.5"]))
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and rows[0][1] == "full"
    alone = [float(x) for x in rows[0][2].split(" / ")]
    flood = [float(x) for x in rows[0][3].split(" / ")]
    assert 0 < alone[0] <= alone[1] and 0 < flood[0] <= flood[1]
    assert float(rows[0][8].split()[0]) > 0 and rows[0][8].endswith("(1.00x)")  # the flood's chunks/s
    assert float(rows[0][10]) > 0  # the worker's peak RSS was read


def test_each_stacks_flood_throughput_is_set_against_its_own_unfair_run(monkeypatch):
    """The table's chunks/s ratios: the external policies against the first external one, the
    embedded ones against `embedded-temporal` (the embedded stack's unfair run), not against the
    external `off` (another server, another cost). The scenarios are stubbed: the arithmetic of
    the table is what is checked here, the real flood above."""
    mod = load_bench("bench_fairness")
    seconds = {"off": 10.0, "full": 11.0, "embedded-temporal": 16.0, "embedded": 12.0}

    async def scenario(policy, tenants, n_streams, n_chunks, alone_s):
        return mod.Run(quiet_alone=[0.02, 0.03], quiet_flood=[0.05, 0.2], quiet_opening=[0.2],
                       quiet_feeding=[0.05], flood_chunks=n_streams * n_chunks, flood_s=seconds[policy],
                       rss_mb=400.0, where={"queued": 1.0, "ran": 2.0, "queued95": 3.0, "ran95": 4.0})

    monkeypatch.setattr(mod, "_scenario", scenario)

    def ratios(policies: str) -> dict[str, str]:
        text = mod.run(mod.parse_args(["--streams", "40", "--chunks", "4", "--tenants", "1", "--policies", policies]))
        rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| 1 |")]
        return {r[1]: r[8] for r in rows}

    got = ratios("off,full,embedded-temporal,embedded")
    assert got == {"off": "16.0 (1.00x)", "full": "14.5 (0.91x)", "embedded-temporal": "10.0 (1.00x)",
                   "embedded": "13.3 (1.33x)"}
    # without the embedded stack's own unfair run, the embedded one is set against the external off
    assert ratios("off,embedded")["embedded"] == "13.3 (0.83x)"
