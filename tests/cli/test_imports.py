"""What a process loads: ``import jzero``, ``jzero --help`` and ``jzero estimate`` import no JAX,
Flax, Optax, Orbax or TensorStore (each started process saves their seconds of start-up), and
every public name of the packages that load them on first use is there when read.

Each check runs in a fresh interpreter (this one has JAX loaded by tests/conftest.py) and reads
its ``sys.modules``: a structural fact, not a time."""

import importlib
import json
import subprocess
import sys

import pytest
from repo import ROOT

HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "tensorstore", "numpy")
# The packages whose public names load on first use (jzero._util.lazy_exports).
LAZY = ("jzero", "jzero.checkpoint", "jzero.distributed", "jzero.memory")

# Runs the given statements, then prints the HEAVY modules loaded as the last line of stdout.
_PROBE = """
import json, sys
{code}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _loaded(code: str) -> tuple[list[str], str]:
    """The heavy modules a fresh interpreter loaded after ``code``, and what it printed before."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(code=code, heavy=HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    *out, last = proc.stdout.splitlines()
    return json.loads(last), "\n".join(out)


def test_import_jzero_loads_no_heavy_library():
    heavy, out = _loaded(
        "import jzero, jzero.checkpoint, jzero.distributed, jzero.memory\n"
        "print(sorted(set(jzero.__all__) - set(dir(jzero))))"
    )
    assert heavy == []
    assert out == "[]"  # dir() lists the names not read yet


def test_jzero_help_and_estimate_load_no_heavy_library():
    code = (
        "from jzero import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert cli.main(['estimate', '--params', '7e9', '--devices', '8']) == 0\n"
    )
    heavy, out = _loaded(code)
    assert heavy == []
    for command in ("train", "verify", "estimate", "plan", "checkpoint", "launch"):
        assert command in out.split("\n\n")[0], out  # --help's list of subcommands
    assert "ZeRO model states per device: Psi = 7e+09 parameters, N = 8 devices" in out


def test_the_console_command_prints_its_help():
    proc = subprocess.run(
        [sys.executable, "-m", "jzero.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: jzero ")


@pytest.mark.parametrize("package", LAZY)
def test_every_public_name_loads_as_the_module_defines_it(package):
    """Each name of ``__all__`` read from the package is the object its module defines (as the
    ``TYPE_CHECKING`` import beside it says; tests/project/test_house.py checks the two agree),
    ``from package import name`` works, and a name that is not there is an AttributeError."""
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        assert value is not None, name
        exec(f"from {package} import {name} as imported", {}, scope := {})
        assert scope["imported"] is value
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_a_submodule_is_an_attribute_of_its_package():
    """``import jzero`` then ``jzero.checkpoint``: the package imports the submodule when read,
    as ``import jzero`` once did on the way to its names."""
    heavy, out = _loaded("import jzero\nprint(jzero.checkpoint.__name__, jzero.cli.__name__)")
    assert out == "jzero.checkpoint jzero.cli"
    assert "orbax.checkpoint" not in heavy  # the package's names are not read yet
