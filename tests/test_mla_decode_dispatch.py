"""The decode dispatch table (`quantmla_hf.ops.backends.select_backend`) and the split arithmetic it launches with, on
a machine without a GPU (the device's capability is stubbed: the table is a pure function of format, rows, dtype and
device kind)."""

import gluon_layout
import pytest
import torch

from quantmla_hf import CacheFormat, PathFormat
from quantmla_hf.kernels import mla_decode_gluon_common as mc
from quantmla_hf.kernels import mla_decode_triton as pt
from quantmla_hf.ops import backends as md


def fmt(cb, rb, dc=512, dr=64, group=64):
    return CacheFormat(PathFormat(dc, cb, group), PathFormat(dr, rb, group))


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of the capability the test sets (`gpu(9, 0)`), outside the interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def set_capability(major, minor):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(mc, "HAVE_GLUON", True)

    return set_capability


CASES = [  # (format, rows, batch, dtype, H200 choice)
    (fmt(4, 4), 16, 1, torch.bfloat16, "gluon_regs"),  # 16 heads B1 4K
    (fmt(2, 4), 16, 1, torch.bfloat16, "gluon_regs"),  # the same kernel class as C4R4 at batch 1
    (fmt(4, 4), 16, 64, torch.bfloat16, "gluon_regs"),
    (fmt(8, 8), 16, 32, torch.float16, "gluon_regs"),
    (fmt(4, 4), 128, 8, torch.bfloat16, "gluon_split"),  # 128 heads: keys unpacked once per 64 rows
    (fmt(2, 4), 128, 32, torch.bfloat16, "gluon_split"),
    (fmt(4, 4), 64, 8, torch.float16, "gluon_split"),  # 64 rows: one split program
    (fmt(2, 4), 48, 8, torch.bfloat16, "gluon_wide"),  # fewer rows than one split program
    (fmt(4, 8), 128, 8, torch.bfloat16, "gluon_split"),  # 8-bit RoPE: its integer codes scored apart
    (fmt(2, 8), 64, 8, torch.bfloat16, "gluon_split"),
    (fmt(4, 8), 32, 8, torch.bfloat16, "gluon_wide"),  # fewer rows than one split program
    (fmt(4, 4), 32, 4, torch.bfloat16, "gluon_wide"),  # 16 heads x 2 query tokens
    (fmt(8, 8), 128, 32, torch.bfloat16, "gluon_split"),  # 8-bit keys at 128 heads too
    (fmt(8, 8), 32, 8, torch.bfloat16, "gluon_wide"),  # fewer rows than one split program
    (fmt(4, 4, dc=256, dr=32), 128, 8, torch.bfloat16, "triton"),  # MiniCPM3: RoPE group of 32
    (fmt(4, 4, dc=256), 128, 8, torch.bfloat16, "gluon_regs"),  # 4 content groups: not the wide kernel's
    (fmt(16, 16), 128, 32, torch.bfloat16, "gluon_split"),  # C16R16 at 128 heads: keys copied, not unpacked
    (fmt(16, 16), 64, 8, torch.float16, "gluon_split"),
    (fmt(16, 16), 16, 32, torch.bfloat16, "triton"),  # C16R16 below one split program's 64 rows
    (fmt(16, 16, dc=256), 128, 8, torch.bfloat16, "triton"),  # 16-bit planes at other widths
    (fmt(4, 4), 16, 8, torch.float32, "triton"),  # fp32 model: the exact fp32 path
    (fmt(4, 4, dc=192), 16, 8, torch.bfloat16, "torch"),  # three content groups: no kernel
    (fmt(4, 4, dc=256, dr=32, group=32), 16, 8, torch.bfloat16, "triton"),  # groups of 32: not the Gluon kernels'
    (fmt(4, 4, group=32), 16, 8, torch.bfloat16, "torch"),  # RoPE in two groups, content in 16: no kernel
]


@pytest.mark.parametrize("f, rows, batch, dtype, want", CASES)
def test_hopper_table(gpu, f, rows, batch, dtype, want):
    gpu(9, 0)
    assert md.select_backend(f, rows, batch, dtype, "cuda") == want


