"""The quality report: its numbers come from the measurements, and runs are appended."""

from __future__ import annotations

from mamba_stream.quality.evaluate import (
    EvalConfig,
    append_run,
    chance_band,
    evaluate_attention,
    evaluate_preset,
    render_run,
)


def test_a_small_run_renders_and_appends_without_replacing(tmp_path):
    cfg = EvalConfig(n=8, delays=(0, 16), parity_bits=(4,), chunked_delays=(0,))
    rep = evaluate_preset("recall-mamba2", cfg)
    assert set(rep.recall) == {0, 16} and set(rep.parity) == {4}
    assert rep.chunked_identical[0] == (0, 8 * cfg.pairs)
    assert len(set(rep.memory_bytes.values())) == 1  # the Mamba state does not grow with the context
    att = evaluate_attention(cfg)
    reports = [rep] if att is None else [rep, att]
    if att is not None:
        small, large = sorted(att.memory_bytes)
        assert att.memory_bytes[large] > att.memory_bytes[small]
    section = render_run(reports, cfg)
    assert f"| recall-mamba2 | mamba2 | {rep.schema} | {rep.revision} |" in section
    assert f"{rep.recall[0]:.3f}" in section
    out = tmp_path / "quality.md"
    append_run(out, section)
    append_run(out, section.replace("Run of", "Second run of"))
    text = out.read_text()
    assert text.count("# Model quality by architecture version") == 1
    assert text.index("## Run of") < text.index("## Second run of")


def test_the_chance_band_is_centred_on_one_in_ten_and_narrows():
    lo, hi = chance_band(400)
    assert lo < 0.1 < hi and lo > 0.05 and hi < 0.15
    lo2, hi2 = chance_band(4000)
    assert lo < lo2 and hi2 < hi
