"""The run resolved before its state exists (:mod:`jzero.engine.resolve`): where the layout
waits for a batch (a pipeline, ``stage: auto``, ``autotp_size: auto``, stage 3's stacked layers),
the state each device holds after ``initialize(batch=...)`` is the state it holds after the first
step, byte for byte, and the first step compiles but moves nothing. Without ``batch=``, the
first batch decides before the state is made.

Measured by ``benchmarks/state_at_initialize.py``'s own function on its smoke GPT (so the
script that prints the figures cannot rot), on 8 devices."""

import sys

import jax
import numpy as np
import optax
import pytest
from repo import ROOT

import jzero
from jzero.demo import gpt

sys.path.insert(0, str(ROOT / "benchmarks"))
from state_at_initialize import LAYOUTS, device0_bytes, measure  # noqa: E402

GPT = gpt.GPTConfig(vocab_size=64, seq_len=8, num_layers=2, num_heads=2, d_model=16)
ROWS = 16


@pytest.fixture
def no_move(monkeypatch):
    """Any move of a made state fails the test."""
    monkeypatch.setattr("jzero.engine.engine.relayout", lambda *a: pytest.fail("state moved"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_state_is_made_in_its_final_layout_at_initialize(name, no_move):
    early, made, after, moved = measure(GPT, LAYOUTS[name], ROWS)
    assert made == after and not moved
    if name.startswith("pipeline"):
        # The defect this guards: made before the shapes were known, a pipelined state rests
        # over data alone (its layers not yet split over pipe), about twice its final bytes.
        assert early > 1.5 * made


def test_without_batch_the_first_batch_decides_before_the_state_is_made(no_move):
    layout = LAYOUTS["pipeline.stages 2 (ZeRO-3)"]
    params = gpt.init_params(jax.random.key(0), GPT)
    tokens = np.random.default_rng(0).integers(0, GPT.vocab_size, (ROWS, GPT.seq_len + 1))
    batch = {"tokens": tokens.astype(np.int32)}
    config = {"train_batch_size": ROWS, **layout}
    e = jzero.initialize(params, lambda p, b: gpt.loss_fn(p, b, GPT), optax.adamw(1e-3), config)
    assert e._state is None  # the layout waits for a batch: nothing made yet
    e.train_step(batch)
    _, made, _, _ = measure(GPT, layout, ROWS)
    assert device0_bytes(e.state) == made
    e.close()
