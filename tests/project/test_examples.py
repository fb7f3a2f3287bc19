"""Every example runs top to bottom (with a few steps) and its loss goes down."""

import os
import re
import subprocess
import sys

import pytest
from repo import ROOT

EXAMPLES = sorted(ROOT.glob("examples/*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(path), "--steps", "10"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], proc.stdout
