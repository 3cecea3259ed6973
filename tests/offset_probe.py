"""A probe kernel for the MXFP8 kernels' address arithmetic (imported only after the Triton mode is
fixed: ``@triton.jit`` reads it when this module loads).

It evaluates the kernels' own offset helpers on given (int32) indices and strides and stores the
offsets, so a test can check them for shapes whose buffers could never be allocated on a test
machine (G·N·(K + K/32) ≥ 2³¹). ``naive_offsets_kernel`` is the int32 expression the kernels used
before: under the interpreter it wraps like the hardware does, which shows the probe can tell them
apart.
"""

import triton
import triton.language as tl

from moe_compile.codegen.kernels.mxfp8 import _matrix_base, _offsets


@triton.jit
def packed_offsets_kernel(out_ptr, rows_ptr, cols_ptr, g, stride_g, stride_r, R: tl.constexpr, C: tl.constexpr):
    r = tl.load(rows_ptr + tl.arange(0, R))
    c = tl.load(cols_ptr + tl.arange(0, C))
    off = _matrix_base(g, stride_g) + _offsets(r, c, stride_r)
    tl.store(out_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], off)


@triton.jit
def naive_offsets_kernel(out_ptr, rows_ptr, cols_ptr, g, stride_g, stride_r, R: tl.constexpr, C: tl.constexpr):
    r = tl.load(rows_ptr + tl.arange(0, R))
    c = tl.load(cols_ptr + tl.arange(0, C))
    off = g * stride_g + r[:, None] * stride_r + c[None, :]
    tl.store(out_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], off.to(tl.int64))
