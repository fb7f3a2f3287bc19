"""jzero's memory commands (``estimate``, ``plan``) run in the test's own process, as the shell
runs them."""

import argparse

from jzero.cli import memory as cli_memory


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="jzero")
    cli_memory.add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
