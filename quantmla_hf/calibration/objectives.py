"""The quantizer as a differentiable function, and the two path objectives.

- `fake_quantize(x, fmt)`: forward values are exactly `dequantize_ref(quantize_ref(x))` (the cache's quantizer);
  gradients come from the same per-token group affine quantizer with straight-through rounding, whose step and
  zero point follow the group's min/max (so growing a channel grows its error, as it does in the cache).
- `output_nmse`: normalized attention-output error after `o_proj` (the content objective).
- `positional_qk_nmse`: normalized positional-QK error over all valid causal pairs and heads (the RoPE objective),
  computed pair by pair (`[B, H, T, T]` scores): the reference.
- `query_grams` + `positional_qk_sums`: the same sums through per-key Gram matrices of the queries, without the
  `[B, H, T, T]` scores (what learning runs): `sum_{h, t counted} (q_ht . e_j)^2 = e_j^T G_j e_j` with
  `G_j = sum_{h, t counted for key j} q_ht q_ht^T` (`[d_R, d_R]`), a sum over `t >= j + recent` (a reverse cumulative
  sum over tokens). `H T^2 d_R` multiply-adds per window become `H T d_R^2 + T d_R^2`: 8x fewer at `T` 512, and
  the memory traffic of the score tensors goes.
- `attention_partials` + `quantized_pairs_attention`: the attention of the content objective split into the part that
  the transform cannot change (exact keys: computed once per window, kept as a normalized output and its log-sum-exp)
  and the part it changes (quantized keys), merged in one softmax (`learn.ContentLearner`).
"""

from __future__ import annotations

import torch

from quantmla_hf.format import PathFormat
from quantmla_hf.kernels.quant_pack_ref import SCALE_MIN, dequantize_ref, fp16_round_up, quantize_ref


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.floor(x + 0.5) - x).detach()


def quantize_dequantize(x: torch.Tensor, fmt: PathFormat) -> torch.Tensor:
    """What the cache gives back for `x: [..., dim]` (no gradient); identity for a 16-bit path."""
    if not fmt.quantized:
        return x
    return dequantize_ref(*quantize_ref(x, fmt), fmt, x.dtype)


