"""`optimum-cli quantmla ...`: the `quantmla` command line as an optimum-cli subcommand.

optimum-cli discovers subcommands in files of the `optimum.commands.register` namespace package that define
`REGISTER_COMMANDS`. This module holds the command and is importable without optimum (then `REGISTER_COMMANDS`
is empty); `quantmla_hf/optimum_register/register_quantmla.py`, installed as
`optimum/commands/register/register_quantmla.py`,

    from quantmla_hf.cli.optimum import REGISTER_COMMANDS  # noqa: F401

makes `optimum-cli quantmla quantize MODEL --out DIR` run `quantmla quantize MODEL --out DIR`.
"""

from __future__ import annotations

import argparse

try:
    from optimum.commands.base import BaseOptimumCLICommand, CommandInfo
except ImportError:  # optimum is optional
    BaseOptimumCLICommand = CommandInfo = None

REGISTER_COMMANDS: list = []

if BaseOptimumCLICommand is not None:

    class QuantMLACommand(BaseOptimumCLICommand):
        COMMAND = CommandInfo(name="quantmla", help="QuantMLA KV-cache quantization (same as the `quantmla` command)")

        @staticmethod
        def parse_args(parser: argparse.ArgumentParser) -> None:
            from .main import build_parser

            # `optimum-cli quantmla --help` shows the `quantmla` commands, not only "quantmla_args".
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
            parser.description = build_parser().format_help().replace("usage: quantmla", "usage: optimum-cli quantmla")
            parser.add_argument("quantmla_args", nargs=argparse.REMAINDER, metavar="COMMAND ...",
                                help="a `quantmla` command and its arguments (`optimum-cli quantmla COMMAND --help`)")

        def run(self) -> None:
            from .main import main

            raise SystemExit(main(self.args.quantmla_args))

    REGISTER_COMMANDS = [QuantMLACommand]
