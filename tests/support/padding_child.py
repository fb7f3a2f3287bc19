"""Child of test_padding: on 12 devices, restore a checkpoint written elsewhere (copied from
argv[1] to argv[2]) and save it again as step 10 in argv[2]."""

import os
import shutil
import sys

import jax

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "plan"))  # test_padding

jax.config.update("jax_enable_x64", True)

import test_padding  # noqa: E402

shutil.copytree(sys.argv[1], sys.argv[2])
engine, _ = test_padding.restored_view(12, sys.argv[2])
print("padded leaves on 12 devices:", sum(bool(leaf.padding) for leaf in engine.plan.leaves))
engine.save(10)
engine.wait_until_finished()
engine.close()
