"""Child process of tests/nvme/test_offload_tiers.py: trains the toy model 3 steps at stages 1-3
with
the optimizer state in memory and on NVMe (and at stage 3 with the parameters on NVMe too,
"3p"), and prints, per run, how many elements of the parameters and the optimizer state differ
(JSON).

Run with ``--xla_backend_optimization_level=0`` in XLA_FLAGS: at the default level the CPU code
generator may contract a multiply-add into one fused instruction in one program and not in
another (the NVMe tier's update runs in its own programs), which changes the last bit; without
it both runs do the same float32 arithmetic, so every bit must agree.

Usage: nvme_bits_child.py NVME_DIR
"""

import json
import os
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
import toy  # noqa: E402

import jzero  # noqa: E402

PSI = sum(x.size for x in jax.tree.leaves(toy.make_params()))


def run(stage: int, nvme_dir: str | None, params_too: bool = False) -> tuple[list, list]:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    zero["pad_shards"] = False  # the NVMe tier never pads: the same layout in memory
    if nvme_dir:  # sub_group_size streams only offloaded state (in memory it warns)
        zero["sub_group_size"] = PSI // 3
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir}
    if nvme_dir and params_too:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    cfg = {"train_batch_size": 32, "gradient_clipping": 0.5, "zero_optimization": zero}
    e = jzero.initialize(toy.make_params(), toy.loss_fn, optax.adamw(1e-2, weight_decay=1e-2), cfg)
    losses = [float(e.train_step(b)["loss"]) for b in toy.make_batches(3, 32)]
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get((e.params, e.opt_state)))]
    e.close()
    return losses, leaves


def compare(nvme_dir: str, in_memory: dict | None = None) -> dict:
    """Per run, whether the losses agree and how many elements differ. The test calls it in its
    own process where XLA_FLAGS already holds ``--xla_backend_optimization_level=0``, handing
    it the runs in memory it trained already (``{stage: (losses, leaves)}``: this module's
    ``run(stage, None)``, the same config, optimizer and batches); the others are trained here."""
    out, in_memory = {}, dict(in_memory or {})
    for name, stage, params_too in ((1, 1, False), (2, 2, False), (3, 3, False), ("3p", 3, True)):
        if stage not in in_memory:
            in_memory[stage] = run(stage, None)
        (l1, a), (l2, b) = in_memory[stage], run(stage, nvme_dir, params_too)
        out[str(name)] = {
            "losses_equal": l1 == l2,
            "differing": sum(int((x != y).sum()) for x, y in zip(a, b, strict=True)),
        }
    return out


def main(nvme_dir: str) -> None:
    print(json.dumps(compare(nvme_dir)))


if __name__ == "__main__":
    main(sys.argv[1])
