"""Python's cyclic garbage collector, spaced out for a test process that traces and compiles
many programs: the pytest workers (``tests/conftest.py``), the benchmark smoke child
(``bench_smoke.py``) and the two-process session's processes (``dist_session.py``).

JAX's tracing makes many short-lived container objects, so the collector's default thresholds
(a young collection every 700 allocations) run it thousands of times in one test file, and each
full collection walks everything the process has imported and cached: measured on
tests/distributed/test_compose_three.py in one process, 3,036 young and 21 full collections took
6.5 of its 63.6 CPU-s. With :func:`space_out` they took 1.4 (22 and 3).

What the library's own users run is untouched: this is the tests' process setting alone.
Memory is not the cost it could be: objects freed by their reference counts (arrays among
them) go at once as before; only garbage in cycles waits for the rarer collections.
"""

import gc

__all__ = ["freeze_imports", "space_out"]


def space_out() -> None:
    """A young collection every 50,000 allocations (not 700), the older ones in proportion."""
    gc.set_threshold(50_000, 20, 100)


def freeze_imports() -> None:
    """Moves everything alive now (modules, JAX's and jzero's tables) out of the collector's
    sight: the full collections after it walk only what the tests made since."""
    gc.collect()
    gc.freeze()
