"""Reductions, scans, the sigmoid and dtype casts for the kernels, natively and under the interpreter.

torch imports triton (and ``triton.language``) by itself, usually before moe_compile decides to run
the Triton interpreter. Triton's standard-library functions (``tl.sum``, ``tl.cumsum``, ``tl.zeros``,
``tl.sigmoid``) are themselves ``@triton.jit`` functions, created at that import as native JIT
functions, which the interpreter refuses to call ("Cannot call @triton.jit'd outside of the scope of
a kernel"). These helpers use builtins only: ``tl.reduce`` / ``tl.associative_scan`` with triton's
own sum combiner (the interpreter recognises that combiner and runs numpy's sum / cumsum; natively
it is exactly what ``tl.sum`` / ``tl.cumsum`` compile to); zeros come from the builtin ``tl.full``.
"""

import triton
import triton.language as tl

from ..triton_mode import interpreting

INTERPRET = tl.constexpr(interpreting())  # fixed before this module loads (kernels/__init__.py)


@triton.jit
def sum_(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def cumsum_(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def sigmoid_(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def cast_(x, DT: tl.constexpr):
    """x.to(DT), rounding to nearest even also under the interpreter.

    Triton interpreter bug: its fp32 → bf16 cast truncates (rounds toward zero; see
    triton/runtime/interpreter.py ``_convert_float``, which only adds the cut-off bit when asked for
    RTNE and ignores ties), so bf16 results drift by an ulp from torch's. Interpreted kernels round
    by hand on the fp32 bit pattern; compiled kernels use the hardware conversion (RTNE)."""
    if INTERPRET and DT == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(DT)
    return y


@triton.jit
def round_(x, DT: tl.constexpr):
    """x rounded to DT and back to fp32: where the torch ops round (emulated in fp32 arithmetic)."""
    return cast_(x, DT).to(tl.float32)
