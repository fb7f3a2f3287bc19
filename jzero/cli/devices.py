"""The devices a command runs on: ``--cpu-devices`` virtual CPU devices without an accelerator.

Decisions:

* Every command that compiles (``jzero train``, ``jzero plan``) declares the flag with
  :func:`add_cpu_devices_flag` and calls :func:`use_cpu_devices` before anything touches a JAX
  backend, so every stage shards for real on a laptop: 8 devices unless the flag says otherwise.
* A count the user already chose (``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``,
  as ``jzero launch --devices-per-process`` sets it) wins, and a backend already up keeps what it
  has. On an accelerator the setting changes nothing: it applies to the CPU backend only.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["DEFAULT_CPU_DEVICES", "add_cpu_devices_flag", "use_cpu_devices"]

DEFAULT_CPU_DEVICES = 8


def add_cpu_devices_flag(parser: argparse.ArgumentParser) -> None:
    """Adds ``--cpu-devices N`` (``args.cpu_devices``, default 8) to a subcommand's parser."""
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=DEFAULT_CPU_DEVICES,
        help=f"virtual CPU devices when there is no accelerator (default {DEFAULT_CPU_DEVICES})",
    )


def use_cpu_devices(count: int) -> None:
    """Gives the CPU backend ``count`` devices unless the user already chose a count."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a backend is already up; keep what it has
        pass
