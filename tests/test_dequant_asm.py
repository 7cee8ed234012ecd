"""The inline-PTX dequantization of `kernels/mla_decode.py`, run on CPU by a small emulator of the PTX it uses.

The Triton interpreter has no inline assembly, so the kernel's CPU tests take its plain-Triton path; this test runs
the assembly text itself (`_dequant_asm`) on random bytes, zero points and scales, every element of a packed
instance with its own zero point and scale, and asks for bit-exact agreement with the reference dequantization
(`code - z`, or `fp16((code - z) * s)` with one rounding). On a GPU, `benchmarks/bench_decode.py --check` covers it.
"""

import numpy as np
import pytest

from quantmla_hf.kernels.mla_decode import _dequant_asm


def _f16(bits: int) -> np.float16:
    return np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0]


def _bits(x) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


def _halves(r: int) -> tuple[np.float16, np.float16]:
    return _f16(r), _f16(r >> 16)


def _pack(lo, hi) -> int:
    return _bits(lo) | (_bits(hi) << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    """Default-mode byte permute: result byte i is byte `sel[i]` of {b, a} (0-3 from a, 4-7 from b)."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    assert all(((sel >> (4 * i)) & 0x8) == 0 for i in range(4)), "sign-replicate mode is not emulated"
    return sum(src[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def run_ptx(asm: str, operands: dict[int, int]) -> tuple[int, int]:
    """Execute the instruction subset of `_dequant_asm` on 32-bit registers; f16x2 arithmetic rounds once to fp16
    (every product and sum here is exact in float64 before that rounding)."""
    regs: dict[str, int] = {}

    def value(x: str) -> int:
        if x.startswith("$"):
            return operands[int(x[1:])]
        if x[0].isdigit():
            return int(x, 0)
        return regs[x]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            r = value(args[1])
        elif op == "prmt.b32":
            r = _prmt(value(args[1]), value(args[2]), value(args[3]))
        elif op == "lop3.b32":
            assert value(args[4]) == 0xEA, "only (a & b) | c is emulated"
            r = (value(args[1]) & value(args[2])) | value(args[3])
        elif op in ("fma.rn.f16x2", "sub.f16x2", "mul.rn.f16x2"):
            a, b = _halves(value(args[1])), _halves(value(args[2]))
            if op == "fma.rn.f16x2":
                c = _halves(value(args[3]))
                out = [float(a[i]) * float(b[i]) + float(c[i]) for i in range(2)]
            elif op == "sub.f16x2":
                out = [float(a[i]) - float(b[i]) for i in range(2)]
            else:
                out = [float(a[i]) * float(b[i]) for i in range(2)]
            r = _pack(np.float16(out[0]), np.float16(out[1]))
        else:
            raise AssertionError(f"instruction {op!r} is not emulated")
        if args[0].startswith("$"):
            operands[int(args[0][1:])] = r
        else:
            regs[args[0]] = r
    return operands[0], operands[1]


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_assembly_dequantizes_every_element_exactly(bits, scaled):
    asm = _dequant_asm(bits, scaled)
    rng = np.random.default_rng(bits * 2 + scaled)
    half = 1 << (bits - 1)
    for _ in range(2000):
        if bits == 4:  # two elements per byte: the kernel feeds b0 b0 b1 b1
            b0, b1 = (int(x) for x in rng.integers(0, 256, 2))
            inp, codes = [b0, b0, b1, b1], [b0 & 15, b0 >> 4, b1 & 15, b1 >> 4]
        elif bits == 2:  # four elements per byte: b0 b0 b0 b0
            b0 = int(rng.integers(0, 256))
            inp, codes = [b0] * 4, [(b0 >> (2 * i)) & 3 for i in range(4)]
        else:
            inp = [int(x) for x in rng.integers(0, 256, 4)]
            codes = inp
        zero = [int(rng.integers(-128, 128)) + half for _ in range(4)]  # stored int8 + middle code, per element
        scale = [np.float16(rng.uniform(1e-4, 0.3)) for _ in range(4)]
        ops = {2: inp[0] | inp[1] << 8 | inp[2] << 16 | inp[3] << 24}
        for i in range(4):
            ops[3 + i] = _pack(np.float16(zero[i]), np.float16(zero[i]))
            ops[7 + i] = _pack(scale[i], scale[i])
        o0, o1 = run_ptx(asm, ops)
        got = [*_halves(o0), *_halves(o1)]
        if scaled:
            want = [np.float16(np.float64(codes[i] - zero[i]) * np.float64(scale[i])) for i in range(4)]
        else:
            want = [np.float16(codes[i] - zero[i]) for i in range(4)]
        assert [float(g) for g in got] == [float(w) for w in want], (codes, zero, scale, got, want)


def test_emulator_catches_a_wrong_constant():
    """The check can fail: the 4-bit assembly with a wrong fma constant gives other values for codes 3 and 3."""
    asm = _dequant_asm(4, False).replace("0xd600e600", "0xd600e601")
    ops = {2: 0x33 | 0x33 << 8 | 0x44 << 16 | 0x44 << 24}  # bytes 0x33 0x33 0x44 0x44: codes 3, 3, 4, 4
    ops.update({3 + i: _pack(np.float16(8), np.float16(8)) for i in range(4)})
    ops.update({7 + i: 0 for i in range(4)})
    o0, _ = run_ptx(asm, ops)
    assert [float(x) for x in _halves(o0)] != [3.0 - 8, 3.0 - 8]
    o0, _ = run_ptx(_dequant_asm(4, False), dict(ops))
    assert [float(x) for x in _halves(o0)] == [3.0 - 8, 3.0 - 8]