def test_fp32_queries_leave_the_split_kernel(gpu):
    """The split kernel stages no low parts of fp32 queries: they take the two-warpgroup kernel (which does)."""
    gpu(9, 0)
    f = fmt(4, 4)
    assert md.select_backend(f, 128, 8, torch.bfloat16, "cuda", torch.bfloat16) == "gluon_split"
    assert md.select_backend(f, 128, 8, torch.bfloat16, "cuda", torch.float32) == "gluon_wide"
    assert md.select_paged_backend(f, 128, 8, 8, 64, torch.bfloat16, "cuda", torch.float32) == "gluon_wide"


@pytest.mark.parametrize("f, rows, batch, dtype, want", CASES)
def test_other_gpus_and_cpu(gpu, monkeypatch, f, rows, batch, dtype, want):
    gpu(8, 0)  # A100: the portable kernel wherever a kernel takes the format
    portable = "torch" if want == "torch" else "triton"
    assert md.select_backend(f, rows, batch, dtype, "cuda") == portable
    gpu(7, 0)  # no bf16 tensor-core dots
    assert md.select_backend(f, rows, batch, dtype, "cuda") == "torch"
    assert md.select_backend(f, rows, batch, dtype, "cpu") == "torch"  # CPU without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert md.select_backend(f, rows, batch, dtype, "cpu") == portable


@pytest.mark.skipif(not mc.HAVE_GLUON, reason="needs Gluon (Triton >= 3.5)")
def test_gluon_kernels_read_the_hosts_split_minimums_as_constexpr():
    """The kernels cut splits by the minimums the host plans the grid with, read as `constexpr` globals: those enter
    a kernel's cache key, so a changed minimum recompiles instead of launching kernels cut for the old one."""
    from triton.experimental.gluon import language as gl

    assert isinstance(mc._MIN_TILES, gl.constexpr) and isinstance(mc._MIN_TILES_8BIT, gl.constexpr)
    assert (mc._MIN_TILES.value, mc._MIN_TILES_8BIT.value) == (mc.MIN_SPLIT_TILES, mc.MIN_SPLIT_TILES_8BIT)
    assert [mc.min_split_tiles(fmt(c, r)) for c, r in ((4, 4), (2, 4), (4, 8), (8, 8))] == [
        mc.MIN_SPLIT_TILES, mc.MIN_SPLIT_TILES, mc.MIN_SPLIT_TILES, mc.MIN_SPLIT_TILES_8BIT]


def test_partials_are_fp16_for_the_split_kernel_over_quantized_content():
    """Half-width partials in the split kernel where the content values are bounded by the format (fp16 holding `o_s
    * 2**-8`, `mla_decode_combine`, a constexpr of the kernels); fp32 for the other kernels and 16-bit content."""
    from triton.experimental.gluon import language as gl

    for c, r in ((4, 4), (2, 4), (4, 8), (8, 8)):
        assert md.partial_dtype("gluon_split", fmt(c, r)) == torch.float16
        assert {md.partial_dtype(b, fmt(c, r)) for b in ("gluon_regs", "gluon_wide", "triton")} == {torch.float32}
    assert md.partial_dtype("gluon_split", fmt(16, 16)) == torch.float32
    assert isinstance(mc._FP16_PARTIAL_SCALE, gl.constexpr) and mc._FP16_PARTIAL_SCALE.value == 2.0**-8


