"""Writing an output folder safely: checked before the long work, written beside it, moved in at the end.

Every writer of the library goes through this module: `save_pretrained` of a QuantMLA model, `quantmla quantize
--out` and `quantmla analyze --out` fill a `staged_directory`; `quantmla eval --json` calls `write_text_atomic`; the
calibration checkpoint (`quantmla_hf.calibration.checkpoint`) and the folder `push_to_hub` uploads from write
inside `write_errors`.

1. `check_destination` runs first, before any model loads or calibration starts: a destination that is a file,
   under a file, that cannot be written, or that already holds a checkpoint (unless the caller says overwrite) is
   refused with a one-line `OutputError` naming the fix. Missing parent folders are created, as transformers'
   `save_pretrained` creates them.
2. The writer fills a fresh hidden sibling folder (`.NAME.<random>.partial`, same file system, so the final moves
   are renames, never copies).
3. Under a lock on the parent folder (concurrent writers queue there), the destination is checked again (another
   writer may have finished meanwhile), then the staged files move in: a new destination is one `rename` of the
   whole folder; an existing folder receives each file by `os.replace`, and weight files of an overwritten
   checkpoint that the new save did not write are removed (no stale shards beside new ones). Files that are not
   part of the save (notes, secrets, other folders) stay untouched.
4. On any failure (disk full, read-only file system, interrupted), the staging folder is removed: the destination
   is either as it was or holds the whole new output.

A failed write is one `OutputError` line naming the destination, the cause and what to do, whatever raised it: an
`OSError` (disk full, quota, read-only, permission, file too large, I/O error); safetensors' `SafetensorError`,
which is not an `OSError` ("Error while serializing: I/O error: No space left on device (os error 28)"); or the
`RuntimeError` of torch.save's stream writer, which names no cause (reported as a full disk when the file system has
no space left). Errors that are not the storage's (a tensor safetensors cannot serialize, a bug) pass through.

Permissions are those an ordinary `mkdir`/`open` gives under the current umask (0755 folders and 0644 files under
umask 022), not the 0700/0600 of temporary files (safetensors >= 0.8 writes through one); a file that replaces one
already in the destination keeps that file's permission bits, as writing over it would.

`StagedOutput.files` lists what the write produced (paths relative to the destination, "/"-separated): exactly
what a push of this save uploads.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
import secrets
import shutil
import stat
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

_FREE_SPACE = "Free space or choose another destination"
_WRITABLE = "Choose a writable destination"
# errno of a failed write -> (what happened, what to do)
_OS_REASONS = {
    errno.ENOSPC: ("no space left on the device", _FREE_SPACE),
    errno.EDQUOT: ("disk quota exceeded", _FREE_SPACE),
    errno.EFBIG: ("file too large for the file system or the process's file size limit",
                  "Choose another destination or raise the file size limit (ulimit -f)"),
    errno.EROFS: ("the file system is read-only", _WRITABLE),
    errno.EACCES: ("permission denied", _WRITABLE),
    errno.EPERM: ("operation not permitted", _WRITABLE),
    errno.ENAMETOOLONG: ("file name too long", "Choose a shorter destination"),
    errno.EIO: ("input/output error", "Check the disk and its quota, or choose another destination"),
}
# safetensors names the OS error in its message: "I/O error: ... (os error 28)" (0.8), "IoError(Os { code: 28, ..."
# (0.4).
_SAFETENSORS_OS_ERROR = re.compile(r"os error (\d+)|Os \{ code: (\d+)")
# torch.save's stream writer on a failed write: "[enforce fail at inline_container.cc:...] . unexpected pos 576 vs
# 534", raised while handling "basic_ios::clear: iostream error"; neither names the cause.
_TORCH_WRITER_FAILURES = ("inline_container", "PytorchStreamWriter", "iostream error")
# Below this much free space a write that failed without saying why is taken for a full disk.
_FULL_BYTES = 1 << 20


class OutputError(OSError):
    """A destination that cannot take the output; the message is one line and says what to do.

    `failure` is the `OSError` behind a write that failed (None for a destination refused before writing).
    """

    def __init__(self, message: str, *, failure: OSError | None = None):
        super().__init__(message)
        self.failure = failure


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

    Refused: a path that is a file or lies under one; a folder (or the nearest existing parent of a new one) this
    process cannot write; a folder that already holds a checkpoint, unless `overwrite` (`overwrite_hint` names the
    option). Missing parents are fine: `staged_directory` creates them.
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


def describe_os_error(err: OSError, path, fix: str | None = None) -> str:
    """One line for a failed write: what happened to which path and what to do (`fix`, a sentence, else the
    cause's advice)."""
    reason, default_fix = _OS_REASONS.get(err.errno, (err.strerror or str(err), "Choose another destination"))
    code = errno.errorcode.get(err.errno, "")
    return (f"could not write {path}: {reason}" + (f" ({code})" if code else "")
            + f"; nothing was left half-written there. {fix or default_fix}")


def _free_bytes(path) -> int | None:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(_nearest_existing(Path(path))).free
    return None


def _storage_error(err: BaseException, path) -> OSError | None:
    if isinstance(err, OSError):
        return err if err.errno in _OS_REASONS else None
    message = str(err)
    if type(err).__name__ == "SafetensorError":
        found = _SAFETENSORS_OS_ERROR.search(message)
        if found:
            code = int(found.group(1) or found.group(2))
            return OSError(code, os.strerror(code))
        if "I/O error" not in message and "IoError" not in message:
            return None  # not the storage's failure (e.g. a tensor it cannot serialize)
    elif not (isinstance(err, RuntimeError) and any(m in message for m in _TORCH_WRITER_FAILURES)):
        return None
    free = _free_bytes(path)
    code = errno.ENOSPC if free is not None and free < _FULL_BYTES else errno.EIO
    return OSError(code, os.strerror(code))


def write_failure(err: BaseException, path) -> OSError | None:
    """The `OSError` behind `err` (or an exception it was raised from or while handling) when that is a write into
    `path` the storage refused, else None.

    `OutputError` gives its `failure`; an `OSError` itself when its errno is a storage failure (`_OS_REASONS`);
    safetensors' `SafetensorError` the OS error its message names; torch.save's stream-writer `RuntimeError`
    ENOSPC when the file system of `path` has (almost) no space left, else EIO.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OutputError):  # already one line: a write's failure or a refused destination
            return err.failure
        seen.add(id(err))
        found = _storage_error(err, path)
        if found is not None:
            return found
        err = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def write_errors(path, fix: str | None = None):
    """Turn a write under `path` that the storage refuses into a one-line `OutputError` naming `path` and what to do
    (`fix` replaces the cause's advice); other errors pass through. The caller leaves nothing half-written."""
    try:
        yield
    except Exception as err:
        failure = write_failure(err, path)
        if failure is None:
            raise
        raise OutputError(describe_os_error(failure, path, fix), failure=failure) from err


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


def _new_sibling(path: Path, make):
    """`make(candidate)` for a fresh hidden sibling `.NAME.<random>.partial` of `path`; returns what it returns."""
    for _ in range(100):
        candidate = path.parent / f".{path.name}.{secrets.token_hex(4)}.partial"
        with contextlib.suppress(FileExistsError):
            return make(candidate)
    raise FileExistsError(errno.EEXIST, f"no free name for a staging sibling of {path}")


def _make_staging(destination: Path) -> Path:
    """A new staging folder beside `destination`, made by a plain `mkdir` (the umask's permissions, which the
    destination takes when the folder is renamed there; `tempfile.mkdtemp` would give 0700)."""
    def make(candidate: Path) -> Path:
        os.mkdir(candidate)
        return candidate

    return _new_sibling(destination, make)


def _ordinary_permissions(staging: Path, destination: Path) -> None:
    """Give the staged folders and files the permissions a plain `mkdir`/`open` would; a file replacing one of the
    destination keeps that file's bits."""
    folder_bits = stat.S_IMODE(staging.stat().st_mode) & 0o777  # a plain mkdir's: 0o777 & ~umask
    for staged in staging.rglob("*"):
        if staged.is_symlink():
            continue
        existing = destination / staged.relative_to(staging)
        if staged.is_dir():
            if not existing.is_dir():
                os.chmod(staged, folder_bits)
        elif existing.is_file():
            os.chmod(staged, stat.S_IMODE(existing.stat().st_mode))
        else:
            os.chmod(staged, (0o777 if staged.stat().st_mode & 0o111 else 0o666) & folder_bits)


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
    for a write the storage refuses (`write_failure`: disk full, quota, read-only, permission, safetensors' and
    torch.save's I/O errors); other errors pass through. In every failure the staging folder is removed and `path`
    is left as it was.
    """
    destination = check_destination(path, overwrite, overwrite_hint)
    with write_errors(destination):
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = _make_staging(destination)
    out = StagedOutput(destination=destination, path=staging)
    try:
        with write_errors(destination):
            yield out
            out.files = _relative_files(staging)
            with _parent_lock(destination):
                check_destination(destination, overwrite, overwrite_hint)  # another writer may have finished first
                _ordinary_permissions(staging, destination)
                _move_in(staging, destination, out.files)
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
    file, never part of one; a write the storage refuses raises a one-line `OutputError`. The file gets a plain
    `open`'s permissions (an existing file's are kept); missing parent folders are created."""
    path = check_file_destination(path)
    tmp = None
    try:
        with write_errors(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp, fd = _new_sibling(path, lambda c: (c, os.open(c, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            if path.is_file():
                os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
            os.replace(tmp, path)
            tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return path
