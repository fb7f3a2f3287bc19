"""jzero's memory commands (``estimate``, ``plan``) run in the test's own process, as the shell
runs them; and the ``train.compile_cache`` override that puts a ``jzero train`` run's compiled
programs in the test run's shared cache."""

import argparse
import json
import os

from jzero.cli import memory as cli_memory


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def shared_compile_cache():
    """``["train.compile_cache=DIR"]`` with tests/conftest.py's run-wide cache, so that runs of
    one config in different tests (and in child processes) compile its programs once; ``[]``
    without that cache (``JZERO_TEST_COMPILE_CACHE=off``). By default a run keeps its own cache
    beside its checkpoint directory (tests/step/test_compile_count.py tests that default)."""
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return [f"train.compile_cache={json.dumps(cache)}"] if cache else []


# The `jzero train` flags of the CLI tests: the tiny GPT at stage 3 (tests/cli, tests/distributed).
TINY = [
    "--set",
    "checkpoint.directory=null",  # no checkpoints unless a test names a folder
    "--set",
    "model={vocab_size: 256, seq_len: 16, num_layers: 2, num_heads: 2, d_model: 32, d_ff: 64}",
    "--set",
    "data={source: stdlib, max_bytes: 200000}",
    "--set",
    "train_micro_batch_size_per_gpu=2",
    "--set",
    "train.eval_interval=3",
    "--set",
    "train.eval_batches=1",
    "--set",
    "steps_per_print=2",
    "--set",
    "zero_optimization.stage=3",
    "--set",
    "zero_optimization.stage3_param_persistence_threshold=0",
    # The run-wide compile cache: these runs, the children's and tests/train's share programs.
    *(arg for override in shared_compile_cache() for arg in ("--set", override)),
]