def test_split_plan_and_fill_splits():
    c4r4 = fmt(4, 4)
    # the portable kernel: programs_per_sm of its rows (1 per SM at one row, 2 at five, 8 from 17 on), bounded by
    # what the capacity holds
    assert md.split_plan("triton", 1, 1, 32768, c4r4, 132) == (132, 132)
    assert md.split_plan("triton", 5, 1, 32768, c4r4, 132) == (53, 53)
    assert md.split_plan("triton", 1, 1, 32768, c4r4, 1000) == (1000, 510)
    assert md.split_plan("triton", 32, 1, 32768, c4r4, 132) == (33, 33)
    assert md.split_plan("triton", 1, 1, 100, c4r4, 132)[1] == 1  # too short to split
    # the Gluon kernels: their resident slots filled once (2 per SM one warpgroup, 1 two warpgroups)
    assert md.split_plan("gluon_regs", 32, 1, 32768, c4r4, 132) == (8, 8)
    assert md.split_plan("gluon_wide", 32, 4, 32768, c4r4, 132) == (1, 1)
    assert md.split_plan("gluon_split", 8, 2, 32768, c4r4, 132) == (8, 8)  # one resident program per SM
    assert md.split_plan("gluon_regs", 32, 1, 32768, c4r4, 132, num_splits=5) == (5, 5)
    # Gluon splits take at least MIN_SPLIT_TILES tiles: 16 splits of 256 positions at B1 4K, not 31 of 128
    assert md.split_plan("gluon_regs", 1, 1, 4096, c4r4, 132) == (264, 16)
    # 8-bit content (tiles of twice the words): splits of at least 2 tiles, at most one per SM: 31 at B1 4K, 128 of
    # 4 tiles at B1 32K (the kernel cuts cdiv(32640, 132) -> 256 positions)
    assert md.split_plan("gluon_regs", 1, 1, 4096, fmt(8, 8), 132) == (132, 31)
    assert md.split_plan("gluon_regs", 1, 1, 32768, fmt(8, 8), 132) == (132, 132)
    assert md.split_plan("gluon_regs", 8, 1, 32768, fmt(8, 8), 132) == (33, 33)  # from batch 2 on: the fill rule
    assert [md.fill_splits(B, 1, 132, 2) for B in (1, 8, 16, 32, 64, 264, 1000)] == [264, 33, 16, 8, 4, 1, 1]
    for B, hb, sms, per in ((32, 1, 132, 2), (7, 3, 114, 2), (5, 8, 78, 1)):
        n = md.fill_splits(B, hb, sms, per)
        assert B * hb * n <= per * sms < B * hb * (n + 1)


