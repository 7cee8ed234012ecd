"""pipeline("text-generation") on a QuantMLA model: no extra argument, the packed cache is used.

Real model: MODEL=moonshotai/Moonlight-16B-A3B-Instruct python examples/pipeline.py
"""

import os

from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import quantmla_hf
from _tiny import model_id as offline_or_env

model_id = offline_or_env()
model = AutoModelForCausalLM.from_pretrained(
    model_id, quantization_config=quantmla_hf.QuantMLAConfig(content_bits=4, transform="hadamard")
)
generator = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(model_id))
print(generator(["Once upon a time", "The river"], max_new_tokens=16, do_sample=False))
