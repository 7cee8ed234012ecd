"""Learn the QuantMLA transforms from a text file at load time (2-bit content), save the calibrated checkpoint.

Real model: MODEL=deepseek-ai/DeepSeek-V2-Lite TEXT=wiki.train.txt python examples/calibrate_on_text_file.py
(with the library defaults: 64 sequences of 512 tokens, 100 steps per layer and path).
"""

import os
import tempfile

from transformers import AutoModelForCausalLM

import quantmla_hf
from _tiny import CALIBRATION_FILE, model_id as offline_or_env

model_id = offline_or_env()
small = "MODEL" not in os.environ  # keep the offline run short
config = quantmla_hf.QuantMLAConfig(
    content_bits=2, rope_bits=4, transform="learned", calibration_data=os.environ.get("TEXT", CALIBRATION_FILE),
    advanced=dict(calibration_samples=4, calibration_seq_len=32, calibration_steps=3) if small else None,
)
model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=config)  # tokenizer: the checkpoint's
out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="quantmla-calibrated-")
model.save_pretrained(out_dir)
print(f"calibrated={model.config.quantization_config.calibrated}, saved to {out_dir}")
