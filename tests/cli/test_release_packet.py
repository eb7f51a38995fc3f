"""The release packet's generated parts match the code: regenerated here, compared with what is
committed (docs/release/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mamba_stream.cli._release import VERIFY_RUNS, render_schema_reference, render_verification

ROOT = Path(__file__).resolve().parents[2]
RELEASE = ROOT / "docs" / "release"


def test_the_state_schema_reference_is_what_the_code_generates():
    committed = (RELEASE / "state-schema-reference.md").read_text()
    assert render_schema_reference() == committed, (
        "regenerate: mamba-stream schema --out docs/release/state-schema-reference.md")


#: backends whose partitions must give the same bits on every CPU; elsewhere (torch's kernels) a
#: partition that happens to give the bits is within its bound all the same: whether it does
#: follows the CPU (tiny-mamba1's chunked "empty chunks around" is "exact" under AVX-512 and
#: "within" under ATEN_CPU_CAPABILITY=avx2 on one Sapphire Rapids), so both read "pass" there
_BIT_EXACT = ("exact", "exact-fma", "reference")


def _verdicts(text: str) -> list[tuple[str, ...]]:
    """Section titles, partition verdicts and reset-control answers, without the measured values."""
    out, bit_exact = [], True
    for line in text.splitlines():
        if line.startswith("## ") or line.startswith("Reset control") or "Verdict:" in line:
            out.append((line,))
            if line.startswith("## "):
                found = re.search(r"backend `([\w-]+)`", line)
                bit_exact = found is None or found.group(1) in _BIT_EXACT
        elif line.startswith("| ") and not line.startswith(("| partition", "|---")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            verdict = cells[-1] if bit_exact or cells[-1] not in ("exact", "within") else "pass"
            out.append((cells[0], cells[1], verdict))
    return out


@pytest.mark.slow
def test_the_verification_results_are_what_verify_reports():
    committed = (RELEASE / "verification.md").read_text()
    text, ok = render_verification(VERIFY_RUNS)
    assert ok and "FAIL" not in committed
    assert _verdicts(text) == _verdicts(committed), (
        "regenerate: mamba-stream verify --markdown --out docs/release/verification.md")
    assert committed.count("Reset control: A+B differs from B alone: **True**; A, reset, B equals a fresh B: "
                           "**True**") == len(VERIFY_RUNS)


def test_the_packet_index_names_files_that_exist_and_the_readme_draws_the_lifecycle():
    index = (RELEASE / "README.md").read_text()
    for link in re.findall(r"\]\(([^)#]+)\)", index):
        assert (RELEASE / link).resolve().exists(), link
    readme = (ROOT / "README.md").read_text()
    assert "```mermaid\nstateDiagram-v2" in readme and "docs/release/README.md" in readme
