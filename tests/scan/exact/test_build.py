"""Building the kernels (`_build`): the source is `_kernels.c` and every part beside it, shipped
with the package and keyed into the build; without a compiler the twins run and say why."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import tomllib

from mamba_stream.scan.exact import _build
from tests.scan.exact._helpers import NEEDS_KERNELS, ROOT


def test_kernels_c_includes_every_part_beside_it_each_with_its_python_module_and_the_build_keys_them_all():
    """`_kernels.c` is the one translation unit: it includes every other `*.c` of the package (a
    part left out would be shipped and never compiled), each part sits beside the Python module
    of its kernel calls and twins (`_unary.c`, `_unary.py`), and a change to any part is a new
    build (the cache key hashes them all)."""
    here = _build._SOURCE.parent
    included = re.findall(r'^#include "([^"]+)"', _build._SOURCE.read_text(), re.M)
    parts = sorted(p.name for p in here.glob("*.c") if p != _build._SOURCE)
    assert sorted(included) == parts and len(set(included)) == len(included), (included, parts)
    for name in parts:
        assert (here / name).with_suffix(".py").is_file(), name
        assert (here / name).read_bytes() in _build._source_bytes(), name


def test_the_package_data_ships_every_c_file():
    """An installed package compiles its kernels at first use: the wheel must carry the sources."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data.get("mamba_stream.scan.exact", [])
    for path in _build._SOURCE.parent.glob("*.c"):
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), (path.name, patterns)


@NEEDS_KERNELS
def test_without_a_compiler_the_twins_run_and_say_why(tmp_path):
    env = {"MAMBA_STREAM_CACHE": str(tmp_path), "PATH": str(tmp_path), "MAMBA_STREAM_CC": ""}
    code = ("import sys; sys.modules['ziglang'] = None\n"
            "from mamba_stream.scan import load_model\n"
            "m = load_model('tiny-mamba2', backend='exact')\n"
            "print(m.exact_probe.kernels, m.advance(m.initial_state(), [1]).path, '|', m.exact_probe.reason)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         cwd=ROOT, timeout=300, check=True)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("False exact-twin |") and "no C compiler" in line
