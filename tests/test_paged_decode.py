"""Paged MLA decode: the portable Triton kernel (`triton`) against its PyTorch reference, and the reference against
the contiguous one.

Fresh random pages in a shuffled order, requests of odd and unequal lengths in one launch (varlen), lengths on page
boundaries and on the sink/recent boundaries, decode steps and chunks of several query tokens. On CPU the kernel runs
in the Triton interpreter, so sizes stay small.
"""

import math

import pytest
import torch
from helpers import KERNEL_DEVICE, assert_close, random_planes, to_device

from quantmla_hf.format import CacheFormat, PathFormat
from quantmla_hf.kernels.mla_decode_ref import mla_decode_paged_ref, mla_decode_ref
from quantmla_hf.kernels.mla_decode_triton import programs_per_sm
from quantmla_hf.ops.backends import mla_decode_paged, score_rounding, select_paged_backend

D_C, D_R, PAGE = 64, 16, 8


def paged_case(lengths, query_lens, cb=4, rb=4, S=2, R=5, H=4, dtype=torch.float32, seed=0, D_C=D_C, D_R=D_R):
    """Pages filled with random data, each request's pages drawn from a shuffled pool (unused pages included)."""
    g = torch.Generator().manual_seed(seed)
    fmt = CacheFormat(PathFormat(D_C, cb, 64), PathFormat(D_R, rb, 64), S, R)
    n_pages = [-(-n // PAGE) for n in lengths]
    P = sum(n_pages) + 3
    order = torch.randperm(P, generator=g)
    table = torch.zeros(len(lengths), max(n_pages), dtype=torch.int32)
    used = 0
    for i, k in enumerate(n_pages):
        table[i, :k] = order[used : used + k]
        used += k

    protected = cb < 16 or rb < 16
    n_rows = len(lengths) + 2
    rows = torch.randperm(n_rows, generator=g)[: len(lengths)].to(torch.int32)

    def dense(n, d):
        return torch.randn(n_rows, n if protected else 0, d, generator=g).to(dtype)

    Nq = sum(query_lens)
    q_lat = torch.randn(Nq, H, D_C, generator=g)
    q_rot = torch.randn(Nq, H, D_R, generator=g)
    cu = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    content, rope = (random_planes(f, (P, PAGE), g, dtype) for f in (fmt.content, fmt.rope))
    return (q_lat, q_rot, content, rope, fmt, dense(S, D_C), dense(S, D_R),
            dense(R, D_C), dense(R, D_R), table, rows, cu, torch.tensor(lengths, dtype=torch.int32),
            1 / math.sqrt(D_C + D_R))


def check(args, **kw):
    """fp32 copies: fp32 IEEE dots (the contiguous kernel's exact path); bf16: fp16 operands, one rounding of the
    values, or bf16 operands when both paths are 16-bit (their bound in tests/test_mla_decode.py). The LSE against
    the reference that rounds the score keys as the backend does (`score_rounding`)."""
    out, lse = to_device(mla_decode_paged(*to_device(args), **kw), "cpu")
    ref_out, _ = mla_decode_paged_ref(*args, dtype=torch.float64)
    q_lat, fmt, copies, table = args[0], args[4], args[5], args[9]
    page_size = next(iter(args[2].values())).shape[1]
    backend = kw.get("backend") or select_paged_backend(fmt, q_lat.shape[1], table.shape[0], q_lat.shape[0],
                                                        page_size, copies.dtype, KERNEL_DEVICE)
    rounding = score_rounding(backend, fmt)
    _, ref_lse = mla_decode_paged_ref(*args, dtype=torch.float64, score_rounding=rounding)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    exact = copies.dtype == torch.float32
    assert_close("o_lat", ref_out, out, 2e-5 if exact else 2e-3)
    assert (lse - ref_lse).abs().max().item() < 1e-4
    return out, lse


@pytest.mark.parametrize("cb, rb", [(4, 4), (2, 4), (8, 8), (16, 16), (2, 16), (4, 8)])
def test_unequal_requests_in_one_launch(cb, rb):
    # decode (1 token), a chunk of 3 and one of 9, lengths odd, on a page boundary and inside the sink window
    check(paged_case([17, 16, 9, 1, 40], [1, 1, 3, 1, 9], cb=cb, rb=rb), backend="triton")


@pytest.mark.parametrize("length", [1, 2, 3, 5, 6, 7, 8, 9, 33])
def test_lengths_around_sink_recent_and_page_edges(length):
    # S = 2, R = 5, page 8: below, on and past the sink, recent and page boundaries, with a 32-token block edge
    check(paged_case([length, length + 8], [1, min(length, 4)], seed=length), backend="triton")


def test_deepseek_widths():
    # d_c 512, d_R 64: the widths of DeepSeek's layers
    check(paged_case([21, 40], [1, 3], H=16, D_C=512, D_R=64), backend="triton")


def test_many_heads_take_several_head_blocks():
    check(paged_case([13, 21], [2, 1], H=70), backend="triton")


@pytest.mark.parametrize("cb, rb", [(4, 16), (16, 16)])
def test_bf16_copies_and_pages(cb, rb):
    check(paged_case([19, 12], [1, 2], cb=cb, rb=rb, dtype=torch.bfloat16), backend="triton")


def test_bf16_model_with_bf16_queries():
    # C16R16 with queries in the model dtype: the `NATIVE` launch on a GPU, fp16 operands in the interpreter
    args = list(paged_case([19, 12], [1, 2], cb=16, rb=16, dtype=torch.bfloat16))
    args[0], args[1] = args[0].bfloat16(), args[1].bfloat16()
    check(tuple(args), backend="triton")


def test_block_size_and_splits_do_not_change_the_result():
    args = to_device(paged_case([45, 7, 100], [3, 1, 1]))
    a, la = mla_decode_paged(*args, block_t=16, num_splits=1)
    for kw in (dict(block_t=64, num_splits=1), dict(block_t=16, num_splits=3), dict(block_t=16, num_splits=7)):
        b, lb = mla_decode_paged(*args, **kw)
        assert_close("o_lat", a, b, 1e-6)
        assert (la - lb).abs().max() < 1e-5


def test_programs_per_sm_grow_with_the_rows():
    # one to four rows: one program per multiprocessor (long splits, few partials); then doubling up to 8
    assert [programs_per_sm(r) for r in (1, 4, 5, 8, 9, 16, 17, 32, 1000)] == [1, 1, 2, 2, 4, 4, 8, 8, 8]


def test_split_history_matches_the_reference():
    # 7 splits of 16 positions over lengths 100 and 5: the short request's later splits are empty
    check(paged_case([100, 5, 33], [1, 2, 3]), block_t=16, num_splits=7)


def _contiguous(planes, table_row, length):
    pos = torch.arange(length)
    slots = table_row.long()[pos // PAGE] * PAGE + pos % PAGE
    return {k: v.reshape(-1, v.shape[-1])[slots].unsqueeze(0) for k, v in planes.items()}


@pytest.mark.parametrize("cb, rb", [(4, 4), (16, 16)])
def test_reference_equals_the_contiguous_reference(cb, rb):
    """Each request's pages, gathered into the contiguous layout, give the contiguous reference's result exactly."""
    lengths, qlens = [17, 6, 30], [1, 2, 4]
    q_lat, q_rot, content, rope, fmt, sc, sr, rc, rr, table, rows, cu, lens, scaling = paged_case(
        lengths, qlens, cb=cb, rb=rb)
    out, lse = mla_decode_paged_ref(q_lat, q_rot, content, rope, fmt, sc, sr, rc, rr, table, rows, cu, lens, scaling)
    for i, n in enumerate(lengths):
        q0, q1, row = int(cu[i]), int(cu[i + 1]), int(rows[i])
        S, R = sc.shape[1], rc.shape[1]
        fmt_i = CacheFormat(fmt.content, fmt.rope, S, R)
        exp, exp_lse = mla_decode_ref(
            q_lat[q0:q1].transpose(0, 1)[None], q_rot[q0:q1].transpose(0, 1)[None],
            _contiguous(content, table[i], n), _contiguous(rope, table[i], n), fmt_i,
            sc[row : row + 1], sr[row : row + 1], rc[row : row + 1], rr[row : row + 1],
            torch.zeros(1, dtype=torch.long), n, scaling,
        )
        assert torch.equal(out[q0:q1], exp[0].transpose(0, 1)) and torch.equal(lse[q0:q1], exp_lse[0].transpose(0, 1))


def test_bad_shapes_are_refused():
    args = list(paged_case([5], [1]))
    args[11] = torch.tensor([0, 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        mla_decode_paged(*args)
    args = list(paged_case([5], [1]))
    args[1] = args[1][..., :8]
    with pytest.raises(ValueError, match="expected q_lat"):
        mla_decode_paged(*args)


@pytest.mark.parametrize("backend", ["gluon_regs", "gluon_wide", "gluon_split"])
def test_a_gluon_backend_that_cannot_take_the_step_says_what_it_takes(backend):
    # pages of 8 tokens (and, on this machine, no sm_90): the paged Gluon kernels refuse, naming what they take
    with pytest.raises(ValueError, match=r"does not take C4R4, 3 query tokens of 2 requests in pages of 8 .*"
                                         r"takes decode steps .* use backend='triton'"):
        mla_decode_paged(*paged_case([17, 9], [1, 2]), backend=backend)
