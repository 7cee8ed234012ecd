"""push_to_hub -> download -> load against the loopback Hub server of `hub_server.py` (never the public Hub).

huggingface_hub and transformers read HF_ENDPOINT / HF_HOME once, when imported, so the Hub side runs in a child
process started with those variables: this file run as a script is that child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer

HERE = Path(__file__).resolve().parent


def hub_env(endpoint: str, home: Path) -> dict:
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_XET="1", HF_TOKEN="hf_loopback",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0")
    env.pop("HF_HUB_CACHE", None)
    return env


@pytest.fixture()
def hub(tmp_path):
    server = HubServer().start()
    yield server, hub_env(server.endpoint, tmp_path / "hf_home")
    server.stop()


def test_push_download_load_equality(hub, tmp_path):
    server, env = hub
    base = tmp_path / "base"
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(HERE / "test_hub.py"), str(base), str(result)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert not server.state.unknown, f"the client sent requests the server does not know: {server.state.unknown}"
    res = json.loads(result.read_text())
    assert res["logits_equal"] and res["sequences_equal"] and res["reloaded_cache"] == "QuantMLACache"
    assert res["reloaded_attn"] == "quantmla" and res["save_push_logits_equal"]

    for repo_id in ("tester/tiny-quantmla", "tester/tiny-quantmla-save"):
        repo = server.state.repos[("model", repo_id)]
        files = repo.commits[-1][1]
        assert {"config.json", "model.safetensors", "README.md"} <= set(files), sorted(files)
        config = json.loads(files["config.json"])
        assert config["quantization_config"]["quant_method"] == "quantmla"
        card = files["README.md"].decode()
        assert "base_model: tester/tiny-base" in card and "base_model_relation: quantized" in card
        assert "library_name: transformers" in card and "quantmla_hf.saving.model_card" in card
        assert f"from_pretrained(\"{repo_id}\"" in card
        assert '"quant_method": "quantmla"' in card and "| BF16 (`DynamicCache`) |" in card
    header = server.state.repos[("model", "tester/tiny-quantmla")].headers[-1]
    assert header["summary"] == "QuantMLA C4R4" and header["description"] == "pushed by test_hub"
    # the base checkpoint went up as uploaded, untouched
    assert "quantization_config" not in json.loads(server.state.repos[("model", "tester/tiny-base")].commits[-1][1]["config.json"])


def child(base: Path, result: Path) -> None:
    """Upload a BF16 tiny checkpoint, quantize it from the Hub id, push, download, reload and compare."""
    import torch
    from huggingface_hub import HfApi
    from transformers import AutoModelForCausalLM

    from quantmla_hf import QuantMLAConfig
    from quantmla_hf.integration import generated_cache
    from quantmla_hf.tiny_models import tiny_mla_model

    tiny_mla_model("deepseek_v2", seed=5).save_pretrained(base)
    api = HfApi()
    api.create_repo("tester/tiny-base")
    api.upload_folder(repo_id="tester/tiny-base", folder_path=base)

    qconfig = QuantMLAConfig(transform="none", group_size=16, sink_tokens=1, recent_tokens=2)
    model = AutoModelForCausalLM.from_pretrained("tester/tiny-base", quantization_config=qconfig)
    model.push_to_hub("tester/tiny-quantmla", commit_message="QuantMLA C4R4", commit_description="pushed by test_hub")
    reloaded = AutoModelForCausalLM.from_pretrained("tester/tiny-quantmla")

    ids = (torch.arange(11) * 5 % 120 + 2)[None]
    a = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    b = reloaded.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)

    model.save_pretrained(base.parent / "save_push", push_to_hub=True, repo_id="tester/tiny-quantmla-save")
    via_save = AutoModelForCausalLM.from_pretrained("tester/tiny-quantmla-save")
    out = {
        "logits_equal": torch.equal(model(ids).logits, reloaded(ids).logits),
        "sequences_equal": torch.equal(a.sequences, b.sequences),
        "reloaded_cache": type(generated_cache(b)).__name__,
        "reloaded_attn": reloaded.config._attn_implementation,
        "save_push_logits_equal": torch.equal(model(ids).logits, via_save(ids).logits),
    }
    result.write_text(json.dumps(out))


if __name__ == "__main__":
    child(Path(sys.argv[1]), Path(sys.argv[2]))
