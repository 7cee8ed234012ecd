"""`from_pretrained` with QuantMLAConfig in every form, and generate/pipeline defaults, on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from helpers import CACHE_KWARG, assert_close
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

import quantmla_hf
from quantmla_hf import QuantMLACache, QuantMLAConfig, QuantMLAHfQuantizer, StaticQuantMLACache
from quantmla_hf.attention.state import ATTN_IMPLEMENTATION, mla_attention_modules
from quantmla_hf.integration import generated_cache
from quantmla_hf.tiny_models import tiny_mla_model

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3")


def small_config(**kw) -> QuantMLAConfig:
    """C4R4 RTN with windows small enough that short generations read dequantized history."""
    base = dict(transform="none", group_size=16, sink_tokens=1, recent_tokens=2, advanced={"kernel": "torch"})
    return QuantMLAConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> directory of a saved tiny random BF16-style (fp32 here) checkpoint."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        tiny_mla_model(family, seed=1).save_pretrained(path)
        out[family] = str(path)
    return out


def prompt(batch=1, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 128, (batch, length), generator=g)


def test_registered_with_transformers():
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AutoQuantizationConfig

    quantmla_hf.register_quantmla()  # a second registration is a no-op, not an error
    assert AUTO_QUANTIZER_MAPPING["quantmla"] is QuantMLAHfQuantizer
    cfg = AutoQuantizationConfig.from_dict({"quant_method": "quantmla", "content_bits": 2, "transform": "none"})
    assert isinstance(cfg, QuantMLAConfig) and cfg.content_bits == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_rtn_uses_packed_cache_in_generate(checkpoints, family):
    model = AutoModelForCausalLM.from_pretrained(checkpoints[family], quantization_config=small_config())
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert isinstance(model.config.quantization_config, QuantMLAConfig) and not model.config.quantization_config.calibrated
    modules = mla_attention_modules(model)
    assert len(modules) == quantmla_hf.mla_dims(model.config).num_cache_layers
    assert all(m._quantmla_state is model._quantmla_state for m in modules)

    ids = prompt()
    out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True)
    cache = generated_cache(out)
    assert isinstance(cache, QuantMLACache)
    assert cache.get_seq_length() == ids.shape[1] + 4
    assert cache.layers[0].content.planes["codes"].dtype == torch.uint8  # packed 4-bit codes, not a dense copy

    # The same greedy run with a cache the caller builds gives the same scores: the default is that cache.
    explicit = QuantMLACache(config=model.config, quantization_config=model.config.quantization_config)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True,
                         **{CACHE_KWARG: explicit})
    assert generated_cache(ref) is explicit
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert torch.equal(a, b)

    # Against the unquantized cache: the prefill step is exact, later steps read 4-bit history.
    dense = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True,
                           **{CACHE_KWARG: DynamicCache(config=model.config)})
    assert isinstance(generated_cache(dense), DynamicCache)
    assert_close("prefill logits", dense.scores[0], out.scores[0], 1e-5)
    first = ids.shape[1]
    assert torch.equal(out.sequences[:, first], dense.sequences[:, first])  # so step 2 sees the same tokens
    assert not torch.allclose(out.scores[1], dense.scores[1], atol=1e-6), "decode did not read the quantized cache"


def test_generate_modes_with_default_cache(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints["deepseek_v3"], quantization_config=small_config())
    ids = prompt(batch=2)

    beam = model.generate(ids, max_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False,
                          return_dict_in_generate=True)
    assert beam.sequences.shape == (4, ids.shape[1] + 4)
    assert isinstance(generated_cache(beam), QuantMLACache)
    explicit = QuantMLACache(config=model.config, quantization_config=model.config.quantization_config)
    beam_ref = model.generate(ids, max_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False,
                              **{CACHE_KWARG: explicit})
    assert torch.equal(beam.sequences, beam_ref)

    torch.manual_seed(3)
    s1 = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=20, return_dict_in_generate=True)
    torch.manual_seed(3)
    s2 = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=20)
    assert isinstance(generated_cache(s1), QuantMLACache)
    assert torch.equal(s1.sequences, s2)

    plain = model.generate(ids, max_new_tokens=3, do_sample=False)  # a tensor without return_dict_in_generate
    assert plain.shape == (2, ids.shape[1] + 3)

    no_cache = model.generate(ids, max_new_tokens=2, do_sample=False, use_cache=False, return_dict_in_generate=True)
    assert generated_cache(no_cache) is None


def test_left_padded_batch_matches_single_rows(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints["deepseek_v2"], quantization_config=small_config())
    long, short = prompt(1, 9, seed=1)[0], prompt(1, 5, seed=2)[0]
    pad = 0
    ids = torch.stack([long, torch.cat([torch.full((4,), pad), short])])
    mask = torch.stack([torch.ones(9, dtype=torch.long), torch.cat([torch.zeros(4, dtype=torch.long), torch.ones(5, dtype=torch.long)])])
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=pad,
                             return_dict_in_generate=True, output_scores=True)
    cache = generated_cache(batched)
    assert isinstance(cache, QuantMLACache)
    assert cache.layers[0].left_padding.tolist() == [0, 4]  # the sink starts at each row's first real token
    for row, single_ids in enumerate((long, short)):
        single = model.generate(single_ids[None], max_new_tokens=5, do_sample=False, pad_token_id=pad,
                                return_dict_in_generate=True, output_scores=True)
        assert torch.equal(batched.sequences[row, -5:], single.sequences[0, -5:])
        assert_close(f"row {row} scores", torch.stack(single.scores)[:, 0], torch.stack(batched.scores)[:, row], 1e-4)


def test_pipeline_uses_quantmla_cache_by_default(tmp_path):
    from transformers import AutoTokenizer, pipeline

    from quantmla_hf.embedded import REFERENCE_MODEL

    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    path = tmp_path / "tiny"
    tiny_mla_model("deepseek_v3", vocab_size=len(tokenizer)).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=small_config())
    seen = []
    model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(type(kwargs.get("cache", kwargs.get("past_key_values")))), with_kwargs=True
    )
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = pipe("The history of the city", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("The history of the city")
    # On a GPU the pipeline places the model there and generate decodes from CUDA graphs on the static cache.
    expected = StaticQuantMLACache if pipe.model.device.type == "cuda" else QuantMLACache
    assert seen and set(seen) == {expected}


def test_dtype_and_device_map(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(
        checkpoints["glm4_moe_lite"], quantization_config=small_config(), dtype=torch.bfloat16, device_map="auto"
    )
    assert model.dtype == torch.bfloat16
    out = model.generate(prompt(), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = generated_cache(out)
    assert isinstance(cache, QuantMLACache) and cache.layers[0].sink_content.dtype == torch.bfloat16

    cpu = AutoModelForCausalLM.from_pretrained(checkpoints["minicpm3"], quantization_config=small_config(),
                                               device_map="cpu")
    assert isinstance(generated_cache(cpu.generate(prompt(), max_new_tokens=2, return_dict_in_generate=True)),
                      QuantMLACache)


def test_non_mla_model_is_refused(tmp_path):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'llama' config has no kv_lora_rank"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=small_config())
    with pytest.raises(ValueError, match="kv_lora_rank"):
        quantmla_hf.apply_quantmla(LlamaForCausalLM(cfg), small_config())


@pytest.mark.parametrize("transform", ["learned", "smooth"])
def test_learned_without_calibration_data_explains(checkpoints, transform):
    """No calibration_data: the default text, which needs the checkpoint's tokenizer (these have none)."""
    with pytest.raises(ValueError, match=r"learns from the package's default text, which needs the model's tokenizer"):
        AutoModelForCausalLM.from_pretrained(checkpoints["deepseek_v3"], quantization_config=QuantMLAConfig(transform=transform))
    with pytest.raises(FileNotFoundError, match="no_such_file.txt"):
        AutoModelForCausalLM.from_pretrained(
            checkpoints["deepseek_v3"], quantization_config=QuantMLAConfig(transform=transform, calibration_data="no_such_file.txt")
        )


def test_hadamard_fuses_once_and_keeps_the_function(checkpoints, tmp_path):
    path = checkpoints["longcat_flash"]
    base = AutoModelForCausalLM.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=small_config(transform="hadamard"))
    assert model.config.quantization_config.calibrated
    name = "kv_b_proj.weight"
    w0 = dict(base.named_parameters())
    changed = [n for n, p in model.named_parameters() if n.endswith(name) and not torch.equal(p, w0[n])]
    assert changed, "the Hadamard rotation was not fused into kv_b_proj"
    ids = prompt(length=12)
    ref = base(ids).logits
    assert_close("fused logits (dense cache)", ref, model(ids, **{CACHE_KWARG: DynamicCache(config=model.config)}).logits, 1e-5)

    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)  # calibrated=True in config.json: no second rotation
    for n, p in again.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n]), n
