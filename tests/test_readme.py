"""The README a new user reads first: every file it names is in the repository, which a clone
has alone (no `../shared` beside it), and its stream ids have the shape `open` prints."""

from __future__ import annotations

import re
from pathlib import Path

from mamba_stream.workflows._client import new_stream_id

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_file_the_readme_names_is_in_the_repository():
    named = set(re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:md|py|sh|yml|toml|json|png|txt))`", README))
    named |= set(re.findall(r"`((?:docs|bench|mamba_stream|tests|deploy)/[\w./-]*)`",
                            README))
    assert named, "the README names no files: the pattern no longer matches its style"
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"the README names files a clone does not have: {missing}"
    assert "../shared" not in README


def test_the_readmes_stream_ids_have_the_shape_open_prints():
    shape = r"ms\.<tag>\.<hex>"
    assert re.search(shape, README)
    assert re.fullmatch(r"ms\.[0-9a-f]+\.[0-9a-f]{32}", new_stream_id("3b1f0c2a"))
    assert "ms-" not in README  # the old shape


def test_the_readmes_agent_is_the_shipped_example_whole():
    """The "Embed a stream" section shows workflows/_agent.py's models and workflow as they are
    (which tests/workflows/test_agent.py runs through a SIGKILL), not a copy that drifts."""
    [block] = re.findall(r"### Embed a stream in your agent workflow\n.*?```python\n(.*?)```", README, re.S)
    shipped = (ROOT / "mamba_stream" / "workflows" / "_agent.py").read_text()
    assert block.startswith("class ChatInput(") and shipped.rstrip().endswith(block.rstrip())
    assert len(block.strip().splitlines()) <= 50
