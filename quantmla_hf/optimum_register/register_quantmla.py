"""Registers `optimum-cli quantmla ...`: a file of the PEP 420 namespace `optimum.commands.register`.

Installed as `optimum/commands/register/register_quantmla.py` (see pyproject.toml); optimum-cli imports every file
there and adds the commands listed in `REGISTER_COMMANDS`.
"""

from quantmla_hf.cli.optimum import REGISTER_COMMANDS  # noqa: F401