def test_split_kernel_starts_its_copy_programs_in_the_first_wave():
    """`gluon_split` (one program per SM) takes `sms // (B * hb) - copies` splits where that keeps 7/8 of the fill:
    then every packed and copy program of the launch starts at once; else the fill rule's splits."""
    c4r4, copies = fmt(4, 4), 3  # 4 sink + 128 recent tokens: one sink tile and two recent tiles
    assert mc.copy_programs(c4r4) == copies
    # 128 heads (2 blocks of 64 rows): 63 splits at batch 1 (not 66), 30 at batch 2 (not 33), the fill from batch 4
    assert [md.split_plan("gluon_split", B, 2, 32768, c4r4, 132) for B in (1, 2, 4, 8, 32)] == [
        (63, 63), (30, 30), (16, 16), (8, 8), (2, 2)]
    assert md.split_plan("gluon_split", 1, 2, 4096, c4r4, 132) == (63, 16)  # the capacity still bounds the grid
    assert md.split_plan("gluon_split", 1, 1, 32768, fmt(16, 16), 132) == (129, 128)  # 64 heads, C16R16
    assert md.split_plan("gluon_split", 1, 2, 32768, c4r4, 132, num_splits=66) == (66, 66)  # an override stays
    assert md.split_plan("gluon_regs", 1, 1, 32768, c4r4, 132)[0] == 264  # two resident programs: the fill rule
    for B, hb, sms in ((1, 2, 132), (2, 2, 132), (1, 1, 132), (3, 2, 114), (1, 2, 78), (4, 2, 132), (8, 2, 132)):
        fill = md.fill_splits(B, hb, sms, 1)
        n = md.one_wave_splits(fill, copies)
        if n != fill:
            assert B * hb * (n + copies) <= sms and 8 * n >= 7 * fill  # all programs in one wave, few splits lost
        else:
            assert 8 * (sms // (B * hb) - copies) < 7 * fill


def test_portable_launch_and_operands(monkeypatch):
    """The portable kernel's launch by format (16-bit content: 64-token tiles, 2 stages; packed: 32-token tiles, 1
    stage up to 32 rows, 2 above) and which launches keep the model dtype's operands (`NATIVE`; bf16 not in the
    interpreter, whose dots multiply bf16 bit patterns)."""
    c16, c4, c4r8 = fmt(16, 16), fmt(4, 4), fmt(4, 8)
    assert [pt.launch_shape(c16, m) for m in (16, 128)] == [(64, 4, 2), (64, 4, 2)]
    assert [pt.launch_shape(c, m) for c in (c4, c4r8) for m in (16, 32, 33)] == [(32, 4, 1), (32, 4, 1), (32, 4, 2)] * 2
    # the split plan sizes the grid with the same tile: 64-token tiles halve the splits a short capacity holds
    assert md.split_plan("triton", 1, 1, 1000, c16, 132)[1] == -(-(1000 - 128 - 4) // 128)
    assert md.split_plan("triton", 1, 1, 1000, c4, 132)[1] == -(-(1000 - 128 - 4) // 64)
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pt.native_operands(c16, bf16, bf16, bf16) and pt.native_operands(c16, fp16, fp16, fp16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what a GPU launch decides
    assert pt.native_operands(c16, bf16, bf16, bf16) and pt.native_operands(c16, fp16, fp16, fp16)
    assert not pt.native_operands(c16, fp32, bf16, bf16)  # fp32 queries over bf16 values: the fp16 split path
    assert not pt.native_operands(c4, bf16, bf16, bf16)  # packed codes are unpacked into fp16
    assert pt.native_operands(c4, fp32, fp32, fp32) and pt.native_operands(c16, bf16, bf16, fp32)  # fp32 models


def test_flat_grid_numbers_every_program_once_packed_splits_first():
    c4r4 = CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64), 4, 128)
    assert mc.copy_programs(c4r4) == 3
    NS, B, M, bm = 5, 3, 40, 16
    (n,) = mc.flat_grid(NS, c4r4, M, bm, B)
    coords = [gluon_layout.program_coords(p, NS, 3, 3, n) for p in range(n)]
    assert len(set(coords)) == n == B * 3 * (NS + 3)
    assert all(s < NS for s, _, _ in coords[: B * 3 * NS])  # every packed split before any copy program


PAGED_CASES = [  # (format, heads, requests, query tokens, page size, H200 choice)
    (fmt(4, 4), 16, 5, 5, 64, "gluon_regs"),  # a decode step in 64-token pages
    (fmt(2, 4), 16, 32, 32, 64, "gluon_regs"),
    (fmt(4, 4), 128, 8, 8, 64, "gluon_split"),  # many heads: the split kernel, as contiguous
    (fmt(8, 8), 128, 8, 8, 64, "gluon_split"),  # 8-bit keys too
    (fmt(8, 8), 64, 8, 8, 64, "gluon_split"),
    (fmt(8, 8), 32, 8, 8, 64, "gluon_wide"),  # fewer rows than one split program
    (fmt(4, 8), 128, 8, 8, 64, "gluon_split"),
    (fmt(4, 4), 16, 5, 9, 64, "triton"),  # a prefill chunk in the step
    (fmt(4, 4), 16, 5, 5, 32, "triton"),  # pages smaller than the Gluon tile
    (fmt(16, 16), 16, 5, 5, 64, "triton"),  # C16R16
    (fmt(16, 16), 128, 8, 8, 64, "gluon_split"),  # C16R16 pages at 128 heads: the split kernel, no copy programs
    (CacheFormat(PathFormat(512, 16, 64), PathFormat(64, 16, 64), 0, 0), 128, 8, 8, 64, "gluon_split"),
    (CacheFormat(PathFormat(512, 4, 64), PathFormat(64, 4, 64), 0, 0), 16, 5, 5, 64, "triton"),  # no copies
]


@pytest.mark.parametrize("f, heads, n, nq, page, want", PAGED_CASES)
def test_paged_table(gpu, f, heads, n, nq, page, want):
    gpu(9, 0)
    assert md.select_paged_backend(f, heads, n, nq, page, torch.bfloat16, "cuda") == want
    gpu(8, 0)  # no Gluon kernel off Hopper
    assert md.select_paged_backend(f, heads, n, nq, page, torch.bfloat16, "cuda") == "triton"


def test_paged_gluon_refused_where_it_does_not_apply():
    f = fmt(4, 4)
    pages = {"codes": torch.zeros(4, 64, 256, dtype=torch.uint8), "scale": torch.zeros(4, 64, 8, dtype=torch.float16),
             "zero": torch.zeros(4, 64, 8, dtype=torch.int8)}
    rope = {"codes": torch.zeros(4, 64, 32, dtype=torch.uint8), "scale": torch.zeros(4, 64, 1, dtype=torch.float16),
            "zero": torch.zeros(4, 64, 1, dtype=torch.int8)}
    pages8 = {"codes": torch.zeros(4, 64, 512, dtype=torch.uint8), "scale": torch.zeros(4, 64, 8, dtype=torch.float16),
              "zero": torch.zeros(4, 64, 8, dtype=torch.int8)}
    rope8 = {"codes": torch.zeros(4, 64, 64, dtype=torch.uint8), "scale": torch.zeros(4, 64, 1, dtype=torch.float16),
             "zero": torch.zeros(4, 64, 1, dtype=torch.int8)}
    copies = [torch.zeros(2, n, d, dtype=torch.bfloat16) for n, d in ((4, 512), (4, 64), (128, 512), (128, 64))]
    with pytest.raises(ValueError, match="backend='triton'"):
        md.mla_decode_paged(torch.zeros(2, 16, 512), torch.zeros(2, 16, 64), pages, rope, f, *copies,
                            torch.zeros(2, 2, dtype=torch.int32), torch.arange(2, dtype=torch.int32),
                            torch.arange(3, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32), 0.1,
                            backend="gluon_regs")
    with pytest.raises(ValueError, match="backend='triton'"):
        md.mla_decode_paged(torch.zeros(2, 16, 512), torch.zeros(2, 16, 64), pages, rope, f, *copies,
                            torch.zeros(2, 2, dtype=torch.int32), torch.arange(2, dtype=torch.int32),
                            torch.arange(3, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32), 0.1,
                            backend="gluon_wide")
    with pytest.raises(ValueError, match="backend='triton'"):  # C8R8: not the split kernel's
        md.mla_decode_paged(torch.zeros(2, 128, 512), torch.zeros(2, 128, 64), pages8, rope8, fmt(8, 8), *copies,
                            torch.zeros(2, 2, dtype=torch.int32), torch.arange(2, dtype=torch.int32),
                            torch.arange(3, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32), 0.1,
                            backend="gluon_split")
    with pytest.raises(ValueError, match="one of"):
        md.mla_decode_paged(torch.zeros(2, 16, 512), torch.zeros(2, 16, 64), pages, rope, f, *copies,
                            torch.zeros(2, 2, dtype=torch.int32), torch.arange(2, dtype=torch.int32),
                            torch.arange(3, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32), 0.1,
                            backend="gluon")


@pytest.mark.parametrize("f, backend, head_blocks", [(fmt(4, 4), "gluon_regs", 1), (fmt(8, 8), "gluon_regs", 1),
                                                     (fmt(4, 4), "gluon_wide", 4), (fmt(8, 8), "gluon_wide", 4),
                                                     (fmt(2, 4), "gluon_split", 2)])
def test_paged_reads_stay_in_the_request_pages(f, backend, head_blocks):
    """The paged Gluon launch (`paged_reads`, the host's statement of its split and page arithmetic): for requests of
    every length around page, split and sink/recent edges and the split plans of 1-64 requests, every page-table
    column it reads is one of the request's pages (`cdiv(length, 64)` of them), and its tiles attend each packed
    position `[S, length - R)` exactly once."""
    S, R = f.sink_tokens, f.recent_tokens
    lengths = [1, 4, 63, 64, 65, 131, 132, 133, 196, 197, 259, 4096, 4097, 20000, 32768, 32769]
    for n_req in (1, 5, 64):
        for length in lengths:
            target, NS = md.split_plan(backend, n_req, head_blocks, max(lengths), f, 132)
            held = []
            for split in range(NS + mc.copy_programs(f)):
                pages, tiles = gluon_layout.paged_reads(length, split, NS, target, f)
                assert all(0 <= p < -(-length // 64) for p in pages), (n_req, length, split, pages)
                for lo, hi in tiles:
                    held.extend(range(lo, hi))
            assert sorted(held) == list(range(S, max(length - R, S))), (n_req, length)
