# `make demo`, `make test` and `make docs` each set up .venv on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo test test-isa docs lint format bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/jzero train configs/zero2.yaml

# Two workers, each file on one, handed out in the order of the folders (xdist's default order,
# most tests first, left the files with a few long tests, two-process runs and benchmark smoke
# runs among them, to the end, where one worker waited on the other); the slowest 15 last.
test: $(STAMP)
	$(VENV)/bin/ruff check jzero tests examples benchmarks
	$(VENV)/bin/ruff format --check jzero tests examples benchmarks
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# The tests whose bounds come from float32 or 16-bit rounding (marked `rounding`) again, with
# XLA:CPU held to another instruction set: a bound fitted to one machine's rounding fails here at
# once (CI runs this after `make test`). Exactness is tested in float64 at 1e-10, which no
# instruction set's rounding reaches.
ISA ?= AVX2
ROUNDING_TESTS := tests/plan/test_precision.py tests/step/test_parity.py
test-isa: $(STAMP)
	XLA_FLAGS=--xla_cpu_max_isa=$(ISA) $(PY) -m pytest -q -n 2 --dist load -m rounding $(ROUNDING_TESTS)

# The documentation site (docs/ and mkdocs.yml) into site/. The docs extra is installed on top of
# the test set-up, so `make test` installs nothing more; --strict makes every warning (a broken
# link, a docstring the API reference cannot read) an error. Nothing is fetched while it builds.
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

format: $(STAMP)
	$(VENV)/bin/ruff format jzero tests examples benchmarks
	$(VENV)/bin/ruff check --fix jzero tests examples benchmarks

bench: $(STAMP)
	$(PY) benchmarks/stages.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
