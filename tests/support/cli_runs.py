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
