"""Layer-by-layer calibration: a run stopped inside a layer and resumed from its checkpoint directory gives bitwise
the fused weights of an uninterrupted run; a checkpoint of other data is refused; a partly fused model is refused;
layer-by-layer propagation gives the inputs a full forward would; the progress bar follows transformers' switch."""

import copy

import pytest
import torch
from test_calibration import ids, planted
from transformers.utils import logging

from quantmla_hf.attention.state import mla_attention_modules
from quantmla_hf.calibration import calibrate, pipeline
from quantmla_hf.calibration.capture import capture_inputs, decoder_layers, propagate
from quantmla_hf.config import QuantMLAConfig
from quantmla_hf.tiny_models import tiny_mla_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**advanced):
    return QuantMLAConfig(content_bits=2, rope_bits=4, transform="learned",
                          advanced={"calibration_steps": 6, "calibration_lr": 1e-2, **advanced})


def _attention_state(model):
    return {k: v.clone() for m in mla_attention_modules(model) for k, v in m.state_dict(keep_vars=False).items()
            for k in [f"{m.layer_idx}.{k}"]}


class _Killed(Exception):
    pass


@pytest.mark.parametrize("family", ["deepseek_v3", "longcat_flash"])
def test_resume_after_a_kill_gives_bitwise_the_uninterrupted_weights(tmp_path, monkeypatch, family):
    base = planted(family) if family == "deepseek_v3" else tiny_mla_model(family, seed=2, num_layers=2)
    data = ids(8, seed=0)
    whole = copy.deepcopy(base)
    calibrate(whole, _cfg(), data, batch_size=4, progress=False)
    expected = _attention_state(whole)

    kill_at = len(decoder_layers(base, mla_attention_modules(base))) - 1  # the last layer: earlier ones finished
    real = pipeline.calibrate_module
    calls = []

    def killed_inside(module, *args, **kwargs):
        calls.append(module.layer_idx)
        entry, transforms = real(module, *args, **kwargs)
        if len(calls) > kill_at * (2 if family == "longcat_flash" else 1):
            raise _Killed  # after learning, before the layer's checkpoint is written
        return entry, transforms

    first = copy.deepcopy(base)
    monkeypatch.setattr(pipeline, "calibrate_module", killed_inside)
    with pytest.raises(_Killed):
        calibrate(first, _cfg(), data, batch_size=4, progress=False, checkpoint_dir=tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").glob("layer_*"))
    assert files == [f"layer_{i:05d}.pt" for i in range(kill_at)]  # whole layers only, no temporary file
    monkeypatch.setattr(pipeline, "calibrate_module", real)
    with pytest.raises(ValueError, match="partly fused"):
        calibrate(first, _cfg(), data, batch_size=4, progress=False)

    resumed = copy.deepcopy(base)  # a new process: the original weights again
    cfg = _cfg()
    calibrate(resumed, cfg, data, batch_size=4, progress=False, checkpoint_dir=tmp_path / "ckpt")
    got = _attention_state(resumed)
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    layers = cfg.extra["calibration"]["layers"]
    n_resumed = sum(1 for e in layers if e.get("resumed"))
    assert n_resumed == kill_at * (2 if family == "longcat_flash" else 1)
    assert len(layers) == len(mla_attention_modules(base))


def test_a_checkpoint_of_other_data_is_refused(tmp_path):
    base = planted()
    calibrate(copy.deepcopy(base), _cfg(calibration_steps=0), ids(4, seed=0), batch_size=4, progress=False,
             checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="token_ids_sha256"):
        calibrate(copy.deepcopy(base), _cfg(calibration_steps=0), ids(4, seed=1), batch_size=4, progress=False,
                 checkpoint_dir=tmp_path)


def test_layer_by_layer_inputs_match_the_full_forward():
    model = tiny_mla_model("deepseek_v3", seed=4, num_hidden_layers=3)
    data = ids(5, seed=2)
    layers = decoder_layers(model, mla_attention_modules(model))
    inputs = capture_inputs(model, layers[0][0], data, 2, dtype=None)
    for i, (layer, _) in enumerate(layers[1:], 1):
        inputs = type(inputs)(**{**inputs.__dict__, "hidden": propagate(layers[i - 1][0], inputs)})
        full = capture_inputs(model, layer, data, 2, dtype=None).hidden
        torch.testing.assert_close(inputs.hidden, full, rtol=1e-5, atol=1e-6)


def test_progress_bar_follows_transformers_switch(capsys):
    model = tiny_mla_model("deepseek_v3", seed=1)
    logging.disable_progress_bar()
    try:
        calibrate(model, _cfg(calibration_steps=0), ids(4, seed=0), batch_size=4, progress=True)
    finally:
        logging.enable_progress_bar()
    assert "QuantMLA" not in capsys.readouterr().err
    calibrate(tiny_mla_model("deepseek_v3", seed=1), _cfg(calibration_steps=0), ids(4, seed=0), batch_size=4)
    err = capsys.readouterr().err
    assert "QuantMLA learned" in err and "layer" in err
