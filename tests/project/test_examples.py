"""Every example runs top to bottom (with a few steps) and its loss goes down.

Decisions:
- Each example runs in this process as ``__main__`` (``runpy``), its ``--steps`` on the command
  line: a child process would import JAX, Flax or Equinox again (about 3 CPU-s each) for the
  same program; the suite's own settings (8 CPU devices, the compile cache) are what an example
  sets up for itself when run alone.
- Warnings are shown, not raised: an example may warn on purpose (from_deepspeed lists the
  DeepSpeed keys without meaning under XLA), as a user running it would see.
"""

import re
import runpy
import sys
import warnings

import pytest
from repo import ROOT

EXAMPLES = sorted(ROOT.glob("examples/*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, monkeypatch, capsys):
    # Steps 1 and 10 print their loss (every example prints at step 1 and every 10th).
    monkeypatch.setattr(sys, "argv", [str(path), "--steps", "10"])
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out
