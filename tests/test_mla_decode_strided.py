"""Strided-plane decode kernel (`kernels/mla_decode_strided.py`) vs the PyTorch reference (fp64), fresh random data.

On CPU the kernel runs in the Triton interpreter (tests/conftest.py), so sizes stay small; the real-size run is
`benchmarks/bench_decode.py --check --check-kernels strided` on a GPU (docs/BENCHMARKS.md). The cases go through
`mla_decode_static(..., backend="strided")` with the length as a one-element device tensor and spare capacity, like
the static interface. One test compiles the kernel for sm_90 and checks the property it is built on: the code bytes
reach the MMA operand layouts from shared memory without an fp16 tile in between.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quantmla_hf import CacheFormat, PathFormat
from quantmla_hf.kernels.mla_decode_fast import default_backend, mla_decode_static, strided_measured_faster
from quantmla_hf.kernels.mla_decode_ref import mla_decode_ref
from quantmla_hf.kernels.mla_decode_strided import strided_handles

from test_mla_decode_fast import _shrunk, check, make_case, run_fast

STRIDED = dict(backend="strided")


@pytest.mark.parametrize("cb, rb", [(4, 4), (2, 4), (8, 8), (4, 2)])
def test_bit_configs_with_unequal_padding(cb, rb):
    """Batch 2 with different left padding, an odd length, 3 splits of 16-token tiles plus the sink/recent split."""
    check(make_case(2, 101, 2, 1, 128, 64, cb, rb, 3, 8, [0, 37], seed=cb * 10 + rb, q_dtype=torch.bfloat16),
          num_splits=3, block_t=16, **STRIDED)


def test_deepseek_widths_sixteen_heads():
    """d_c 512 (eight content groups: sixteen 4-bit planes), d_R 64, 16 heads, the default 32-token tiles."""
    check(make_case(1, 97, 16, 1, 512, 64, 4, 4, 4, 16, [9], seed=5, q_dtype=torch.bfloat16), num_splits=2,
          **STRIDED)


@pytest.mark.parametrize("length", [1, 7, 14, 47])
def test_lengths_around_sink_recent_and_split_edges(length):
    """S=2, R=4: the packed range [2, length - 4) empty, one token, across two splits; the second row starts later."""
    check(make_case(2, length, 2, 1, 64, 32, 4, 4, 2, 4, [0, min(1, length - 1)], seed=length,
                    q_dtype=torch.bfloat16), num_splits=2, block_t=16, **STRIDED)


def test_several_query_tokens_see_a_causal_history():
    """5 query tokens x 3 heads = 15 rows; each token sees a different prefix (recent window of 8)."""
    check(make_case(2, 50, 3, 5, 128, 32, 4, 4, 3, 8, [9, 0], seed=5, q_dtype=torch.bfloat16), num_splits=2,
          block_t=16, **STRIDED)


def test_fp16_queries_and_copies_minicpm_rope_width():
    """fp16 model (fp16 queries and copies) with MiniCPM3's 32-wide RoPE key (one 4-bit group: 16 bytes per plane)."""
    check(make_case(2, 77, 2, 1, 256, 32, 4, 4, 2, 8, [4, 0], seed=41, copy_dtype=torch.float16,
                    q_dtype=torch.float16), num_splits=2, block_t=16, **STRIDED)


def test_peaked_attention_keeps_the_lse_exact():
    """Large queries (scores of tens): the planes are exact integers and the scales go on the partial scores."""
    check(make_case(2, 100, 2, 1, 128, 64, 8, 8, 2, 4, [0, 4], seed=3, q_scale=6.0, q_dtype=torch.bfloat16),
          num_splits=2, block_t=16, **STRIDED)


def test_splits_past_the_length_and_rows_without_positions():
    check(make_case(2, 60, 2, 1, 128, 32, 4, 4, 2, 4, [0, 5], seed=13, spare=180, q_dtype=torch.bfloat16),
          num_splits=6, block_t=16, **STRIDED)
    out, lse = check(make_case(2, 20, 2, 1, 64, 16 * 2, 4, 4, 2, 4, [0, 20], seed=11, q_dtype=torch.bfloat16),
                     num_splits=2, block_t=16, **STRIDED)
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_same_result_as_the_fast_kernel_within_rounding():
    """Both kernels compute the same function: their outputs agree far inside the reference tolerance."""
    args, cap = make_case(2, 130, 4, 1, 256, 64, 4, 4, 4, 16, [0, 11], seed=23, q_dtype=torch.bfloat16)
    o_s, l_s = run_fast(args, cap, num_splits=2, block_t=16, **STRIDED)
    o_f, l_f = run_fast(args, cap, num_splits=2, block_t=16, backend="triton")
    assert ((o_s - o_f).norm() / o_f.norm()).item() < 1e-3
    assert (l_s - l_f).abs().max().item() < 1e-4


def test_split_boundaries_follow_the_length_not_the_capacity():
    """As the fast kernel (`split_plan`): the same 140 positions in planes of capacity 150 and 4200 give different
    grids but the same split boundaries and combine order, so bitwise-identical outputs."""
    length = 140
    args, _ = make_case(2, length, 2, 2, 128, 32, 4, 4, 2, 4, [0, 7], seed=3, spare=4200 - length,
                        q_dtype=torch.bfloat16)
    small = list(args)
    small[2], small[3] = _shrunk(args[2], 150), _shrunk(args[3], 150)
    o_big, lse_big = run_fast(args, 4200, **STRIDED)
    o_small, lse_small = run_fast(small, 150, **STRIDED)
    assert torch.equal(o_big, o_small) and torch.equal(lse_big, lse_small)


