"""``jzero checkpoint inspect`` shows the data position a checkpoint carries: jzero.data's
sample and epoch, another iterator's ``state()`` or a Grain iterator's ``get_state()`` in a
short form (what :mod:`jzero.engine.data_position` writes into the meta). A tiny state written
by the Checkpointer directly: no training step is compiled."""

import numpy as np
import pytest

from jzero import cli
from jzero.checkpoint import Checkpointer
from jzero.checkpoint.info import format_data_position

JZERO_DATA = {"sample": 96, "seed": 0, "rows": 40, "fingerprint": "0123abcd", "epoch": 2}
GRAIN = {"text": '{"next_index": 12, "worker_count": 0, "sampler": "IndexSampler"}'}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 1 holds jzero.data's position, step 2 a Grain DataLoader's, step 3 none."""
    directory = tmp_path_factory.mktemp("position") / "ckpt"
    metas = {1: {"data": JZERO_DATA}, 2: {"data_grain": GRAIN}, 3: {}}
    with Checkpointer(directory, async_save=False) as ckpt:
        for step, meta in metas.items():
            state = {"step": np.int32(step), "w": np.arange(4, dtype=np.float32)}
            assert ckpt.save(step, state, meta={"step": step, **meta})
    return directory


def inspect(capsys, directory, step):
    capsys.readouterr()
    assert cli.main(["checkpoint", "inspect", str(directory), "--step", str(step)]) == 0
    return capsys.readouterr().out


def test_inspect_shows_the_data_position(saved, capsys):
    out = inspect(capsys, saved, 1)
    assert "  data position: sample 96 (epoch 2)\n" in out
    out = inspect(capsys, saved, 2)
    line = next(ln for ln in out.splitlines() if "data position" in ln)
    assert line.startswith("  data position: Grain get_state()/set_state() (text): ")
    assert '"next_index": 12' in line
    assert "data position" not in inspect(capsys, saved, 3)


def test_other_states_are_shown_short():
    assert format_data_position({}) is None
    assert format_data_position({"data": {"sample": 0}}) == "sample 0"
    assert format_data_position({"data": {"step": 7}}) == 'state()/restore(): {"step": 7}'
    long = format_data_position({"data_grain": {"value": {"k": "x" * 200}}})
    assert long.startswith("Grain get_state()/set_state() (value): {") and long.endswith("...")
    assert len(long) < 130
    assert format_data_position({"data_grain": {"base64": "AAEC"}}).endswith("(base64): AAEC")
