"""`quantmla demo`: quantize the embedded reference model, generate, and compare with the unquantized cache.

Everything it needs ships in the package (`quantmla_hf/assets/`): a small DeepSeek-V3-architecture model trained by
`benchmarks/reference_model/`, its tokenizer, a calibration text and an evaluation text. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent / "assets"
REFERENCE_MODEL = ASSETS / "reference_model"
CALIBRATION_TEXT = ASSETS / "calibration_text.txt"
EVALUATION_TEXT = ASSETS / "evaluation_text.txt"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantmla demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REFERENCE_MODEL), help="checkpoint directory (default: embedded model)")
    p.add_argument("--content-bits", type=int, default=4, choices=(2, 4, 8, 16))
    p.add_argument("--rope-bits", type=int, default=4, choices=(4, 8, 16))
    p.add_argument("--transform", default="learned", choices=("learned", "hadamard", "smooth", "none"))
    p.add_argument("--calibration-steps", type=int, default=40, help="per layer and path (the library default is 100)")
    p.add_argument("--prompt", default="The history of the city")
    p.add_argument("--max-new-tokens", type=int, default=40)
    return p


def _load(path: str, dtype: torch.dtype, quantization_config=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _complete(model, tokenizer, prompt: str, max_new_tokens: int, cache) -> str:
    """Greedy continuation of `prompt` generated with `cache`."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **{_cache_kwarg(): cache})
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _cache_kwarg() -> str:
    import transformers
    from packaging import version

    return "past_key_values" if version.parse(transformers.__version__) < version.parse("5.18") else "cache"


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer, DynamicCache

    from . import QuantMLACache, QuantMLAConfig
    from .evaluation import decode_perplexity

    args = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # BF16 on a GPU; on a CPU the arithmetic is fp32 (bf16 matmuls there are slow), the cache formats are the same.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    qconfig = QuantMLAConfig(
        content_bits=args.content_bits,
        rope_bits=args.rope_bits,
        transform=args.transform,
        calibration_data=str(CALIBRATION_TEXT),
        calibration_samples=16,
        calibration_seq_len=256,
        calibration_steps=args.calibration_steps,
    )
    print(f"model: {args.model}")
    baseline = _load(args.model, dtype).to(device)
    t0 = time.time()
    quantized = _load(args.model, dtype, qconfig).to(device)
    print(f"quantized {qconfig.name} with transform={qconfig.transform} in {time.time() - t0:.1f} s")

    print(f"\nprompt: {args.prompt!r}")
    text = _complete(baseline, tokenizer, args.prompt, args.max_new_tokens, DynamicCache(config=baseline.config))
    print(f"  unquantized cache: {text!r}")
    cache = QuantMLACache(config=quantized.config, quantization_config=quantized.config.quantization_config)
    text = _complete(quantized, tokenizer, args.prompt, args.max_new_tokens, cache)
    print(f"  {qconfig.name} cache:    {text!r}")

    ids = tokenizer(EVALUATION_TEXT.read_text(), return_tensors="pt")["input_ids"][0]
    window = min(512, ids.numel())
    ppl_ref = decode_perplexity(baseline, ids, window=window, prefill=128)
    measured = {}

    def make_cache():
        measured["cache"] = QuantMLACache(config=quantized.config, quantization_config=quantized.config.quantization_config)
        return measured["cache"]

    ppl_q = decode_perplexity(quantized, ids, make_cache=make_cache, window=window, prefill=128)
    cache = measured["cache"]
    n_layers = len(cache.layers)
    dense = cache.format.dense_bytes_per_token(torch.bfloat16) * n_layers
    held = cache.bytes_per_token()
    print(f"\ncache bytes per token, {n_layers} layers, measured from allocated storage at {cache.get_seq_length()} tokens:")
    print(f"  BF16 latent cache: {dense:.0f}   {qconfig.name}: {held:.0f} ({dense / held:.2f}x smaller; the 4 sink + 128 "
          "recent BF16 tokens weigh more at short lengths)")
    packed = cache.format.packed_bytes_per_token() * n_layers
    print(f"  packed copies alone: {packed} bytes/token ({dense / packed:.2f}x smaller)")
    print(f"\nperplexity on the embedded evaluation text ({ppl_ref.tokens} tokens decoded against the cache):")
    change = 100 * (ppl_q.perplexity / ppl_ref.perplexity - 1)
    print(f"  unquantized: {ppl_ref.perplexity:.3f}   {qconfig.name}: {ppl_q.perplexity:.3f} ({change:+.2f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
