"""A checkpoint whose tensors do not fit the model's shapes, loaded through the QuantMLA quantizer: the same outcome
as a stock load on every supported transformers release (an error that names the tensors and the fix, or with
`ignore_mismatched_sizes=True` the tensors initialised anew at the model's shapes), never the checkpoint's tensor
kept in a model built for another shape."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from quantmla_hf import QuantMLAConfig, apply_quantmla
from quantmla_hf.tiny_models import tiny_config


@pytest.fixture(scope="module", params=["quantized checkpoint", "quantization_config at load"])
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("classifier")
    model = AutoModelForSequenceClassification.from_config(tiny_config("deepseek_v3"))  # 2 labels
    if request.param == "quantized checkpoint":
        apply_quantmla(model, QuantMLAConfig(transform="none"))
        model.save_pretrained(path)
        return path, {}
    model.save_pretrained(path)
    return path, {"quantization_config": QuantMLAConfig(transform="none")}


def test_a_head_of_another_size_is_an_error_that_names_it(saved):
    path, kwargs = saved
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes") as err:
        AutoModelForSequenceClassification.from_pretrained(path, num_labels=42, **kwargs)
    assert "score.weight" in str(err.value) or "above report" in str(err.value)


def test_ignore_mismatched_sizes_initialises_the_head_at_the_models_shape(saved):
    path, kwargs = saved
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=42, ignore_mismatched_sizes=True,
                                                               **kwargs)
    assert model.score.weight.shape == (42, model.config.hidden_size)
    assert torch.isfinite(model.score.weight).all() and model.score.weight.abs().sum() > 0
    logits = model(torch.arange(1, 9)[None]).logits
    assert logits.shape == (1, 42)
    same = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)  # matching shapes: loaded as saved
    assert same.score.weight.shape == (2, model.config.hidden_size)
