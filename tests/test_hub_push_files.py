"""A push uploads exactly the files of the save, never other files lying in the folder (loopback Hub only)."""

from __future__ import annotations

import huggingface_hub
import pytest
from hub_server import HubServer
from huggingface_hub.utils import _http

from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.tiny_models import tiny_mla_model


@pytest.fixture()
def hub(monkeypatch):
    server = HubServer().start()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_loopback")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True, raising=False)
    yield server
    server.stop()
    huggingface_hub.set_client_factory(_http.default_client_factory)


def _model():
    config = QuantMLAConfig(transform="none", group_size=16, sink_tokens=1, recent_tokens=2)
    return apply_quantmla(tiny_mla_model("deepseek_v2", seed=3), config)


def _uploaded(server, repo_id: str) -> set[str]:
    return set(server.state.repos[("model", repo_id)].commits[-1][1])


def test_save_and_push_uploads_only_what_the_save_wrote(hub, tmp_path):
    folder = tmp_path / "run"
    (folder / "optimizer_states").mkdir(parents=True)
    (folder / "optimizer_states" / "rank0.pt").write_bytes(b"not for the hub")
    (folder / "secret.env").write_text("HF_TOKEN=hf_private\n")
    model = _model()
    model.save_pretrained(folder, push_to_hub=True, repo_id="tester/via-save")
    model.push_to_hub("tester/via-push")

    via_save, via_push = _uploaded(hub, "tester/via-save"), _uploaded(hub, "tester/via-push")
    assert "secret.env" not in via_save and not any(f.startswith("optimizer_states") for f in via_save), via_save
    assert {"config.json", "model.safetensors", "README.md"} <= via_save
    assert via_save == via_push  # the two paths upload the same files
    assert (folder / "secret.env").exists() and (folder / "optimizer_states" / "rank0.pt").exists()  # left alone


def test_a_second_save_and_push_uploads_its_own_files_only(hub, tmp_path):
    folder = tmp_path / "run"
    model = _model()
    model.save_pretrained(folder)
    (folder / "notes.txt").write_text("private notes")
    model.save_pretrained(folder, push_to_hub=True, repo_id="tester/again")
    assert "notes.txt" not in _uploaded(hub, "tester/again")


def test_cli_push_uploads_only_the_output_of_the_command(hub, tmp_path, capsys):
    from quantmla_hf.cli.main import main

    base, out = tmp_path / "base", tmp_path / "out"
    tiny_mla_model("deepseek_v2", seed=3).save_pretrained(base)
    out.mkdir()
    (out / "secret.env").write_text("HF_TOKEN=hf_private\n")
    rc = main(["quantize", str(base), "--out", str(out), "--transform", "none", "--group-size", "16",
               "--push-to-hub", "tester/via-cli"])
    assert rc == 0, capsys.readouterr().err
    uploaded = _uploaded(hub, "tester/via-cli")
    assert "secret.env" not in uploaded and {"config.json", "model.safetensors", "README.md"} <= uploaded
    assert "from_pretrained(\"tester/via-cli\"" in hub.state.repos[("model", "tester/via-cli")].commits[-1][1][
        "README.md"].decode()
