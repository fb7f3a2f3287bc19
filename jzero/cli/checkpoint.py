"""``jzero checkpoint inspect | export``: the checkpoint commands of the command line.

Decisions:

* :func:`add_commands` adds the ``checkpoint`` command to any argparse subparsers object, so
  :mod:`jzero.cli` wires it with one call; each command is ``func(args) -> int``.
* Errors are raised (``CheckpointError`` is a ``ValueError``, a missing file a
  ``FileNotFoundError``); ``jzero.cli.main`` turns both into ``jzero: error: ...`` and exit 2.
* ``inspect`` reads metadata only and exits 0 (a damaged step is reported in its text).
  ``inspect --verify`` reads every file and compares it with the step's file record: every
  complete step when no ``--step`` is named (the question a user asks before resuming or
  archiving is "which of my steps are sound?"), else only the named step; it exits 1 when a
  checked step is damaged, so scripts and cron jobs can act on it.
* The modules behind the commands (Orbax, JAX) are imported when a command runs, so building
  the parser stays cheap.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from jzero.cli import logs

__all__ = ["add_commands"]


def _inspect(args: argparse.Namespace) -> int:
    from jzero.checkpoint import format_info, read_info

    info = read_info(args.directory, step=args.step, verify=args.verify)
    print(format_info(info))
    return 1 if args.verify and info.damaged else 0


def _export(args: argparse.Namespace) -> int:
    from jzero.weights import export_checkpoint

    out = export_checkpoint(
        args.directory,
        args.step,
        args.out,
        dtype=args.dtype,
        tree=args.tree,
        max_shard_size=args.max_shard_size,
    )
    if args.max_shard_size is None:
        print(f"wrote {args.tree} as {args.dtype} to {out} ({os.path.getsize(out):,} bytes)")
        return 0
    from jzero.weights import read_index

    root, weight_map, meta = read_index(out)
    print(
        f"wrote {args.tree} as {args.dtype} to {root}: {len(set(weight_map.values()))} "
        f"safetensors file(s) ({meta['total_size']:,} bytes of tensors) and {out.name}"
    )
    return 0


def add_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``checkpoint inspect DIR`` and ``checkpoint export DIR --out PATH`` to a CLI.

    Args:
      subparsers: the object ``ArgumentParser.add_subparsers()`` returned.

    Returns:
      The ``checkpoint`` parser.
    """
    ck = subparsers.add_parser("checkpoint", help="inspect or export a jzero checkpoint")
    sub = ck.add_subparsers(dest="checkpoint_command", required=True)
    ins = sub.add_parser(
        "inspect",
        help="list steps, leaves, shapes, dtypes and the saved meta; --verify checks the files",
        description=(
            "Describes a checkpoint directory from its metadata (fast: no array is read). "
            "With --verify, also reads every file and compares its size and checksum with the "
            "record written at save time, and exits with status 1 if a step is damaged."
        ),
    )
    ins.add_argument("directory", help="the checkpoint directory")
    ins.add_argument("--step", type=int, default=None, help="the step to describe (latest)")
    ins.add_argument(
        "--verify",
        action="store_true",
        help=(
            "read every file and check it against the step's record (sizes and CRC-32): every "
            "complete step, or only --step when given; prints OK or what is wrong per step and "
            "exits 1 if any is damaged"
        ),
    )
    logs.add_verbose_flag(ins)
    ins.set_defaults(func=_inspect)
    exp = sub.add_parser(
        "export",
        help="write the parameters as one safetensors or .npz file, or as sharded safetensors",
        description=(
            "Writes one tree of a checkpoint step, leaf by leaf. With --max-shard-size, --out is "
            "a directory that receives Hugging Face's layout: model-00001-of-0000N.safetensors "
            "files and model.safetensors.index.json."
        ),
    )
    exp.add_argument("directory", help="the checkpoint directory")
    exp.add_argument("--step", type=int, default=None, help="the step to export (latest)")
    exp.add_argument(
        "--out",
        required=True,
        help="the file (.npz, else safetensors), or with --max-shard-size the directory",
    )
    exp.add_argument(
        "--max-shard-size",
        default=None,
        help="write sharded safetensors of at most this size per file (5GB, 500MiB, bytes)",
    )
    exp.add_argument("--dtype", choices=("fp32", "bf16", "float32", "bfloat16"), default="fp32")
    exp.add_argument("--tree", default="params", help="the saved tree to export (params)")
    logs.add_verbose_flag(exp)
    exp.set_defaults(func=_export)
    return ck
