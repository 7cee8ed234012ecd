"""Calibration of the QuantMLA cache transforms: learned (QuantMLA), SmoothQuant- and QuaRot-style baselines.

`calibrate(model, quantization_config, calibration_data, tokenizer=None)` captures each MLA attention module's
inputs, learns (or computes) its content and RoPE transforms, fuses them into the weights and moves on.
The math is in docs/CALIBRATION.md.
"""

from .fusion import fuse_content, fuse_rope
from .pipeline import calibrate, calibration_token_ids
from .transforms import rope_layout

__all__ = ["calibrate", "calibration_token_ids", "fuse_content", "fuse_rope", "rope_layout"]
