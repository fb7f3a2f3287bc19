"""Child of tests/distributed/test_distributed.py: a cheap collective loop on several processes.

Every step sums one number per device over all processes and prints ``step <i> sum <s>``.
Process 1 prints ``process 1 waiting`` at step 3 and then waits to be killed. The runtime's
heartbeat timeout is HEARTBEAT s (default 30): the test waits for process 0's end a few of them.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jzero import distributed  # noqa: E402

HEARTBEAT = 8  # seconds


def main() -> None:
    distributed.init_distributed({"heartbeat_timeout": HEARTBEAT})
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    local = jax.local_device_count()
    for step in range(1000):
        if step == 3 and jax.process_index() == 1:
            print("process 1 waiting", flush=True)
            time.sleep(600)
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")), np.ones(local, np.float32), (jax.device_count(),)
        )
        print(f"step {step} sum {float(total(x))}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
