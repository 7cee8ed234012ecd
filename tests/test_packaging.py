"""The Triton kernels ship inside the package, and no folder of the repository shadows an installed package.

`kernels/` (installed as `quantmla_hf.kernels`) and every other folder at the root have no `__init__.py`: when the
clone's root is on `sys.path` (`python -c`, `python -m`, a REPL or a notebook started there) such a folder is at most
a namespace portion, which an installed package of that name wins over. Hugging Face's `kernels`, which transformers
>= 5.25 imports, is the case that bit. The checks run in subprocesses with `cwd` = the root, as a user's session
would (pytest itself does not put the root on the path).
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

import quantmla_hf.kernels

REPO = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def python(*args: str, cwd: Path = REPO, env: dict | None = None) -> str:
    """stdout of `python ARGS` run in `cwd`; fails the test with its stderr when it fails."""
    run = subprocess.run([sys.executable, *args], cwd=cwd, env=env or ENV, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"python {' '.join(args)} in {cwd} failed:\n{run.stderr[-3000:]}"
    return run.stdout


def offline_build_missing() -> str | None:
    """What this environment lacks to build the wheel with its own setuptools (pyproject: setuptools >= 68 and
    wheel, whose bdist_wheel setuptools >= 70.1 includes), or None."""
    try:
        version = Version(metadata.version("setuptools"))
    except metadata.PackageNotFoundError:
        return "setuptools is not installed"
    if version < Version("68"):
        return f"setuptools {version} is older than the 68 pyproject.toml asks for"
    if version < Version("70.1") and importlib.util.find_spec("wheel") is None:
        return f"setuptools {version} needs the wheel package, which is not installed"
    return None


def test_kernels_are_installed_as_a_subpackage():
    assert REPO / "kernels" in [Path(p).resolve() for p in quantmla_hf.kernels.__path__]


def test_import_and_cli_from_the_repository_root(tmp_path):
    """`import quantmla_hf` and `python -m quantmla_hf.cli.main --help` in the clone's root; the `kernels` transformers
    imported there is the installed one, the one found from any other folder."""
    code = "import sys, quantmla_hf; print(getattr(sys.modules.get('kernels'), '__file__', None))"
    loaded = python("-c", code).strip()
    assert "usage: quantmla" in python("-m", "quantmla_hf.cli.main", "--help")
    installed = python("-c", "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)",
                       cwd=tmp_path).strip()
    if installed == "None":
        pytest.skip("Hugging Face's `kernels` is not installed (transformers < 5.25 does not require it): the import "
                    "and the CLI from the root passed; test_no_repository_folder_shadows_an_installed_package "
                    "checks the rule with stand-in packages")
    if loaded != "None":  # transformers imported it while quantmla_hf loaded
        assert loaded == installed
    assert python("-c", "import kernels; print(kernels.__file__)").strip() == installed


def test_no_repository_folder_shadows_an_installed_package(tmp_path):
    """For every importable name at the root (folders and modules but the package itself), a regular package of
    that name installed on the path wins over the repository's folder when the root comes first on `sys.path`."""
    names = sorted(p.stem for p in REPO.iterdir()
                   if p.stem.isidentifier() and p.stem != "quantmla_hf" and (p.is_dir() or p.suffix == ".py"))
    assert "kernels" in names and "tests" in names
    site = tmp_path / "site"
    for name in names:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    code = "import importlib, sys; print('\\n'.join(importlib.import_module(n).__file__ for n in sys.argv[1:]))"
    found = python("-c", code, *names, env={**ENV, "PYTHONPATH": str(site)}).split()
    assert found == [str(site / name / "__init__.py") for name in names]


def test_wheel_ships_the_kernels_inside_the_package(tmp_path):
    """A wheel built from the tree holds `kernels/*.py` as `quantmla_hf/kernels/*.py` (no top-level `kernels`), and
    `quantmla_hf.kernels.mla_decode_ref` imports from it installed."""
    missing = offline_build_missing()
    if missing:
        pytest.skip(f"the wheel is built offline (pip wheel --no-build-isolation) and {missing}")
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".cache", "build", "*.egg-info",
                                                                "__pycache__", ".pytest_cache", ".benchmarks"))
    python("-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
           cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("quantmla_hf-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernels = sorted(p.name for p in (REPO / "kernels").glob("*.py"))
    assert kernels and sorted(n.split("/")[-1] for n in names if n.startswith("quantmla_hf/kernels/")) == kernels
    assert not [n for n in names if n.split("/")[0] == "kernels"]
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    origin = python("-c", "import quantmla_hf.kernels.mla_decode_ref as m; print(m.__file__)", cwd=tmp_path,
                    env={**ENV, "PYTHONPATH": str(site)}).strip()
    assert origin == str(site / "quantmla_hf" / "kernels" / "mla_decode_ref.py")
