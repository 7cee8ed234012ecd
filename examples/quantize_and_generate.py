"""Load an MLA checkpoint with a 4-bit QuantMLA KV cache and generate; generate() builds the cache by itself.

Real model: MODEL=deepseek-ai/DeepSeek-V2-Lite-Chat python examples/quantize_and_generate.py
(runs offline on a tiny random model with the reference tokenizer when MODEL is unset).
"""

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantmla_hf  # registers quant_method "quantmla" with transformers
from _tiny import model_id as offline_or_env

model_id = offline_or_env()
config = quantmla_hf.QuantMLAConfig(content_bits=4, rope_bits=4, transform="none")  # RTN: no calibration data
model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=config, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(model_id)

inputs = tokenizer("The history of the city", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
cache = quantmla_hf.integration.generated_cache(out)
print(tokenizer.decode(out.sequences[0], skip_special_tokens=True))
print(f"{type(cache).__name__} {config.name}: {cache.get_seq_length()} tokens, {cache.nbytes()} bytes allocated")
