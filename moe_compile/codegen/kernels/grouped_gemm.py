"""Grouped GEMM over expert offsets (FP32 / BF16), with fused activation forms, and the per-expert
weight-gradient GEMM.

Terms: a [cap, K] rows in expert-major order with a valid prefix; counts [G] rows per local expert
(a device tensor: offsets are computed in the kernel, never on the host); b [G, K, N] (any strides,
so weight transposes are views).

    grouped_mm_kernel         c[rows of g] = A_g @ b[g]
        grid  = (cdiv(cap, BM) + G, cdiv(N, BN))       static: Σ_g cdiv(count_g, BM) ≤ cdiv(cap, BM) + G
        tile  → (g, i): the i-th BM-row tile of expert g, from the prefix sum of cdiv(count_g, BM);
                tiles past the last expert exit at once (no host sync, no padding rows computed)
        PROLOGUE "gated": A = act(a[:, :K]) · a[:, K:2K]   (SwiGLU fused into the down projection)
                 "act":   A = act(a)
        EPILOGUE "gated_backward" / "act_backward": c holds grad pre from acc = grad a and e = pre
                 (the activation's backward fused into the grad-a GEMM)
    grouped_mm_wgrad_kernel   out[g] = x[rows of g]ᵀ @ y[rows of g]     [G, I, J]
        grid  = (G, cdiv(I, BI), cdiv(J, BJ)); the loop over the expert's rows is bounded by its
                count (empty experts write zeros); PROLOGUE on y as above

Accumulation in fp32; fp32 operands use IEEE dot products unless torch allows TF32 matmuls.
Triton interpreter bug handled here: tl.dot on bf16/fp16 operands is silently wrong under
TRITON_INTERPRET=1, so interpreted launches upcast the operands to fp32 first (UPCAST).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_cache import Config, LaunchPlan, cdiv, launch, make_spec, next_pow2
from ..triton_mode import interpreting
from ._lang import cast_, cumsum_, round_, sum_
from .swiglu import act_bwd, act_fwd, gated_bwd, gated_fwd

PROLOGUES = ("none", "gated", "act")
EPILOGUES = ("none", "gated_backward", "act_backward")

# -- kernels --------------------------------------------------------------------------------------


@triton.jit
def _tile_of_group(counts_ptr, pid_m, G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr):
    """(expert g, tile index inside it, first row of the expert, its row count) of M-tile pid_m."""
    gs = tl.arange(0, GP)
    cnt = tl.load(counts_ptr + gs, mask=gs < G, other=0)
    tiles = (cnt + BM - 1) // BM
    cum = cumsum_(tiles, 0)
    g = sum_((cum <= pid_m).to(tl.int32), 0)
    sel = gs == g
    first_tile = sum_(tl.where(sel, cum - tiles, 0), 0)
    row0 = sum_(tl.where(gs < g, cnt, 0), 0)
    n = sum_(tl.where(sel, cnt, 0), 0)
    return g, pid_m - first_tile, row0, n


@triton.jit
def grouped_mm_kernel(a_ptr, b_ptr, c_ptr, counts_ptr, e_ptr, M,
                      stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cm, stride_em,
                      N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                      PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, ACT: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    g, tile, row0, n = _tile_of_group(counts_ptr, tl.program_id(0), G, GP, BM)
    if g >= G:  # past the valid prefix
        return
    local = tile * BM + tl.arange(0, BM)
    rows = (row0 + local).to(tl.int64)
    rmask = (local < n) & (rows < M)  # counts summing past the capacity never reach past the buffer
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < N
    ADT: tl.constexpr = b_ptr.dtype.element_ty
    b_base = b_ptr + g.to(tl.int64) * stride_bg
    acc = tl.full([BM, BN], 0, tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        am = rmask[:, None] & kmask[None, :]
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :] * stride_ak, mask=am, other=0.0)
        if PROLOGUE == "gated":
            u = tl.load(a_ptr + rows[:, None] * stride_am + (K + kk)[None, :] * stride_ak, mask=am, other=0.0)
            a = cast_(gated_fwd(a.to(tl.float32), u.to(tl.float32), ACT, ADT), ADT)
        elif PROLOGUE == "act":
            a = cast_(act_fwd(a.to(tl.float32), ACT), ADT)
        b = tl.load(b_base + kk[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        if UPCAST:  # Triton interpreter bug: bf16 tl.dot is silently wrong (np.matmul on the raw
            #          uint16 storage of the bf16 values); compute the product in fp32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    m = rmask[:, None] & cmask[None, :]
    DT: tl.constexpr = c_ptr.dtype.element_ty
    c_rows = c_ptr + rows[:, None] * stride_cm
    if EPILOGUE == "none":
        tl.store(c_rows + cols[None, :], cast_(acc, DT), mask=m)
    else:
        ga = round_(acc, DT)  # grad a, rounded as the unfused GEMM output would be
        e_rows = e_ptr + rows[:, None] * stride_em
        x = tl.load(e_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if EPILOGUE == "gated_backward":
            u = tl.load(e_rows + (N + cols)[None, :], mask=m, other=0.0).to(tl.float32)
            g_gate, g_up = gated_bwd(ga, x, u, ACT, DT)
            tl.store(c_rows + cols[None, :], cast_(g_gate, DT), mask=m)
            tl.store(c_rows + (N + cols)[None, :], cast_(g_up, DT), mask=m)
        else:
            tl.store(c_rows + cols[None, :], cast_(act_bwd(ga, x, ACT), DT), mask=m)


@triton.jit
def grouped_mm_wgrad_kernel(x_ptr, y_ptr, out_ptr, counts_ptr, M,
                            stride_xm, stride_xi, stride_ym, stride_yj, stride_og, stride_oi, stride_oj,
                            NI: tl.constexpr, NJ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                            PROLOGUE: tl.constexpr, ACT: tl.constexpr, UPCAST: tl.constexpr,
                            PRECISION: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr):
    g = tl.program_id(0)
    gs = tl.arange(0, GP)
    cnt = tl.load(counts_ptr + gs, mask=gs < G, other=0)
    n = sum_(tl.where(gs == g, cnt, 0), 0)
    row0 = sum_(tl.where(gs < g, cnt, 0), 0)
    ii = tl.program_id(1) * BI + tl.arange(0, BI)
    jj = tl.program_id(2) * BJ + tl.arange(0, BJ)
    imask = ii < NI
    jmask = jj < NJ
    YDT: tl.constexpr = y_ptr.dtype.element_ty
    acc = tl.full([BI, BJ], 0, tl.float32)
    for r0 in range(0, n, BR):
        lr = r0 + tl.arange(0, BR)
        rows = (row0 + lr).to(tl.int64)
        rm = (lr < n) & (rows < M)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ii[None, :] * stride_xi,
                    mask=rm[:, None] & imask[None, :], other=0.0)
        ym = rm[:, None] & jmask[None, :]
        y = tl.load(y_ptr + rows[:, None] * stride_ym + jj[None, :] * stride_yj, mask=ym, other=0.0)
        if PROLOGUE == "gated":
            u = tl.load(y_ptr + rows[:, None] * stride_ym + (NJ + jj)[None, :] * stride_yj, mask=ym, other=0.0)
            y = cast_(gated_fwd(y.to(tl.float32), u.to(tl.float32), ACT, YDT), YDT)
        elif PROLOGUE == "act":
            y = cast_(act_fwd(y.to(tl.float32), ACT), YDT)
        if UPCAST:  # Triton interpreter: bf16 tl.dot is silently wrong; compute the product in fp32
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(tl.trans(x), y, acc, input_precision=PRECISION)
    o = out_ptr + g.to(tl.int64) * stride_og + ii[:, None] * stride_oi + jj[None, :] * stride_oj
    tl.store(o, cast_(acc, out_ptr.dtype.element_ty), mask=imask[:, None] & jmask[None, :])


# -- launch plans ---------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str | None:
    if dtype != torch.float32:
        return None  # bf16/fp16 operands: the setting does not apply (triton's default)
    # torch's fp32 matmuls (the reference) use TF32 only when allowed
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _upcast(dtype: torch.dtype) -> bool:
    return interpreting() and dtype in (torch.bfloat16, torch.float16)


GEMM_CONFIGS = (  # (BM, BN, BK, warps, stages) candidates on GPU, filtered per shape
    (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 64, 32, 4, 3),
)


def _gemm_configs(n: int, k: int, dtype: torch.dtype, rows: str, cols: str, red: str) -> tuple[Config, ...]:
    if interpreting():  # one fixed, valid config; tiles ≥ 64 keep the interpreter fast enough
        return (Config.of(**{rows: 64, cols: max(64, min(next_pow2(n), 128)), red: 64}),)
    out = []
    for bm, bn, bk, w, s in GEMM_CONFIGS:
        if bn > max(64, next_pow2(n)) or bk > max(32, next_pow2(k)):
            continue
        if dtype == torch.float32 and bm * bn > 128 * 128:
            continue  # fp32 tiles of that size exceed shared memory with 3+ stages
        out.append(Config.of(num_warps=w, num_stages=s, **{rows: bm, cols: bn, red: bk}))
    return tuple(out)


def plan_grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, prologue: str = "none",
                    epilogue: str = "none", activation: str = "silu") -> LaunchPlan:
    cap, (g, k, n) = a.shape[0], b.shape
    spec = make_spec("grouped_gemm", "grouped_mm_kernel", cap=cap, N=n, K=k, L=g, dtype=b.dtype, out=a.dtype,
                     prologue=prologue, epilogue=epilogue,
                     activation=activation if (prologue, epilogue) != ("none", "none") else None,
                     precision=_precision(b.dtype))
    cfgs = _gemm_configs(n, k, b.dtype, "BM", "BN", "BK")
    return LaunchPlan(spec, cfgs, lambda c: (cdiv(cap, c["BM"]) + g, cdiv(n, c["BN"])), interpreting())


def plan_grouped_mm_wgrad(x: torch.Tensor, y: torch.Tensor, counts: torch.Tensor, prologue: str = "none",
                          activation: str = "silu") -> LaunchPlan:
    cap, i = x.shape
    j = y.shape[1] // 2 if prologue == "gated" else y.shape[1]
    g = counts.numel()
    spec = make_spec("grouped_gemm", "grouped_mm_wgrad_kernel", cap=cap, I=i, J=j, L=g, dtype=x.dtype,
                     prologue=prologue, activation=activation if prologue != "none" else None,
                     precision=_precision(x.dtype))
    cfgs = _gemm_configs(j, 64, x.dtype, "BI", "BJ", "BR")
    return LaunchPlan(spec, cfgs, lambda c: (g, cdiv(i, c["BI"]), cdiv(j, c["BJ"])), interpreting())


# -- launchers ------------------------------------------------------------------------------------


def grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, prologue: str = "none",
               epilogue: str = "none", activation: str = "silu", e: torch.Tensor | None = None) -> torch.Tensor:
    """c [cap, N] (or [cap, 2N] with the gated backward epilogue): rows of expert g are A_g @ b[g],
    A = a, or act(a[:, :K]) · a[:, K:] ("gated"), or act(a) ("act"); b [G, K, N]. Rows past the valid
    prefix are left unwritten. Epilogues turn the product (grad a) into grad pre using ``e`` = pre."""
    if prologue not in PROLOGUES or epilogue not in EPILOGUES:
        raise ValueError(f"grouped_mm: prologue {prologue!r} / epilogue {epilogue!r}; known {PROLOGUES} / {EPILOGUES}")
    cap, (g, k, n) = a.shape[0], b.shape
    if counts.numel() != g:
        raise ValueError(f"grouped_mm: counts has {counts.numel()} experts, b has {g}")
    if a.dtype != b.dtype:
        raise ValueError(f"grouped_mm: operands must share a dtype, got a {a.dtype} and b {b.dtype}")
    want_k = 2 * k if prologue == "gated" else k
    if a.shape[1] != want_k:
        raise ValueError(f"grouped_mm: a has {a.shape[1]} columns, expected {want_k} for b {tuple(b.shape)} "
                         f"and prologue {prologue!r}")
    c = a.new_empty(cap, 2 * n if epilogue == "gated_backward" else n)
    if epilogue != "none" and (e is None or e.shape != c.shape):
        raise ValueError(f"grouped_mm: epilogue {epilogue!r} needs e = pre of shape {tuple(c.shape)}, got "
                         f"{None if e is None else tuple(e.shape)}")
    if not (cap and n):
        return c
    e_t = (e if e.stride(1) == 1 else e.contiguous()) if e is not None else c
    p = plan_grouped_mm(a, b, counts, prologue, epilogue, activation)
    launch(p, lambda cfg, grid: grouped_mm_kernel[grid](
        a, b, c, counts, e_t, cap, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        e_t.stride(0), N=n, K=k, G=g, GP=next_pow2(g), PROLOGUE=prologue, EPILOGUE=epilogue, ACT=activation,
        UPCAST=_upcast(b.dtype), PRECISION=_precision(b.dtype), **cfg.kwargs(p.interpret)))
    return c


def grouped_mm_wgrad(x: torch.Tensor, y: torch.Tensor, counts: torch.Tensor, prologue: str = "none",
                     activation: str = "silu") -> torch.Tensor:
    """out [G, I, J]: out[g] = x[rows of g]ᵀ @ Y[rows of g], Y = y or its activation ("gated" / "act")."""
    cap, i = x.shape
    j = y.shape[1] // 2 if prologue == "gated" else y.shape[1]
    g = counts.numel()
    if y.shape[0] != cap or x.dtype != y.dtype:
        raise ValueError(f"grouped_mm_wgrad: x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} must share "
                         "rows and dtype")
    out = x.new_empty(g, i, j)
    if not (g and i and j):
        return out
    p = plan_grouped_mm_wgrad(x, y, counts, prologue, activation)
    launch(p, lambda cfg, grid: grouped_mm_wgrad_kernel[grid](
        x, y, out, counts, cap, x.stride(0), x.stride(1), y.stride(0), y.stride(1), out.stride(0), out.stride(1),
        out.stride(2), NI=i, NJ=j, G=g, GP=next_pow2(g), PROLOGUE=prologue, ACT=activation,
        UPCAST=_upcast(x.dtype), PRECISION=_precision(x.dtype), **cfg.kwargs(p.interpret)))
    return out


# -- torch references (moe_compile.ops.grouped_mm on the valid prefix) ----------------------------


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    from ...ops.grouped_mm import grouped_mm as torch_grouped_mm

    v = int(counts.sum())
    return torch_grouped_mm(a[:v], b, counts)


def grouped_mm_wgrad_reference(x: torch.Tensor, y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    from ...ops.grouped_mm import grouped_mm as torch_grouped_mm

    v = int(counts.sum())
    return torch_grouped_mm(x[:v].t(), y[:v], counts)
