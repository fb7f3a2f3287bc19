"""ZeRO memory per device: the paper's closed forms, then every stage of a config's GPT measured.

Run: ``python benchmarks/memory.py [--config configs/zero2.yaml] [--device-memory 80GB]``
(8 virtual CPU devices are set up when no accelerator is present). The first table is
:func:`jzero.memory.estimate` for the ZeRO paper's example (7.5e9 parameters on 64 devices);
the second is :func:`jzero.demo.plan.plan_report`, from the compiled step of each stage.
"""

from __future__ import annotations

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

from jzero import memory  # noqa: E402
from jzero.costs import ModelShape, ParallelDims  # noqa: E402
from jzero.demo.plan import plan_report  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/zero2.yaml")
    ap.add_argument("--device-memory", default="80GB")
    args = ap.parse_args(argv)
    print(
        memory.estimate(
            ModelShape(7.5e9), ParallelDims(64, devices_per_node=8), args.device_memory
        ).table()
    )
    print()
    print(plan_report(args.config, device_memory=args.device_memory).table())


if __name__ == "__main__":
    main()
