"""MXFP8 Triton kernels: row-wise quantise (x → packed qdata–scale rows) and the MXFP8 grouped GEMM
over expert offsets with ``tl.dot_scaled``.

Tutorial shape: the @triton.jit kernels, their launchers, and the torch references they must match
(``moe_compile.mxfp8.quantize_packed`` and ``moe_compile.ops.mx.mx_grouped_mm``); tests/test_mxfp8.py
compares them under the Triton interpreter on CPU.

Offsets are int64 (``_offsets``, ``_matrix_base``): packed expert weights pass 2^31 bytes at
DeepSeek-V3 sizes. Divisions are correctly rounded (``tl.div_rn``; a plain ``/`` compiles to an
approximate fp32 division on GPUs), so scales and elements equal torch's bit for bit natively too.

Like every kernel family it is imported through ``triton_mode.kernel_module("mxfp8")`` (or the
``kernels`` package), which fixes the Triton mode first. Only builtins are used inside the kernels
(``tl.reduce`` with triton's max combiner rather than ``tl.max``): torch imports triton before the
interpreter can be chosen, and the standard library's jit functions then refuse to be interpreted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...mxfp8 import BLOCK, packed_width
from ..kernel_cache import Config, LaunchPlan, launch, make_spec
from ._lang import cast_, round_
from .grouped_gemm import _tile_of_group
from .swiglu import act_fwd, gated_fwd

# -- quantise ---------------------------------------------------------------------------------------


@triton.jit
def _e4m3_bits(y):
    """fp32 (already saturated to ±448) → E4M3 code, round-to-nearest-even, from the fp32 bits.

    Written out instead of ``y.to(tl.float8e4nv)``: the Triton interpreter's emulated cast rounds
    wrongly when the rounding carries into the exponent (triton #8322), on exact ties, and for
    subnormal inputs; integer rounding gives the hardware result everywhere."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    # normal E4M3 results (e ≥ −6): keep 3 mantissa bits, round on the 20 dropped ones; a carry out
    # of the mantissa increments the exponent field by plain integer addition
    normal = (((e + 7) << 3) | (mant >> 20))
    rem = mant & 0xFFFFF
    normal += ((rem > 0x80000) | ((rem == 0x80000) & ((normal & 1) == 1))).to(tl.int32)
    # subnormal E4M3 results (e < −6): the significand in units of 2^−9, rounded to nearest even
    sig = tl.where(e == -127, mant, mant | 0x800000)
    shift = tl.minimum(tl.where(e == -127, 140, 14 - e), 31)
    q = sig >> shift
    low = sig - (q << shift)
    half = 1 << (shift - 1)
    sub = q + ((low > half) | ((low == half) & ((q & 1) == 1))).to(tl.int32)
    sub = tl.where(shift >= 26, 0, sub)  # below half the smallest subnormal
    code = tl.where(e >= -6, normal, sub) | sign
    return tl.where(y != y, 0x7F, code)  # NaN




@triton.jit
def _quantize_tile(x, RCEIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 tile [BLOCK_M, BLOCK_K] → (E4M3 codes [BLOCK_M, BLOCK_K], E8M0 exponents [BLOCK_M, BLOCK_K/32])."""
    xb = tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 32))
    amax = tl.reduce(tl.abs(xb), 2, tl.standard._elementwise_max)
    # max does not propagate NaN (triton's maximum ignores it): a block with a NaN gets a NaN amax
    # here, as torch.amax gives it, so the NaN convention (scale 255) holds.
    has_nan = tl.reduce((xb != xb).to(tl.int32), 2, tl.standard._elementwise_max) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    if RCEIL:
        descale = tl.div_rn(amax, 448.0)  # correctly rounded, as torch's division (exponent bits below)
        bits = descale.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127
        mant = bits & 0x7FFFFF
        e = tl.where(mant > 0, exp + 1, exp)
        e = tl.where(exp == -127, tl.where(mant > (1 << 22), -126, -127), e)  # subnormal descale
        e = tl.minimum(tl.maximum(e, -127), 127) + 127
        e = tl.where(amax == float("inf"), 254, e)
        # multiplier 2^(127 − e), built from exponent bits: biased exponent 254 − e
        rcp = ((254 - e) << 23).to(tl.float32, bitcast=True)
        rcp = tl.where(e == 254, 2.0**-127, rcp)
        rcp = tl.where(e == 0, 1.0, rcp)
        e = tl.where(amax != amax, 255, e)
        rcp = tl.where(amax != amax, amax, rcp)  # NaN block stays NaN
        y = tl.reshape(xb * rcp[:, :, None], (BLOCK_M, BLOCK_K))
    else:
        bits = amax.to(tl.int32, bitcast=True)
        e = tl.minimum(tl.maximum(((bits >> 23) & 0xFF) - 127 - 8, -127), 128) + 127
        e = tl.where(amax != amax, 255, e)
        scale = tl.maximum((e << 23).to(tl.float32, bitcast=True), 2.0**-126)
        y = tl.reshape(tl.div_rn(xb, scale[:, :, None]), (BLOCK_M, BLOCK_K))  # correctly rounded, as torch's
    y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)  # saturate; NaN stays NaN
    return _e4m3_bits(y), e


@triton.jit
def _offsets(rows, cols, stride):
    """Element offsets [rows, cols] of a row-major tile, in int64: packed operands reach 2^31 bytes
    (DeepSeek-V3's w_in with ~70 local experts: G·N·(K + K/32) = 70·4096·7392), where int32 products
    of a row index and a stride wrap around."""
    return rows.to(tl.int64)[:, None] * stride + cols[None, :]


@triton.jit
def _matrix_base(g, stride):
    """Offset of matrix ``g`` of a [G, …] tensor, in int64 (as ``_offsets``)."""
    return g.to(tl.int64) * stride


@triton.jit
def _store_packed(out_ptr, q, e, rows, pid_k, M, K, stride_o, BLOCK_K: tl.constexpr):
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + _offsets(rows, cols, stride_o), q.to(tl.uint8),
             mask=(rows[:, None] < M) & (cols[None, :] < K))
    scols = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    tl.store(out_ptr + _offsets(rows, K + scols, stride_o), e.to(tl.uint8),
             mask=(rows[:, None] < M) & (scols[None, :] < K // 32))


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, M, K, stride_x, stride_o, ACT: tl.constexpr, GATED: tl.constexpr,
                     RCEIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # Quantise [M, K] along K. ACT != "none": x is the first GEMM's output and the expert activation
    # is fused in front (gated: x = [gate | up], K = h), rounded in DT where the torch ops round.
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + _offsets(rows, cols, stride_x), mask=mask, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(x_ptr + _offsets(rows, K + cols, stride_x), mask=mask, other=0.0).to(tl.float32)
        x = gated_fwd(x, u, ACT, DT)
    elif ACT != "none":
        x = round_(act_fwd(x, ACT), DT)
    q, e = _quantize_tile(x, RCEIL, BLOCK_M, BLOCK_K)
    _store_packed(out_ptr, q, e, rows, pid_k, M, K, stride_o, BLOCK_K)


def quantize(x: torch.Tensor, mode: str = "rceil", activation: str = "none", gated: bool = False) -> torch.Tensor:
    """Launcher: packed qdata–scale rows of x [M, K] (K a multiple of 32), as mxfp8.quantize_packed —
    or, with an activation, of ffn_activation(x, activation, gated) (gated: x = [gate | up] [M, 2h])."""
    k = x.shape[-1] // (2 if gated else 1)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], packed_width(k), dtype=torch.uint8, device=x.device)
    if x2.shape[0] and k:
        p = plan_quantize(x, mode, activation, gated)
        launch(p, lambda c, g: _quantize_kernel[g](x2, out, x2.shape[0], k, x2.stride(0), out.stride(0), ACT=activation,
                                                   GATED=gated, RCEIL=mode == "rceil", **c.kwargs(p.interpret)))
    return out.reshape(*x.shape[:-1], packed_width(k))


# -- MXFP8 grouped GEMM -----------------------------------------------------------------------------


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, counts_ptr, N, K,
                         stride_a, stride_bg, stride_bn, stride_c, G: tl.constexpr, GP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Static grid: tiles of every group laid end to end (≤ cdiv(M, BLOCK_M) + G of them); programs
    # past the last tile exit.
    group, tile, row0, n_rows = _tile_of_group(counts_ptr, tl.program_id(0), G, GP, BLOCK_M)
    pid_n = tl.program_id(1)
    if group >= G:
        return
    tile_start = row0 + tile * BLOCK_M
    g_end = row0 + n_rows
    rows = tile_start + tl.arange(0, BLOCK_M)
    rmask = rows < g_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    b_base = b_ptr + _matrix_base(group, stride_bg)  # int64: G·N·(K + K/32) passes 2^31 (see _offsets)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # builtin (tl.zeros is a stdlib jit fn)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ss = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        kmask = ks < K
        smask = ss < K // 32
        a = tl.load(a_ptr + _offsets(rows, ks, stride_a), mask=rmask[:, None] & kmask[None, :], other=0)
        a_s = tl.load(a_ptr + _offsets(rows, K + ss, stride_a), mask=rmask[:, None] & smask[None, :], other=127)
        b = tl.load(b_base + _offsets(cols, ks, stride_bn), mask=cmask[:, None] & kmask[None, :], other=0)
        b_s = tl.load(b_base + _offsets(cols, K + ss, stride_bn), mask=cmask[:, None] & smask[None, :], other=127)
        acc = tl.dot_scaled(a, a_s, "e4m3", tl.trans(b), b_s, "e4m3", acc)
    c = cast_(acc, c_ptr.dtype.element_ty)  # round to nearest also under the interpreter (its cast truncates)
    tl.store(c_ptr + _offsets(rows, cols, stride_c), c, mask=rmask[:, None] & cmask[None, :])


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, out_dtype: torch.dtype,
                 block_m: int = 64, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """Launcher: rows of group g of ``a`` [M, K] (packed along K) times ``b[g]ᵀ`` ([N, K] packed along
    K) → [M, N] in ``out_dtype`` (rows past Σ counts are left unwritten), as ops.mx.mx_grouped_mm."""
    k = a.shape[1] * BLOCK // (BLOCK + 1)
    g_count, n = b.shape[0], b.shape[1]
    c = torch.empty(a.shape[0], n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(a.shape[0], block_m) + g_count, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, b, c, counts, n, k, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                               G=g_count, GP=triton.next_power_of_2(g_count), BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k)
    return c


# -- launch plans (for the kernel cache's inventory: CompiledMoE.kernels()) -------------------------


def _plan(kernel: str, grid: tuple[int, ...], **static) -> LaunchPlan:
    from ..triton_mode import interpreting

    return LaunchPlan(make_spec("mxfp8", kernel, **static), (Config.of(BLOCK_M=64, BLOCK_K=64),),
                      lambda _cfg: grid, interpreting())


def plan_quantize(x: torch.Tensor, mode: str, activation: str = "none", gated: bool = False) -> LaunchPlan:
    k = x.shape[-1] // (2 if gated else 1)
    rows = x.numel() // x.shape[-1]
    return _plan("_quantize_kernel", (triton.cdiv(rows, 64), triton.cdiv(k, 64)), rows=rows, k=k,
                 dtype=x.dtype, mode=mode, activation=activation, gated=gated)


def plan_grouped_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> LaunchPlan:
    return _plan("_grouped_gemm_kernel", (triton.cdiv(a.shape[0], 64) + b.shape[0], triton.cdiv(b.shape[1], 64)),
                 rows=a.shape[0], n=b.shape[1], k=a.shape[1] * BLOCK // (BLOCK + 1),
                 num_local_experts=b.shape[0], out_dtype=out_dtype)
