"""What ships inside the package: the embedded reference model and its texts (nothing is downloaded for them).

    REFERENCE_MODEL   a 14.8M-parameter DeepSeek-V3-architecture checkpoint with its tokenizer (d_c 256, d_R 64,
                      6 layers; trained by benchmarks/reference_model/)
    CALIBRATION_TEXT  959 tokens of text to calibrate it on in a demo
    EVALUATION_TEXT   held-out text for its perplexity
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
REFERENCE_MODEL = ASSETS / "reference_model"
CALIBRATION_TEXT = ASSETS / "calibration_text.txt"
EVALUATION_TEXT = ASSETS / "evaluation_text.txt"
