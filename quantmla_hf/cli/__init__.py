"""The `quantmla` command (`main.py`), its demo (`demo.py`) and its `optimum-cli quantmla` registration (`optimum.py`).

Nothing is imported here: optimum-cli imports `optimum.py` to list its commands, without loading the rest.
"""
