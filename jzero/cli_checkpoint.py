"""``jzero checkpoint inspect | export``: the checkpoint commands of the command line.

Decisions:

* :func:`add_commands` adds the ``checkpoint`` command to any argparse subparsers object, so
  ``jzero.cli`` wires it with one call; each command is ``func(args) -> int``.
* Errors are raised (``CheckpointError`` is a ``ValueError``, a missing file a
  ``FileNotFoundError``); ``jzero.cli.main`` turns both into ``jzero: error: ...`` and exit 2.
* The modules behind the commands (Orbax, JAX) are imported when a command runs, so building
  the parser stays cheap.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["add_commands"]


def _inspect(args: argparse.Namespace) -> int:
    from jzero.checkpoint import inspect

    print(inspect(args.directory, step=args.step))
    return 0


def _export(args: argparse.Namespace) -> int:
    from jzero.checkpoint import export

    out = export(args.directory, args.step, args.out, dtype=args.dtype, tree=args.tree)
    print(f"wrote {args.tree} as {args.dtype} to {out} ({os.path.getsize(out):,} bytes)")
    return 0


def add_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``checkpoint inspect DIR`` and ``checkpoint export DIR --out FILE`` to a CLI.

    Args:
      subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
      The ``checkpoint`` parser.
    """
    ck = subparsers.add_parser("checkpoint", help="inspect or export a jzero checkpoint")
    sub = ck.add_subparsers(dest="checkpoint_command", required=True)
    ins = sub.add_parser("inspect", help="list steps, leaves, shapes, dtypes and the saved meta")
    ins.add_argument("directory", help="the checkpoint directory")
    ins.add_argument("--step", type=int, default=None, help="the step to describe (latest)")
    ins.set_defaults(func=_inspect)
    exp = sub.add_parser("export", help="write the parameters as one safetensors or .npz file")
    exp.add_argument("directory", help="the checkpoint directory")
    exp.add_argument("--step", type=int, default=None, help="the step to export (latest)")
    exp.add_argument("--out", required=True, help="the file: .npz, else safetensors")
    exp.add_argument("--dtype", choices=("fp32", "bf16", "float32", "bfloat16"), default="fp32")
    exp.add_argument("--tree", default="params", help="the saved tree to export (params)")
    exp.set_defaults(func=_export)
    return ck
