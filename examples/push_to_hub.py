"""Push a QuantMLA checkpoint and its model card to a Hub endpoint, then load it back from there.

The endpoint is HF_ENDPOINT (the public Hub when unset); set HF_TOKEN for write access. Offline check:
    python tests/hub_server.py   # prints e.g. http://127.0.0.1:40123
    HF_ENDPOINT=http://127.0.0.1:40123 HF_TOKEN=x HF_HUB_DISABLE_XET=1 python examples/push_to_hub.py
Real model: MODEL=deepseek-ai/DeepSeek-V2-Lite REPO=you/DeepSeek-V2-Lite-QuantMLA-C4R4 python examples/push_to_hub.py
"""

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantmla_hf
from _tiny import model_id as offline_or_env

model_id = offline_or_env()
repo_id = os.environ.get("REPO", "tester/quantmla-example")
model = AutoModelForCausalLM.from_pretrained(
    model_id, quantization_config=quantmla_hf.QuantMLAConfig(content_bits=4, transform="none")
)
model.push_to_hub(repo_id)  # weights + config.json + README.md rendered from model_cards/quantmla_model_card.md
AutoTokenizer.from_pretrained(model_id).push_to_hub(repo_id)

downloaded = AutoModelForCausalLM.from_pretrained(repo_id)
ids = torch.arange(1, 17)[None]
print(f"pushed and reloaded {repo_id}: identical logits {torch.equal(model(ids).logits, downloaded(ids).logits)}")