def test_handles_and_dispatch_rules():
    fmt = lambda cb, rb, dc=512, dr=64, group=64: CacheFormat(PathFormat(dc, cb, group), PathFormat(dr, rb, group))  # noqa: E731
    assert strided_handles(fmt(4, 4), torch.bfloat16, "cpu", torch.bfloat16)  # interpreter on CPU
    assert strided_handles(fmt(8, 8), torch.float16, "cpu", torch.float16)
    assert strided_handles(fmt(2, 4, dr=32), torch.bfloat16, "cpu")
    assert not strided_handles(fmt(4, 4), torch.float32, "cpu")  # fp32 queries: the high/low split of the others
    assert not strided_handles(fmt(4, 4), torch.bfloat16, "cpu", torch.float32)
    assert not strided_handles(fmt(16, 16), torch.bfloat16, "cpu")
    assert not strided_handles(fmt(4, 4, group=32), torch.bfloat16, "cpu")
    assert not strided_handles(fmt(4, 4, dc=1024), torch.bfloat16, "cpu")  # sixteen groups
    assert not strided_handles(fmt(4, 4, dr=128), torch.bfloat16, "cpu")  # two RoPE groups
    assert not strided_handles(fmt(4, 2, dr=32), torch.bfloat16, "cpu")  # 8 bytes per RoPE plane: K < 16
    # dispatch: measured slower than another kernel everywhere so far, so never the default (and never on CPU)
    assert not any(strided_measured_faster(cb, rb, rows) for cb, rb in ((8, 8), (4, 4), (2, 4)) for rows in (1, 16, 128))
    q = torch.zeros(1, 16, 1, 512, dtype=torch.bfloat16)
    assert default_backend(fmt(8, 8), q, {}, {}, q) == "triton"


def test_unhandled_case_gets_a_clear_error():
    args, cap = make_case(1, 30, 2, 1, 64, 16, 4, 4, 2, 4, [0], seed=2)  # fp32 queries
    a = list(args)
    with pytest.raises(ValueError, match="strided-plane decode kernel does not handle"):
        mla_decode_static(*a[:10], torch.tensor([30]), cap, a[11], backend="strided")
    ref = mla_decode_ref(*args)  # the same case through the default kernel is fine
    assert torch.isfinite(ref[0]).all()


COMPILE = textwrap.dedent(
    """
    import re, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from quantmla_hf.kernels import mla_decode_strided as ms

    fn = ms.mla_decode_strided_kernel
    const = dict(D_C=512, GC=8, C_BITS=4, D_R=64, R_BITS=4, S=4, R=128, BLOCK_M=16, BLOCK_T=32)
    ptr = dict(q_ptr="*bf16", qr_ptr="*bf16", cc_ptr="*u8", cs_ptr="*fp16", cz_ptr="*i8", rc_ptr="*u8",
               rs_ptr="*fp16", rz_ptr="*i8", snc_ptr="*bf16", snr_ptr="*bf16", rcc_ptr="*bf16", rcr_ptr="*bf16",
               lp_ptr="*i64", len_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32")
    sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    # what the launcher specialises at run time: 16-byte aligned tensors, strides that are multiples of 16
    aligned = list(ptr) + [n for n in fn.arg_names if n.startswith("s_") and n not in ("s_cst", "s_rst")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    assert ".target sm_90" in k.asm["ptx"]
    ttgir = k.asm["ttgir"].splitlines()
    # the packed loop: the first scf.for (the sink and recent loops follow it)
    start = next(i for i, l in enumerate(ttgir) if "scf.for" in l)
    indent = len(ttgir[start]) - len(ttgir[start].lstrip())
    end = next(j for j in range(start + 1, len(ttgir))
               if ttgir[j].strip().startswith("}") and len(ttgir[j]) - len(ttgir[j].lstrip()) == indent)
    body = "\\n".join(ttgir[start:end])
    # 8 content groups + RoPE for the scores, 8 content groups for the values: 17 byte tiles by cp.async
    n_async = len(re.findall(r"async_copy_global_to_local .* -> <32x\\d+xi8", body))
    assert n_async == 17, n_async
    # every byte tile is read from shared memory into a register layout as i8 (no fp16 key tile is stored)
    n_i8_loads = len(re.findall(r"ttg.local_load .*xi8, #shared", body))
    fp16_tiles = re.findall(r"ttg.local_alloc %\\S+ : \\(tensor<32x\\d+xf16", body)
    assert n_i8_loads >= 17 and not fp16_tiles, (n_i8_loads, fp16_tiles)
    assert "ttg.convert_layout" not in body or not re.search(r"convert_layout .*tensor<32x\\d+xf16", body)
    # 18 score dots (8 groups x 2 planes + 2 RoPE planes) and 16 value dots per tile
    assert len(re.findall(r"= tt.dot ", body)) == 34, len(re.findall(r"= tt.dot ", body))
    print("compiled")
    """
)


def test_compiles_for_sm90_with_the_bytes_going_straight_to_operands():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600,
                         cwd="/")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
