"""The test set-up, and the fixtures the test files share.

Set before JAX is imported anywhere: 8 virtual CPU devices, and one persistent compilation
cache for the whole run (a temporary folder the first pytest process makes, every program
written however fast it compiled). Its settings are environment variables, so both xdist
workers and every child process a test starts read the same cache: a program that two tests,
two files or two processes compile identically is compiled once per run. The folder is
removed when the run ends. ``JZERO_TEST_COMPILE_CACHE=off`` runs without it, ``=DIR`` keeps it
in DIR (and keeps DIR).

Python's cyclic garbage collector runs rarely in the test processes, and not over what was
imported before the tests (``tests/support/collector.py``: a tenth of a test file's CPU went
to it).

The layout: ``tests/<package>/`` holds the tests of ``jzero/<package>/``; ``tests/support/``
the helpers they import (``toy``, ``numerics``, ``procs``, ...) and the scripts they start as
child processes; ``tests/fixtures/`` data. Shared fixtures:

* ``x64`` (function) and ``pytestmark = pytest.mark.float64`` (the whole module, module-scoped
  fixtures included): ``jax.enable_x64``, where the tests check exactness;
* ``children``: the reaper every process-starting test uses (see ``procs.Children``);
* ``ckpt_dir``: a fresh checkpoint folder under the test's ``tmp_path``;
* ``tiny_gpt``: the smallest built-in GPT the tests train (``model`` config section).
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

# The CPU code generator's level is the caller's: `make test` runs every test but the `rounding`
# ones at --xla_backend_optimization_level=0 (a quarter less compile time, the same HLO), and those
# at the default level: at level 0 an fp16 step whose gradients overflow changed the state it
# must keep (tests/plan/test_precision.py). A plain `pytest` compiles at the default level.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(_SUPPORT))

_CACHE_VAR = "JAX_COMPILATION_CACHE_DIR"
_made_cache = None  # the folder this process made, and so removes at the end
_choice = os.environ.get("JZERO_TEST_COMPILE_CACHE", "")
if _choice != "off" and _CACHE_VAR not in os.environ:
    if _choice:
        os.environ[_CACHE_VAR] = _choice
    else:
        _made_cache = tempfile.mkdtemp(prefix="jzero-test-compile-cache-")
        os.environ[_CACHE_VAR] = _made_cache
if _CACHE_VAR in os.environ:
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import collector  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402
from procs import Children  # noqa: E402

collector.space_out()


def pytest_configure(config):
    config.addinivalue_line("markers", "float64: the whole module runs under jax.enable_x64")
    config.addinivalue_line(
        "markers",
        "rounding: a bound from float32 or 16-bit rounding (make test-isa runs these again under "
        "another instruction set)",
    )
    # Two processes may compile one program at once: a reader can meet the other's entry half
    # written. JAX then warns and compiles it itself, which is a cache miss, not an error.
    config.addinivalue_line(
        "filterwarnings", "ignore:Error reading persistent compilation cache entry"
    )


def pytest_collection_finish(session):
    collector.freeze_imports()  # the test modules and what they imported


def pytest_unconfigure(config):
    if _made_cache and not hasattr(config, "workerinput"):  # the process that made it
        shutil.rmtree(_made_cache, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    """Every test runs on the 8 virtual CPU devices set up above."""
    assert jax.device_count() == 8 and jax.devices()[0].platform == "cpu", jax.devices()


@pytest.fixture(scope="module", autouse=True)
def _float64_module(request):
    if request.node.get_closest_marker("float64"):
        with jax.enable_x64(True):
            yield
    else:
        yield


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def children():
    """Processes started through it run in their own groups and are killed when the test
    ends, however it ends."""
    c = Children()
    try:
        yield c
    finally:
        c.kill_all()


@pytest.fixture
def ckpt_dir(tmp_path):
    """A checkpoint folder that does not exist yet (jzero makes it)."""
    return tmp_path / "ckpt"


TINY_GPT = {
    "vocab_size": 256,
    "seq_len": 16,
    "num_layers": 2,
    "num_heads": 2,
    "d_model": 32,
    "d_ff": 64,
}


@pytest.fixture
def tiny_gpt():
    """The built-in GPT's ``model`` section at the smallest size the CLI tests train."""
    return dict(TINY_GPT)
