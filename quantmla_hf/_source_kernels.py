"""`quantmla_hf.kernels` in a source tree: the repository's top-level `kernels/` folder, where nothing else maps it.

`kernels/` has no `__init__.py` on purpose: when the clone's root is on `sys.path` (a REPL, `python -c`, a notebook
or `python -m` started there) a regular package `kernels` there would shadow Hugging Face's `kernels`, which
transformers imports; a folder without one is at most a namespace portion, which an installed package wins over.
pyproject.toml's package-dir installs the folder as the namespace subpackage `quantmla_hf.kernels`: a wheel holds it
as `quantmla_hf/kernels/`, but setuptools' editable finder does not map a namespace subpackage of a regular package
(pypa/setuptools#4943) and a source tree on PYTHONPATH maps nothing. There `register()` makes the source folder
`quantmla_hf.kernels`; where the name already resolves (a wheel, an editable finder that maps it) it does nothing.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

PARENT = __name__.rpartition(".")[0]
NAME = PARENT + ".kernels"
SOURCE = Path(__file__).resolve().parent.parent / "kernels"


def register() -> None:
    """Make `SOURCE` the namespace package `quantmla_hf.kernels` unless that name resolves already."""
    if NAME in sys.modules or importlib.util.find_spec(NAME) is not None or not SOURCE.is_dir():
        return
    spec = importlib.machinery.ModuleSpec(NAME, None, is_package=True)
    spec.submodule_search_locations = [str(SOURCE)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    setattr(sys.modules[PARENT], "kernels", module)


register()
