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
# Every test but those marked `rounding` runs with XLA:CPU's code generator at its cheapest level
# (FAST_XLA_FLAGS): LLVM at its lowest level, and fused loops from XLA's elemental emitter rather
# than its MLIR fusion emitters (which took twice as long to compile the tests' small steps:
# tests/step/test_core.py 21.6 s -> 12.7 s). The HLO programs, and so every structural fact the
# tests read (collectives, bytes, memory analyses), are the same, and the float64 checks and
# derived float32 bounds hold either way (it only changes how LLVM orders and fuses arithmetic).
# The `rounding` tests then run at the default level, as users compile: there the 16-bit code
# matters (at level 0 an fp16 step whose gradients overflow kept the wrong state). LLVM compiles
# each program as one module (--xla_cpu_parallel_codegen_split_count=1): split into parts compiled
# on threads, a tiny step's program cost 15% more CPU (3.55 -> 3.09 s, a two-axis composition's
# step), and the two workers already keep both cores busy; the HLO program is the same.
FAST_XLA_FLAGS := --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true \
  --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1
test: $(STAMP)
	$(VENV)/bin/ruff check jzero tests examples benchmarks
	$(VENV)/bin/ruff format --check jzero tests examples benchmarks
	XLA_FLAGS="$(FAST_XLA_FLAGS)" $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
	  --durations=15 -m "not rounding"
	$(PY) -m pytest -q -n 2 --dist load -m rounding $(ROUNDING_TESTS)

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
