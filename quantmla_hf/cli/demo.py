"""`quantmla demo`: quantize the embedded reference model, generate, and compare with the unquantized cache.

Everything it needs ships in the package (`quantmla_hf/assets/`): a small DeepSeek-V3-architecture model trained by
`benchmarks/reference_model/`, its tokenizer, a calibration text and an evaluation text. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from ..cache.growing import CACHE_KWARG as GENERATE_CACHE_KWARG
from ..calibration.defaults import resolve_transform
from ..config import QuantMLAConfig
from ..embedded import CALIBRATION_TEXT, EVALUATION_TEXT, REFERENCE_MODEL
from ..evaluation.perplexity import decode_perplexity
from ..integration import build_cache


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantmla demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REFERENCE_MODEL), help="checkpoint directory (default: embedded model)")
    p.add_argument("--content-bits", type=int, default=4, choices=(2, 4, 8, 16))
    p.add_argument("--rope-bits", type=int, default=4, choices=(4, 8, 16))
    p.add_argument("--transform", default="auto", choices=("auto", "learned", "hadamard", "smooth", "none"),
                   help="auto: learned when the calibration text is large enough to beat RTN, else none (RTN); the "
                        "embedded text (959 tokens) is too small, so the demo runs RTN unless told otherwise")
    # With --transform learned: smaller than the library defaults (64 x 512 tokens, 100 steps) so that the demo
    # calibrates in about a minute on two CPU cores; real checkpoints should use the defaults.
    p.add_argument("--calibration-samples", type=int, default=8)
    p.add_argument("--calibration-seq-len", type=int, default=128)
    p.add_argument("--calibration-steps", type=int, default=20, help="per layer and path")
    p.add_argument("--prompt", default="The history of the city")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--decode-chunk", type=int, default=4, help="tokens per decode step when measuring perplexity")
    return p


def _load(path: str, dtype: torch.dtype, quantization_config=None):
    kwargs = {"dtype": dtype}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _complete(model, tokenizer, prompt: str, max_new_tokens: int, cache) -> str:
    """Greedy continuation of `prompt` generated with `cache`."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **{GENERATE_CACHE_KWARG: cache})
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _measured_bytes_per_token(make_cache, dtype: torch.dtype, n_tokens: int) -> tuple[float, float]:
    """Bytes per token of a dense latent cache in `dtype` and of a QuantMLA cache holding `n_tokens` random
    latents (fed through `update`, so the storage is what a real sequence of that length allocates)."""
    cache = make_cache()
    fmt = cache.format
    gen = torch.Generator().manual_seed(0)
    for layer_idx in range(len(cache.layers)):
        latent = torch.randn(1, 1, n_tokens, fmt.content.dim, generator=gen).to(dtype)
        k_rot = torch.randn(1, 1, n_tokens, fmt.rope.dim, generator=gen).to(dtype)
        cache.update(latent, k_rot, layer_idx)
    dense = fmt.dense_bytes_per_token(dtype) * len(cache.layers)
    return dense, cache.nbytes() / n_tokens


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    transform, why = resolve_transform(args.transform, str(CALIBRATION_TEXT), tokenizer)
    print(why)

    qconfig = QuantMLAConfig(
        content_bits=args.content_bits,
        rope_bits=args.rope_bits,
        transform=transform,
        calibration_data=str(CALIBRATION_TEXT),
        advanced={"calibration_samples": args.calibration_samples, "calibration_seq_len": args.calibration_seq_len,
                  "calibration_steps": args.calibration_steps},
    )
    print(f"model: {'the embedded reference model' if args.model == str(REFERENCE_MODEL) else args.model}")
    baseline = _load(args.model, dtype).to(device)
    t0 = time.time()
    quantized = _load(args.model, dtype, qconfig).to(device)
    print(f"quantized {qconfig.name} with transform={qconfig.transform} in {time.time() - t0:.1f} s")

    print(f"\nprompt: {args.prompt!r}")
    text = _complete(baseline, tokenizer, args.prompt, args.max_new_tokens, DynamicCache(config=baseline.config))
    print(f"  unquantized cache: {text!r}")
    text = _complete(quantized, tokenizer, args.prompt, args.max_new_tokens, build_cache(quantized))
    print(f"  {qconfig.name} cache:    {text!r}")

    ids = tokenizer(EVALUATION_TEXT.read_text(), return_tensors="pt")["input_ids"][0]
    window = min(512, ids.numel())
    ppl_ref = decode_perplexity(baseline, ids, window=window, prefill=128, chunk=args.decode_chunk)

    def make_cache():
        return build_cache(quantized)

    ppl_q = decode_perplexity(quantized, ids, make_cache=make_cache, window=window, prefill=128, chunk=args.decode_chunk)

    print(f"\ncache bytes per token and sequence, all {len(make_cache().layers)} layers, from allocated storage:")
    for n_tokens in (512, 4096, 32768):
        dense, held = _measured_bytes_per_token(make_cache, dtype, n_tokens)
        print(f"  {n_tokens:>6} tokens: BF16 latent cache {dense:7.0f}   "
              f"{qconfig.name} {held:7.0f}   ({dense / held:.2f}x smaller)")
    print("  (the BF16 sink and recent tokens are kept beside the packed copies, so short contexts gain less)")
    print(f"\nperplexity on the embedded evaluation text ({ppl_ref.tokens} tokens decoded against the cache, "
          f"{args.decode_chunk} at a time):")
    change = 100 * (ppl_q.perplexity / ppl_ref.perplexity - 1)
    print(f"  unquantized cache: {ppl_ref.perplexity:.3f}   {qconfig.name} cache: {ppl_q.perplexity:.3f} ({change:+.2f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
