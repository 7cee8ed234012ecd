"""Writing an output folder safely: checked before the long work, written beside it, moved in at the end.

Every writer of the library (`save_pretrained` of a QuantMLA model, `quantmla quantize --out`, calibration and
analysis reports) goes through `staged_directory`:

1. `check_destination` runs first, before any model loads or calibration starts: a destination that is a file,
   that cannot be written, or that already holds a checkpoint (unless the caller says overwrite) is refused with a
   one-line `OutputError` naming the fix.
2. The writer fills a fresh hidden sibling folder (`.NAME.<random>.partial`, same file system, so the final moves
   are renames, never copies).
3. Under a lock on the parent folder (concurrent writers queue there), the destination is checked again (another
   writer may have finished meanwhile), then the staged files move in: a new destination is one `rename` of the
   whole folder; an existing folder receives each file by `os.replace`, and weight files of an overwritten
   checkpoint that the new save did not write are removed (no stale shards beside new ones). Files that are not
   part of the save (notes, secrets, other folders) stay untouched.
4. On any failure (disk full, read-only file system, interrupted), the staging folder is removed: the destination
   is either as it was or holds the whole new output.

`StagedOutput.files` lists what the write produced (paths relative to the destination, "/"-separated): exactly
what a push of this save uploads.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the per-file renames still never mix half-written files
    fcntl = None

# Files that make a folder a checkpoint: a second save into it replaces a model (refused unless told).
CHECKPOINT_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# Weight files of a previous checkpoint that must not survive beside the new one's (transformers' shard names).
WEIGHT_PATTERNS = ("model*.safetensors", "model*.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model*.bin.index.json")

_OS_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


class OutputError(OSError):
    """A destination that cannot take the output; the message is one line and says what to do."""


@dataclass
class StagedOutput:
    """The staging folder a writer fills (`path`) and, once moved in, the files it wrote (`files`)."""

    destination: Path
    path: Path
    files: list[str] = field(default_factory=list)


def holds_checkpoint(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in CHECKPOINT_MARKERS)


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def check_destination(path, overwrite: bool = False, overwrite_hint: str = "overwrite=True") -> Path:
    """`path` as a `Path` if an output can go there, else an `OutputError` (checked before any long work).

    Refused: a path that is a file; a folder (or the nearest existing parent of a new one) this process cannot
    write; a folder that already holds a checkpoint, unless `overwrite` (`overwrite_hint` names the option).
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path} is a file, not a folder; choose a folder for the output")
    if holds_checkpoint(path) and not overwrite:
        raise OutputError(f"{path} already holds a checkpoint; pass {overwrite_hint} to replace it, or choose a "
                          "new folder")
    _check_writable(_nearest_existing(path.parent if not path.exists() else path), path)
    return path


def _check_writable(existing: Path, path: Path) -> None:
    """Refuse `path` when `existing` (the nearest existing folder on its way) is a file or cannot be written."""
    if not existing.is_dir():
        raise OutputError(f"cannot create {path}: {existing} is a file, not a folder; choose another location")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write to {existing} (read-only or no permission); choose a writable folder")


def describe_os_error(err: OSError, path) -> str:
    """One line for a failed write: what happened to which path and what to do."""
    reason = _OS_REASONS.get(err.errno, err.strerror or str(err))
    code = errno.errorcode.get(err.errno, "")
    return (f"could not write {path}: {reason}" + (f" ({code})" if code else "")
            + "; nothing was left half-written there. Free space or choose another destination")


@contextlib.contextmanager
def _parent_lock(path: Path):
    """Exclusive lock on `path`'s parent folder: one writer at a time moves its files in."""
    if fcntl is None:
        yield
        return
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _relative_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _move_in(staging: Path, destination: Path, files: list[str]) -> None:
    try:
        os.rename(staging, destination)  # a new (or empty) destination: the whole folder at once
        return
    except OSError as err:
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
            raise
    written = set(files)
    for old in _relative_files(destination):
        if old not in written and any(fnmatch.fnmatch(old, pattern) for pattern in WEIGHT_PATTERNS):
            os.remove(destination / old)
    for rel in files:
        target = destination / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, target)


@contextlib.contextmanager
def staged_directory(path, overwrite: bool = False, overwrite_hint: str = "overwrite=True"):
    """Yield a `StagedOutput` whose `.path` the caller fills; move it to `path` when the block ends without error.

    Raises `OutputError` (one line) for a destination refused by `check_destination` (before the block runs) and
    for a write that fails with disk full, read-only, quota or permission errors; other errors pass through. In
    every failure the staging folder is removed and `path` is left as it was.
    """
    destination = check_destination(path, overwrite, overwrite_hint)
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".partial", dir=destination.parent))
    except OSError as err:
        raise OutputError(describe_os_error(err, destination)) from err
    out = StagedOutput(destination=destination, path=staging)
    try:
        yield out
        out.files = _relative_files(staging)
        with _parent_lock(destination):
            check_destination(destination, overwrite, overwrite_hint)  # another writer may have finished first
            _move_in(staging, destination, out.files)
    except OutputError as err:
        cause = err.__cause__
        if isinstance(cause, OSError) and cause.errno in _OS_REASONS:  # a nested writer's failure: name our path
            raise OutputError(describe_os_error(cause, destination)) from cause
        raise
    except OSError as err:
        if err.errno in _OS_REASONS:
            raise OutputError(describe_os_error(err, destination)) from err
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_file_destination(path) -> Path:
    """`path` as a `Path` if a file can be written there (its folder, or the nearest existing parent, is writable),
    else an `OutputError`; checked before the work whose result goes there."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputError(f"{path} is a folder; give a file name")
    _check_writable(_nearest_existing(path.parent), path)
    return path


def write_text_atomic(path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` through a temporary sibling and a rename: readers see the old or the new
    file, never part of one; a failed write (disk full, read-only) raises a one-line `OutputError`."""
    path = check_file_destination(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        if err.errno in _OS_REASONS:
            raise OutputError(describe_os_error(err, path)) from err
        raise
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return path
