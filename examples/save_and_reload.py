"""Quantize, save (safetensors + quantization_config + model card), reload with a plain from_pretrained.

Real model: MODEL=zai-org/GLM-4.7-Flash OUT=glm-4.7-flash-quantmla-c4r4 python examples/save_and_reload.py
"""

import os
import tempfile

import torch
from transformers import AutoModelForCausalLM

import quantmla_hf
from _tiny import model_id as offline_or_env

model_id = offline_or_env()
out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="quantmla-")
model = AutoModelForCausalLM.from_pretrained(
    model_id, quantization_config=quantmla_hf.QuantMLAConfig(content_bits=2, rope_bits=4, transform="hadamard")
)
model.save_pretrained(out_dir)
print("saved:", sorted(os.listdir(out_dir)))

reloaded = AutoModelForCausalLM.from_pretrained(out_dir)  # config.json carries the quantization_config
ids = torch.arange(1, 33)[None]
same = torch.equal(model(ids).logits, reloaded(ids).logits)
print(f"reloaded {reloaded.config.quantization_config.name}, identical logits: {same}")
assert same
