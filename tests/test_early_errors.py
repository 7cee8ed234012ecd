"""Calibration input errors come before any weight loads, naming the file and the option (CLI flag or keyword).

Each checkpoint here has a corrupt model.safetensors: an error about the inputs proves it came before loading.
"""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantmla_hf import QuantMLAConfig
from quantmla_hf.cli.main import main
from quantmla_hf.embedded import CALIBRATION_TEXT, REFERENCE_MODEL
from quantmla_hf.tiny_models import tiny_mla_model


def _checkpoint(path, tokenizer: bool, corrupt: bool):
    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    tiny_mla_model("deepseek_v3", seed=6, vocab_size=len(tok)).save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    if corrupt:
        (path / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    return path


@pytest.fixture(scope="module")
def corrupt_dir(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("corrupt"), tokenizer=True, corrupt=True)


@pytest.fixture()
def binary_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 8)
    return path


@pytest.fixture()
def latin1_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 ".encode("latin-1") * 200)
    return path


def _run(capsys, argv):
    rc = main(argv)
    return rc, capsys.readouterr().err


def test_cli_learned_without_text_or_tokenizer_refuses_before_loading_and_says_what_to_do(tmp_path, capsys):
    """No --calibration: the default text is used, which needs the model's tokenizer; without one, one line."""
    bare = _checkpoint(tmp_path / "bare", tokenizer=False, corrupt=True)
    rc, err = _run(capsys, ["quantize", str(bare), "--out", str(tmp_path / "q"), "--transform", "learned"])
    assert rc == 1 and "default text" in err and "--transform hadamard" in err and "tokenizer" in err
    assert "safetensors" not in err.lower()


def test_cli_defaults_work_without_calibration_text_and_say_which_transform(tmp_path, capsys):
    base = _checkpoint(tmp_path / "base", tokenizer=False, corrupt=False)
    rc = main(["quantize", str(base), "--out", str(tmp_path / "q")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "transform='none' (RTN): no calibration text" in out.out
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["transform"] == "none"


def test_cli_short_text_names_the_file_and_the_flag(corrupt_dir, tmp_path, capsys):
    rc, err = _run(capsys, ["quantize", str(corrupt_dir), "--out", str(tmp_path / "q"),
                            "--calibration", str(CALIBRATION_TEXT), "--transform", "learned"])
    assert rc == 1
    assert f"--calibration {CALIBRATION_TEXT}" in err and "fewer than 2 windows of --calibration-seq-len 512" in err
    assert "calibration_seq_len" not in err  # the CLI flag, not the Python name
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("transform", ["auto", "learned"])
@pytest.mark.parametrize("which,message", [("binary", "is binary"), ("latin1", "is not UTF-8"), ("missing", "no such file")])
def test_cli_unreadable_calibration_file(corrupt_dir, tmp_path, capsys, binary_file, latin1_file, which, message,
                                         transform):
    path = {"binary": binary_file, "latin1": latin1_file, "missing": tmp_path / "nope.txt"}[which]
    rc, err = _run(capsys, ["quantize", str(corrupt_dir), "--out", str(tmp_path / "q"), "--calibration", str(path),
                            "--transform", transform])
    assert rc == 1 and message in err and str(path) in err


def test_from_pretrained_checks_calibration_text_before_loading(corrupt_dir, binary_file):
    short = QuantMLAConfig(transform="learned", calibration_data=str(CALIBRATION_TEXT))
    with pytest.raises(ValueError, match=re.escape("fewer than 2 windows of advanced={'calibration_seq_len': 512}")):
        AutoModelForCausalLM.from_pretrained(corrupt_dir, quantization_config=short)
    with pytest.raises(ValueError, match="is binary"):
        AutoModelForCausalLM.from_pretrained(corrupt_dir, quantization_config=QuantMLAConfig(transform="learned", calibration_data=str(binary_file)))
    with pytest.raises(ValueError, match="holds only empty strings"):
        AutoModelForCausalLM.from_pretrained(corrupt_dir, quantization_config=QuantMLAConfig(transform="learned", calibration_data=["", " "]))


def test_transform_none_needs_no_tokenizer(tmp_path, capsys):
    base = _checkpoint(tmp_path / "base", tokenizer=False, corrupt=False)
    out = tmp_path / "q"
    rc, err = _run(capsys, ["quantize", str(base), "--out", str(out), "--transform", "none"])
    assert rc == 0, err
    assert json.loads((out / "config.json").read_text())["quantization_config"]["transform"] == "none"
