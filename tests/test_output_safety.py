"""Outputs are checked before the work, written beside the destination and moved in whole (CLI and save_pretrained).

The disk-full case patches the weights writer to fail as a full disk does (after part of the file is written); the
read-only case patches `os.access` (the tests run as root, for whom chmod does not make a folder read-only).
"""

from __future__ import annotations

import errno
import json
import threading

import pytest
import transformers.modeling_utils
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import quantmla_hf.cli
import quantmla_hf.integration
import quantmla_hf.staged_output
from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.cli import main
from quantmla_hf.staged_output import OutputError
from quantmla_hf.tiny_models import tiny_mla_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tiny_mla_model("deepseek_v3", seed=6).save_pretrained(path)
    return path


def quantize(base_dir, out, capsys, *extra):
    rc = main(["quantize", str(base_dir), "--out", str(out), "--transform", "none", "--group-size", "16", *extra])
    captured = capsys.readouterr()
    return rc, captured.err.strip(), captured.out


def no_loading(monkeypatch):
    """Make loading a model fail loudly: the check under test must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the destination was checked")
    monkeypatch.setattr(quantmla_hf.cli.AutoModelForCausalLM, "from_pretrained", refuse)


def leftovers(folder):
    return [p.name for p in folder.parent.iterdir() if p.name.endswith(".partial")]


def test_existing_checkpoint_is_refused_before_loading_unless_overwrite(base_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "q"
    assert quantize(base_dir, out, capsys)[0] == 0
    with monkeypatch.context() as m:
        no_loading(m)
        rc, err, stdout = quantize(base_dir, out, capsys, "--content-bits", "2")
    assert rc == 1 and "Traceback" not in err and "saved" not in stdout
    assert err == f"quantmla quantize: error: {out} already holds a checkpoint; pass --overwrite to replace it, or " \
                  "choose a new folder"
    assert quantize(base_dir, out, capsys, "--content-bits", "2", "--overwrite")[0] == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["content_bits"] == 2


def read_only_folder(tmp_path, monkeypatch):
    """A folder the output checks see as read-only (`os.access` says so: the tests run as root, whom chmod does
    not stop)."""
    parent = tmp_path / "readonly"
    parent.mkdir()
    real_access = quantmla_hf.staged_output.os.access
    monkeypatch.setattr(quantmla_hf.staged_output.os, "access",
                        lambda p, mode: False if str(p) == str(parent) else real_access(p, mode))
    return parent


def test_read_only_destination_is_refused_before_loading(base_dir, tmp_path, capsys, monkeypatch):
    parent = read_only_folder(tmp_path, monkeypatch)
    no_loading(monkeypatch)
    rc, err, _ = quantize(base_dir, parent / "q", capsys)
    assert rc == 1 and len(err.splitlines()) == 1
    assert err.startswith(f"quantmla quantize: error: cannot write to {parent} (read-only or no permission)")


def test_file_as_destination_and_missing_model_path_are_one_line(base_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    rc, err, _ = quantize(base_dir, tmp_path / "file", capsys)
    assert rc == 1 and err == f"quantmla quantize: error: {tmp_path / 'file'} is a file, not a folder; choose a " \
                              "folder for the output"
    rc, err, _ = quantize(tmp_path / "no" / "such" / "model", tmp_path / "q", capsys)
    assert rc == 1 and "no such directory" in err and "Repo id" not in err and len(err.splitlines()) == 1


def test_disk_full_leaves_nothing_half_written(base_dir, tmp_path, capsys, monkeypatch):
    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)  # part of the file, as a full disk leaves it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    out = tmp_path / "q"
    rc, err, stdout = quantize(base_dir, out, capsys)
    assert rc == 1 and "Traceback" not in err and "saved" not in stdout
    (line,) = [line for line in err.splitlines() if "error" in line]  # the rest is the progress bar
    assert line.startswith(f"quantmla quantize: error: could not write {out}: no space left on the device (ENOSPC)")
    assert not out.exists() and not leftovers(out)


def test_disk_full_keeps_an_existing_checkpoint_whole(base_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "q"
    assert quantize(base_dir, out, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    assert quantize(base_dir, out, capsys, "--content-bits", "2", "--overwrite")[0] == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not leftovers(out)


def _writers(monkeypatch):
    """Two differently quantized models whose saves are both past the destination check before either finishes."""
    barrier = threading.Barrier(2, timeout=30)
    real_card = quantmla_hf.integration.write_model_card

    def card_after_both_started(*args, **kwargs):
        barrier.wait()
        return real_card(*args, **kwargs)

    monkeypatch.setattr(quantmla_hf.integration, "write_model_card", card_after_both_started)
    return [apply_quantmla(tiny_mla_model("deepseek_v3", seed=s), QuantMLAConfig(transform="none", group_size=16,
                                                                                 content_bits=b))
            for s, b in ((1, 4), (2, 2))]


def _save_concurrently(models, out, **kwargs):
    results = [None, None]

    def save(i):
        try:
            models[i].save_pretrained(out, **kwargs)
            results[i] = "saved"
        except OutputError as err:
            results[i] = str(err)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _consistent(models, out) -> int:
    """The index of the model whose config, card and weights are all in `out` (fails on a mix)."""
    bits = json.loads((out / "config.json").read_text())["quantization_config"]["content_bits"]
    (i,) = [i for i, m in enumerate(models) if m.config.quantization_config.content_bits == bits]
    assert f"C{bits}R4" in (out / "README.md").read_text()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        name = next(iter(f.keys()))
        assert f.get_tensor(name).equal(models[i].state_dict()[name])
    return i


def test_two_concurrent_writers_one_wins_the_other_is_told(tmp_path, monkeypatch):
    models = _writers(monkeypatch)
    out = tmp_path / "q"
    results = _save_concurrently(models, out, overwrite=False)
    assert sorted(r == "saved" for r in results) == [False, True], results
    loser = results.index(next(r for r in results if r != "saved"))
    assert "already holds a checkpoint" in results[loser]
    assert _consistent(models, out) == 1 - loser and not leftovers(out)


def test_two_concurrent_overwriting_writers_leave_one_whole_checkpoint(tmp_path, monkeypatch):
    models = _writers(monkeypatch)
    out = tmp_path / "q"
    assert _save_concurrently(models, out, overwrite=True) == ["saved", "saved"]
    _consistent(models, out)
    assert not leftovers(out)
    assert AutoModelForCausalLM.from_pretrained(out).config.quantization_config.transform == "none"


def test_save_pretrained_replaces_a_checkpoint_as_transformers_does_or_refuses_when_asked(tmp_path):
    model = apply_quantmla(tiny_mla_model("deepseek_v3", seed=1), QuantMLAConfig(transform="none", group_size=16))
    model.save_pretrained(tmp_path / "q")
    with pytest.raises(OutputError, match="pass overwrite=True"):
        model.save_pretrained(tmp_path / "q", overwrite=False)
    (tmp_path / "q" / "model-00001-of-00002.safetensors").write_bytes(b"a stale shard of an older save")
    model.save_pretrained(tmp_path / "q")
    assert not (tmp_path / "q" / "model-00001-of-00002.safetensors").exists()  # no stale shard beside the new one


def test_eval_json_destination_is_checked_before_the_evaluation(base_dir, tmp_path, capsys, monkeypatch):
    from quantmla_hf.demo import EVALUATION_TEXT

    parent = read_only_folder(tmp_path, monkeypatch)
    no_loading(monkeypatch)
    rc = main(["eval", str(base_dir), "--text", str(EVALUATION_TEXT), "--json", str(parent / "r.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err == f"quantmla eval: error: cannot write to {parent} (read-only or no permission); " \
                              "choose a writable folder"
