# `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: run test bench eval verify crosscheck clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	# torch first, pinned: the CPU build on local disk (an unpinned torch pulls several GB)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,agents]'
	# mamba-ssm is source-only on PyPI: build its pure-Python part, no CUDA, no dependencies.
	# Only its reference functions are used, for cross-checks (tests/scan/_mamba_ssm.py).
	MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE $(PIP) install -q --no-build-isolation --no-deps mamba-ssm==2.3.2.post1
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/mamba-stream demo

test: $(STAMP)
	# lint first: the rules and their exceptions are in pyproject.toml's [tool.ruff.lint]
	$(VENV)/bin/ruff check .
	# two test processes (pytest-xdist), a file each at a time: the suite is mostly one busy
	# core at a time (Temporal round trips, subprocess workers), and two fill a 2-core machine
	MAMBA_STREAM_REQUIRE_CROSSCHECK=1 $(PY) -m pytest -q -n 2 --dist loadfile
	# the generated release packet must come out the same on any x86-64 CPU: again, as the
	# scalar build of torch's kernels would compute it (a stand-in for another instruction set)
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q tests/cli/test_release_packet.py

bench: $(STAMP)
	$(PY) bench/bench_scan.py
	$(PY) bench/bench_sizes.py --sizes 130m
	$(PY) bench/bench_codec.py
	$(PY) bench/bench_temporal.py
	$(PY) bench/bench_agent.py
	$(PY) bench/bench_readers.py
	$(PY) bench/bench_serving.py
	$(PY) bench/prefix_states.py
	$(PY) bench/bench_segments.py
	$(PY) bench/bench_conversations.py
	$(PY) bench/bench_fairness.py

eval: $(STAMP)
	$(VENV)/bin/mamba-stream eval --append docs/results/quality.md

crosscheck: $(STAMP)
	MAMBA_STREAM_REQUIRE_CROSSCHECK=1 $(PY) -m pytest -q -s -m crosscheck

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
