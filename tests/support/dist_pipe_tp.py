"""The 3-D task of tests/support/dist_session.py: one process of a two-process ``jzero launch``
run of the built-in GPT on ``{pipe: 2, data: 2, model: 2}`` at ZeRO stage 3, the ``pipe`` axis
spanning the processes (each holds one stage, split over its own ``model`` and ``data``
devices) as pipelines cross hosts in practice. The batch's rows are split over ``data`` only, so
both stages (both processes) read every row: each process passes the whole global batch. The
record: the losses and gradient norms of :data:`compositions.STEPS` steps, the mesh, and which
process holds each stage's devices. In float64 (the child enables it)."""

import os
import sys

import optax

sys.path.insert(0, os.path.dirname(__file__))

import jzero  # noqa: E402

AXES = ("model", "pipe")
STAGE = 3


def train() -> dict:
    import compositions  # imported here: its numerics module starts JAX's backend, which must
    # wait for the distributed runtime

    cfg = compositions.model_config(AXES)
    engine = jzero.initialize(
        compositions.params(cfg),
        lambda p, b: compositions.gpt.loss_fn(p, b, cfg),
        optax.adamw(compositions.LR),
        compositions.config(AXES, STAGE),
    )
    metrics = [engine.train_step(b) for b in compositions.batches()]  # every row: see above
    return {
        "metrics": [(float(m["loss"]), float(m["grad_norm"])) for m in metrics],
        "mesh": dict(engine.mesh.shape),
        "processes": [
            sorted({d.process_index for d in engine.mesh.devices[s].flat}) for s in range(2)
        ],  # fmt: skip
    }
