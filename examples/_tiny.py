"""Shared by the examples: an offline stand-in for a real checkpoint.

`tiny_checkpoint()` saves (once per process) a tiny random DeepSeek-V3-architecture model from
`quantmla_hf.tiny_models` with the tokenizer of the embedded reference model, so every example runs in seconds on
a CPU without a download. Its text is random; set MODEL=<hub id or directory> to run on a real checkpoint.
"""

import os
import tempfile

from quantmla_hf.embedded import CALIBRATION_TEXT, REFERENCE_MODEL

CALIBRATION_FILE = str(CALIBRATION_TEXT)
_PATH = None


def tiny_checkpoint() -> str:
    global _PATH
    if _PATH is None:
        from transformers import AutoTokenizer

        from quantmla_hf.tiny_models import tiny_mla_model

        _PATH = tempfile.mkdtemp(prefix="quantmla-tiny-")
        tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
        tiny_mla_model("deepseek_v3", vocab_size=len(tokenizer)).save_pretrained(_PATH)
        tokenizer.save_pretrained(_PATH)
    return _PATH


def model_id() -> str:
    return os.environ.get("MODEL") or tiny_checkpoint()
