"""Child of tests/distributed/test_clusters.py: one process of a simulated cluster job.

Starts jzero's runtime with no argument and no ``JZERO_*`` variable (the layout must come from
the cluster's variables), then sums ``process_index + 1`` over every device of every process
and prints one JSON record: the process layout JAX ended with and that sum.
"""

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from jzero import distributed  # noqa: E402


def main() -> None:
    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    logging.getLogger("jzero").setLevel(logging.DEBUG)  # process 1's line is at DEBUG
    spec = distributed.init_distributed()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    local = jax.local_device_count()
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")),
        np.full(local, jax.process_index() + 1, np.float32),
        (jax.device_count(),),
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    record = {
        "source": spec.source,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": local,
        "sum": float(total),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
