"""transformers' own common model tests, from the source distribution of the installed release.

The wheel of transformers has no tests; its PyPI source distribution (sdist) ships `tests/*.py`: the common
mixins (`test_modeling_common.py` with `ModelTesterMixin`, `test_configuration_common.py`, ...), but not the
`tests/generation/` and `tests/exporters/` packages that `test_modeling_common.py` imports its
`GenerationTesterMixin` and `ExportTesterMixin` from. `transformers_test_package()` downloads the sdist of exactly
`transformers.__version__` once (PyPI's simple index, else `pip download`, which honours a configured mirror), checks its sha256, and unpacks `tests/*.py`
into `<repo>/.cache/transformers-tests/<version>/hf_transformers_tests/` (git-ignored; `QUANTMLA_HF_TESTS_CACHE`
moves it). For the two packages the sdist does not ship it writes empty mixins, and says so in
`MISSING_MIXINS`, so the tests depending on them are known to be absent rather than silently passing.

Any failure (no network, an unknown version) raises `SourcesUnavailable` with the reason; the test module turns
it into a module-level skip.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import transformers

PACKAGE = "hf_transformers_tests"
CACHE_ROOT = Path(os.environ.get("QUANTMLA_HF_TESTS_CACHE", Path(__file__).resolve().parents[1] / ".cache" / "transformers-tests"))
SIMPLE_INDEX = "https://pypi.org/simple/transformers/"
DOWNLOAD_TIMEOUT_S = 120

# Modules test_modeling_common.py imports from packages the sdist leaves out: module -> (class, what goes missing).
STAND_INS = {
    "generation/test_utils.py": ("GenerationTesterMixin", "the generate() tests of GenerationTesterMixin"),
    "exporters/test_export.py": ("ExportTesterMixin", "the torch.export tests of ExportTesterMixin"),
}


class SourcesUnavailable(RuntimeError):
    """The transformers test sources could not be obtained (the message says why)."""


def _sdist_from_simple_index(version: str, dest: Path) -> Path:
    """Download `transformers-<version>.tar.gz` listed by PyPI's simple index (PEP 691 JSON, what pip reads) into
    `dest`; verify its sha256."""
    filename = f"transformers-{version}.tar.gz"
    request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT_S) as resp:
        files = json.load(resp).get("files", [])
    info = next((f for f in files if f.get("filename") == filename), None)
    if info is None:
        raise SourcesUnavailable(f"PyPI lists no {filename}")
    with urllib.request.urlopen(info["url"], timeout=DOWNLOAD_TIMEOUT_S) as resp:
        data = resp.read()
    want = info.get("hashes", {}).get("sha256")
    if want is None or hashlib.sha256(data).hexdigest() != want:
        raise SourcesUnavailable(f"{filename} from PyPI does not match its published sha256")
    path = dest / filename
    path.write_bytes(data)
    return path


def _sdist_from_pip(version: str, dest: Path) -> Path:
    """`pip download transformers==version --no-binary :all: --no-deps` (honours pip's index configuration)."""
    cmd = [sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:", "--no-deps",
           "--retries", "1", "--timeout", "30",
           "-q", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10 * DOWNLOAD_TIMEOUT_S)
    found = sorted(dest.glob("transformers-*.tar.gz"))
    if not found:
        raise SourcesUnavailable(f"`{' '.join(cmd[2:])}` failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
    return found[0]


def _unpack_tests(sdist: Path, package_dir: Path) -> None:
    """Copy `<sdist>/tests/*.py` (top level only: the shared mixins) into `package_dir` as a package."""
    package_dir.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py"):
                (package_dir / parts[2]).write_bytes(tar.extractfile(member).read())
            elif member.isfile() and len(parts) == 4 and parts[1] == "tests" and parts[3].endswith(".py") and \
                    f"{parts[2]}/{parts[3]}" in STAND_INS:
                (package_dir / parts[2]).mkdir(exist_ok=True)
                (package_dir / parts[2] / parts[3]).write_bytes(tar.extractfile(member).read())
    if not (package_dir / "test_modeling_common.py").is_file():
        raise SourcesUnavailable(f"{sdist.name} has no tests/test_modeling_common.py")
    (package_dir / "__init__.py").write_text("")
    for rel, (cls, missing) in STAND_INS.items():
        target = package_dir / rel
        target.parent.mkdir(exist_ok=True)
        (target.parent / "__init__.py").touch()
        if not target.exists():
            target.write_text(
                f'"""Not in the transformers sdist: {missing} are not run."""\n\nSHIPPED = False\n\n\n'
                f"class {cls}:\n    pass\n"
            )


def transformers_test_package(version: str | None = None) -> Path:
    """The folder holding package `hf_transformers_tests` for `version` (default: the installed one), cached."""
    version = version or transformers.__version__
    root = CACHE_ROOT / version
    if (root / PACKAGE / "test_modeling_common.py").is_file():
        return root
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        sdist = None
        for fetch in (_sdist_from_simple_index, _sdist_from_pip):
            try:
                sdist = fetch(version, Path(tmp))
                break
            except (OSError, ValueError, subprocess.SubprocessError, SourcesUnavailable) as err:
                errors.append(f"{fetch.__name__}: {err}")
        if sdist is None:
            raise SourcesUnavailable(
                f"could not download the transformers {version} source distribution ({'; '.join(errors)})"
            )
        CACHE_ROOT.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=CACHE_ROOT, prefix=f".{version}-"))
        try:
            _unpack_tests(sdist, staging / PACKAGE)
            if not root.exists():
                staging.rename(root)  # atomic: a concurrent run sees all of it or none
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root


def import_modeling_common(version: str | None = None):
    """`hf_transformers_tests.test_modeling_common` of the installed transformers (downloads once)."""
    root = transformers_test_package(version)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"{PACKAGE}.test_modeling_common")
    except ImportError as err:
        raise SourcesUnavailable(
            f"transformers' test_modeling_common.py needs a module that is not installed ({err}); "
            "install the test extra: pip install -e '.[dev]'"
        ) from err


def shipped(rel: str) -> bool:
    """Whether the sdist shipped `rel` (a key of `STAND_INS`), as opposed to our empty stand-in."""
    module = importlib.import_module(f"{PACKAGE}.{rel[:-3].replace('/', '.')}")
    return getattr(module, "SHIPPED", True)