def _cache_step_and_zero(lo: torch.Tensor, hi: torch.Tensor, fmt: PathFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """The step (fp16 rounded up, as fp32) and zero point `quantize_ref` stores for groups of range `[lo, hi]`,
    the range widened to include 0 where the zero point would not fit its int8."""

    def step_and_zero(lo, hi):
        step = fp16_round_up(torch.clamp((hi - lo) / fmt.qmax, min=SCALE_MIN)).float()
        return step, torch.floor(-lo / step + 0.5)

    step, zero = step_and_zero(lo, hi)
    half = 1 << (fmt.bits - 1)
    outside = (zero - half < -128) | (zero - half > 127)
    wide_step, wide_zero = step_and_zero(lo.clamp(max=0), hi.clamp(min=0))
    return torch.where(outside, wide_step, step), torch.where(outside, wide_zero, zero)


def fake_quantize(x: torch.Tensor, fmt: PathFormat) -> torch.Tensor:
    """Quantize-dequantize `x: [..., dim]` with straight-through gradients (see the module docstring).

    The value is bit for bit `quantize_dequantize(x, fmt)` (the cache's quantizer computed without packing the codes:
    the same fp32 operations); the gradient is the surrogate's."""
    if not fmt.quantized:
        return x
    xg = x.float().reshape(*x.shape[:-1], fmt.n_groups, fmt.group)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    with torch.no_grad():
        s, z = _cache_step_and_zero(lo, hi, fmt)
        exact = (torch.floor(xg / s + z + 0.5).clamp_(0, fmt.qmax) - z) * s
    step = ((hi - lo) / fmt.qmax).clamp_min(SCALE_MIN)
    zero = _round_ste(-lo / step)
    q = torch.clamp(_round_ste(xg / step) + zero, 0, fmt.qmax)
    surrogate = (q - zero) * step
    return (exact + (surrogate - surrogate.detach())).reshape(x.shape).to(x.dtype)


def output_nmse(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`||out - ref||^2 / ||ref||^2` over all elements (fp32 scalar)."""
    return (out.float() - ref.float()).pow(2).sum() / ref.float().pow(2).sum().clamp_min(1e-30)


def positional_qk_nmse(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor, sums: bool = False,
                       error_pairs: torch.Tensor | None = None):
    """Normalized positional-QK error `sum |q (k - k_hat)^T|^2 / sum |q k^T|^2` over causal pairs `j <= t`.

    Args:
        q: `[B, H, T, d_R]` post-RoPE (transformed) queries.
        k, k_hat: `[B, T, d_R]` post-RoPE (transformed) keys and their quantized reconstruction.
        sums: return `(numerator, denominator)` instead of their ratio (to aggregate over batches).
        error_pairs: optional bool `[T, T]`: count the error only on these (causal) pairs, e.g. the pairs the cache
            holds quantized under sink/recent protection; the denominator stays over every causal pair.
    """
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    counted = causal if error_pairs is None else causal & error_pairs
    err = torch.einsum("bhtr,bjr->bhtj", q.float(), (k - k_hat).float()).masked_fill(~counted, 0)
    ref = torch.einsum("bhtr,bjr->bhtj", q.float(), k.float()).masked_fill(~causal, 0)
    num, den = err.pow(2).sum(), ref.pow(2).sum()
    return (num, den) if sums else num / den.clamp_min(1e-30)


def query_grams(q: torch.Tensor, sink: int = 0, recent: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-key Gram matrices of the queries that read each key, `(error [B, T, d_R, d_R], causal [B, T, d_R, d_R])`.

    `causal[b, j] = sum_{h, t >= j} q[b, h, t] q[b, h, t]^T`; `error[b, j]` sums only the queries that read key `j`
    quantized under sink/recent protection (`t - j >= recent`, none for `j < sink`; every causal pair when both are
    0), as `positional_qk_nmse`'s `error_pairs = protection.quantized_pairs(T, sink, recent)` counts them.
    `q: [B, H, T, d_R]` post-RoPE queries (fp32 sums).
    """
    causal = torch.einsum("bhtr,bhts->btrs", q.float(), q.float())  # per token, then summed over t >= j in place
    T = q.shape[2]
    for j in range(T - 2, -1, -1):  # a reverse cumulative sum; torch.cumsum over this axis is 8x slower on a CPU
        causal[:, j] += causal[:, j + 1]
    if sink == 0 and recent == 0:
        return causal, causal
    error = torch.zeros_like(causal)
    if recent < T:
        error[:, : T - recent] = causal[:, recent:]
    error[:, : min(sink, T)] = 0
    return error, causal


class _GramQuadratic(torch.autograd.Function):
    """`sum_{b, t} e[b, t]^T G[rows[b], t] e[b, t]` for symmetric Gram matrices `G`, differentiable in `e`."""

    @staticmethod
    def forward(ctx, e, grams, rows):
        # Each window's matrices are read in place (no gathered copy of the batch's) and once: the gradient
        # `2 G e` reuses the forward's `e^T G` (G symmetric; the row-vector product is the faster one on a CPU).
        ge = torch.stack([(e[i].unsqueeze(-2) @ grams[r]).squeeze(-2) for i, r in enumerate(rows.tolist())])
        ctx.save_for_backward(ge)
        return (ge * e).sum()

    @staticmethod
    def backward(ctx, grad):
        (ge,) = ctx.saved_tensors
        return 2 * grad * ge, None, None


def gram_quadratic(e: torch.Tensor, grams: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`sum_{b, t} e[b, t]^T grams[rows[b], t] e[b, t]` (fp32 scalar), differentiable in `e`.

    Args:
        e: `[B, T, d]`.
        grams: `[N, T, d, d]` symmetric (`query_grams`), or `[B, T, d, d]` with `rows` None.
        rows: `[B]` the window of `grams` each row of `e` reads (default: row `b` reads window `b`).
    """
    rows = torch.arange(e.shape[0]) if rows is None else rows.cpu()
    return _GramQuadratic.apply(e.float(), grams, rows)


def positional_qk_sums(e: torch.Tensor, k: torch.Tensor, grams: torch.Tensor, grams_causal: torch.Tensor):
    """`(numerator, denominator)` of `positional_qk_nmse` from `query_grams(q, sink, recent)` of queries `q`.

    Args:
        e: `[B, T, d_R]` the key error `k - k_hat` as the queries `q` see it. For a transform that sends keys to `A k`
            and queries to `A^-T q` the error `e'` of the transformed keys enters as `A^-1 e'`
            (`q' . e' = q . A^-1 e'`).
        k: `[B, T, d_R]` the keys as `q` sees them (the denominator `sum (q . k)^2` is invariant under the transform).
        grams, grams_causal: `[B, T, d_R, d_R]` from `query_grams`.
    """
    return gram_quadratic(e, grams), gram_quadratic(k, grams_causal)


def attention_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, allowed: torch.Tensor):
    """Softmax attention restricted to the `allowed` pairs, as a mergeable partial result `(out, lse)`.

    Args:
        q: `[B, H, Tq, d]` queries; k: `[B, H, Tk, d]` keys; v: `[B, H, Tk, d_v]` values.
        scaling: the softmax scale.
        allowed: bool `[Tq, Tk]`, the pairs this part attends over.

    Returns:
        `out: [B, H, Tq, d_v]` the attention output normalized over the allowed keys (0 on a row with none) and
        `lse: [B, H, Tq]` the log-sum-exp of the row's allowed scaled scores (-inf on a row with none): the row's
        share of a softmax over a larger key set is `exp(lse - lse_total)`.
    """
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return probs @ v, lse


class _QuantizedPairsAttention(torch.autograd.Function):
    """`quantized_pairs_attention` with a hand-written backward (gradients for the keys and values only)."""

    @staticmethod
    def forward(ctx, q, k, v, q_rot, k_rot, scaling, part_out, part_lse, block):
        bh, n = q.shape[:2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_().logical_not_()
        out = v.new_empty(bh, n, v.shape[-1])
        probs = []
        for r0 in range(0, n, block):
            r1 = min(n, r0 + block)
            # The RoPE part of the scores, with the causal mask, is the scores' starting value.
            s = (q_rot[:, :, r0:r1] @ k_rot[:, :, :r1].transpose(-1, -2)).mul_(scaling)
            s = s.masked_fill_(causal[r0:r1, :r1], float("-inf")).flatten(0, 1)
            s = s.baddbmm_(q[:, r0:r1], k[:, :r1].transpose(1, 2))
            top = s.amax(-1)
            if part_out is not None:
                top = torch.maximum(top, part_lse[:, r0:r1])
            s = s.sub_(top.unsqueeze(-1)).exp_()
            total = s.sum(-1)
            if part_out is not None:
                part = (part_lse[:, r0:r1] - top).exp_()
                total += part
            s = s.div_(total.unsqueeze(-1))
            o = torch.bmm(s, v[:, :r1])
            if part_out is not None:
                o += part_out[:, r0:r1] * (part / total).unsqueeze(-1)
            out[:, r0:r1] = o
            probs.append(s)
        ctx.probs, ctx.block = probs, block
        ctx.save_for_backward(q, v, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, v, out = ctx.saved_tensors
        dk, dv = torch.zeros(*q.shape[:2], q.shape[-1], dtype=q.dtype, device=q.device), torch.zeros_like(v)
        for i, p in enumerate(ctx.probs):
            r0, r1 = i * ctx.block, i * ctx.block + p.shape[1]
            g = grad[:, r0:r1]
            dv[:, :r1].baddbmm_(p.transpose(1, 2), g)
            # softmax backward over every column, the precomputed part's included: dS = P (dP - sum_j P_j dP_j),
            # and sum_j P_j dP_j = g . out
            ds = torch.bmm(g, v[:, :r1].transpose(1, 2)).sub_((g * out[:, r0:r1]).sum(-1, keepdim=True)).mul_(p)
            dk[:, :r1].baddbmm_(ds.transpose(1, 2), q[:, r0:r1])
        return None, dk, dv, None, None, None, None, None, None


def quantized_pairs_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rot: torch.Tensor,
                              k_rot: torch.Tensor, scaling: float, part_out: torch.Tensor | None = None,
                              part_lse: torch.Tensor | None = None, block: int = 128) -> torch.Tensor:
    """Causal attention of `n` queries over `n` keys (query `t` reads keys `j <= t`), merged with a precomputed part
    over other keys of the same queries: exactly one softmax over both key sets.

    The scores are `(q_rot . k_rot) * scaling + q . k` (`q` pre-scaled); queries run in blocks of `block` rows, each
    over the keys up to its last row (the upper triangle is not computed). Differentiable in `k` and `v` only (the
    queries, the RoPE part and the precomputed part are constants of the content objective); the backward reuses the
    forward's probabilities.

    Args:
        q: `[B * H, n, d]` content queries times the softmax scale; k: `[B * H, n, d]`; v: `[B * H, n, d_v]`.
        q_rot: `[B, H, n, d_R]`; k_rot: `[B, 1, n, d_R]` (shared by the heads).
        part_out, part_lse: `[B * H, n, d_v]`, `[B * H, n]` from `attention_partials`, or None.

    Returns:
        `[B * H, n, d_v]`.
    """
    return _QuantizedPairsAttention.apply(q, k, v, q_rot, k_rot, scaling, part_out, part_lse, block)
