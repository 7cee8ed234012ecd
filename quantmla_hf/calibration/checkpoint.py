"""Resumable calibration: the transforms of every finished decoder layer, one file per layer.

`calibrate(..., checkpoint_dir=DIR)` writes, after each decoder layer, `DIR/layer_{index:05d}.pt` holding for each of
its MLA attention modules the transforms it fused (content `rotation [d_c, d_c]`, `scale [d_c]`; RoPE
`theta [d_R/2]`, `scale [d_R/2]`, fp32 as learned) and the calibration record entry. Files are written to a
temporary name and renamed (atomic on POSIX), so a killed run leaves only whole layers; a write the storage refuses
(disk full, quota) removes its temporary file and raises a one-line `OutputError` (`quantmla_hf.saving.staged_output`).
`DIR/manifest.json` holds a fingerprint of what was calibrated (model config, QuantMLA settings, the calibration
token ids); a rerun with the same fingerprint re-fuses the finished layers from their files (the same fusion calls on
the same original weights, so the result is bitwise that of an uninterrupted run) and calibrates from the first
missing layer on.
A different fingerprint is refused: the transforms of one model or text do not belong to another.

Size: `4 d_c^2 + 4 d_c + 4 d_R` bytes per attention module (1.0 MiB for d_c 512), not the fused weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..saving.staged_output import write_errors

MANIFEST = "manifest.json"


def fingerprint(model_config, settings: dict, token_ids: torch.Tensor) -> dict:
    """What a checkpoint belongs to: sha256 of the model config's JSON and of the token ids, and `settings`."""
    config_json = model_config.to_json_string(use_diff=False) if hasattr(model_config, "to_json_string") else repr(model_config)
    ids = token_ids.detach().cpu().contiguous().to(torch.int64)
    return {
        "model_config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
        "token_ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        "token_ids_shape": list(ids.shape),
        "settings": settings,
    }


class CalibrationCheckpoint:
    """The checkpoint directory of one calibration run (created if missing)."""

    def __init__(self, directory: str | os.PathLike, expected: dict):
        self.dir = Path(directory)
        with write_errors(self.dir):
            self.dir.mkdir(parents=True, exist_ok=True)
        manifest = self.dir / MANIFEST
        if manifest.exists():
            found = json.loads(manifest.read_text())
            if found != expected:
                differ = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
                raise ValueError(f"checkpoint_dir {str(self.dir)!r} holds a calibration of another model, text or "
                                 f"setting (differs in {', '.join(differ)}); give an empty directory to start over")
        else:
            _atomic_write(manifest, lambda tmp: tmp.write_bytes(json.dumps(expected, indent=1).encode()))

    def _path(self, index: int) -> Path:
        return self.dir / f"layer_{index:05d}.pt"

    def load(self, index: int) -> list[dict] | None:
        """The saved `[{"transforms": ..., "entry": ...}]` of decoder layer `index` (one per attention module), or
        None when that layer did not finish."""
        path = self._path(index)
        return torch.load(path, map_location="cpu", weights_only=True) if path.exists() else None

    def save(self, index: int, modules: list[dict]) -> None:
        _atomic_write(self._path(index), lambda tmp: torch.save(modules, tmp))

    def finished(self) -> int:
        return sum(1 for _ in self.dir.glob("layer_*.pt"))


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)` to a temporary sibling of `path`, renamed to `path` once whole; a failed write leaves no file."""
    tmp = path.with_suffix(".tmp")
    try:
        with write_errors(path):
            write(tmp)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
