"""Expert activations over the valid prefix: SwiGLU (gated, silu) and the other supported forms.

Terms: pre [cap, F] is the up-projection output (F = 2h gated: [gate | up]; F = h otherwise), counts
[L] the rows per local expert; valid = Σ counts (read on device), rows past it are never touched.

    gated:     a = act(gate) · up              grad_gate = act'(gate) · (grad_a · up)
                                               grad_up   = grad_a · act(gate)
    not gated: a = act(pre)                    grad_pre  = act'(pre) · grad_a

Arithmetic in fp32, rounded to the tensor dtype where the torch ops round (after act, after each
product), so bf16 results match moe::grouped_ffn's. ``act_fwd`` / ``gated_fwd`` / ``gated_bwd`` are
also the fused prologue and epilogue of the grouped GEMMs (grouped_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_cache import Config, LaunchPlan, cdiv, launch, make_spec, next_pow2
from ..triton_mode import interpreting
from ._lang import cast_, round_, sigmoid_, sum_

# -- activation math (fp32; jit helpers shared with the GEMM prologue/epilogue) --------------------


@triton.jit
def _tanh(z):
    return 2.0 * sigmoid_(2.0 * z) - 1.0


# Constants are literals: constexpr globals multiplied with tensors break under the interpreter.


@triton.jit
def act_fwd(x, ACT: tl.constexpr):
    if ACT == "silu":
        y = x * sigmoid_(x)
    elif ACT == "gelu":
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == "gelu_tanh":
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    else:  # relu
        y = tl.maximum(x, 0.0)
    return y


@triton.jit
def act_bwd(g, x, ACT: tl.constexpr):
    """d act(x)/dx · g."""
    if ACT == "silu":
        s = sigmoid_(x)
        y = g * (s * (1.0 + x * (1.0 - s)))
    elif ACT == "gelu":
        y = g * (0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x))
    elif ACT == "gelu_tanh":
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
        y = g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x))
    else:  # relu
        y = tl.where(x > 0.0, g, 0.0)
    return y


@triton.jit
def gated_fwd(g, u, ACT: tl.constexpr, DT: tl.constexpr):
    """act(g) · u from fp32 tiles, rounded like the torch ops in dtype DT; fp32 result."""
    ag = round_(act_fwd(g, ACT), DT)
    return round_(ag * u, DT)


@triton.jit
def gated_bwd(ga, g, u, ACT: tl.constexpr, DT: tl.constexpr):
    """(grad gate, grad up) of act(g) · u for grad ga (all fp32 tiles of DT values)."""
    gu = round_(ga * u, DT)
    g_gate = round_(act_bwd(gu, g, ACT), DT)
    ag = round_(act_fwd(g, ACT), DT)
    return g_gate, round_(ga * ag, DT)


@triton.jit
def _valid_rows(counts_ptr, G: tl.constexpr, GP: tl.constexpr):
    gs = tl.arange(0, GP)
    return sum_(tl.load(counts_ptr + gs, mask=gs < G, other=0), 0)


# -- kernels --------------------------------------------------------------------------------------


@triton.jit
def swiglu_kernel(pre_ptr, out_ptr, counts_ptr, M, stride_pre, stride_out,
                  H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                  BM: tl.constexpr, BH: tl.constexpr):
    valid = tl.minimum(_valid_rows(counts_ptr, G, GP), M)  # never past the capacity
    row0 = tl.program_id(0) * BM
    if row0 >= valid:  # capacity tiles past the valid prefix
        return
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m = (rows < valid)[:, None] & (cols < H)[None, :]
    DT: tl.constexpr = out_ptr.dtype.element_ty
    x = tl.load(pre_ptr + rows[:, None] * stride_pre + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(pre_ptr + rows[:, None] * stride_pre + (H + cols)[None, :], mask=m, other=0.0).to(tl.float32)
        a = gated_fwd(x, u, ACT, DT)
    else:
        a = act_fwd(x, ACT)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], cast_(a, DT), mask=m)


@triton.jit
def swiglu_backward_kernel(ga_ptr, pre_ptr, gpre_ptr, counts_ptr, M, stride_ga, stride_pre, stride_gpre,
                           H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GATED: tl.constexpr,
                           ACT: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr):
    valid = tl.minimum(_valid_rows(counts_ptr, G, GP), M)  # never past the capacity
    row0 = tl.program_id(0) * BM
    if row0 >= valid:
        return
    rows = (row0 + tl.arange(0, BM)).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m = (rows < valid)[:, None] & (cols < H)[None, :]
    DT: tl.constexpr = gpre_ptr.dtype.element_ty
    ga = tl.load(ga_ptr + rows[:, None] * stride_ga + cols[None, :], mask=m, other=0.0).to(tl.float32)
    x = tl.load(pre_ptr + rows[:, None] * stride_pre + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if GATED:
        u = tl.load(pre_ptr + rows[:, None] * stride_pre + (H + cols)[None, :], mask=m, other=0.0).to(tl.float32)
        g_gate, g_up = gated_bwd(ga, x, u, ACT, DT)
        tl.store(gpre_ptr + rows[:, None] * stride_gpre + cols[None, :], cast_(g_gate, DT), mask=m)
        tl.store(gpre_ptr + rows[:, None] * stride_gpre + (H + cols)[None, :], cast_(g_up, DT), mask=m)
    else:
        tl.store(gpre_ptr + rows[:, None] * stride_gpre + cols[None, :], cast_(act_bwd(ga, x, ACT), DT), mask=m)


# -- launch plans ---------------------------------------------------------------------------------


def plan_swiglu(pre: torch.Tensor, num_local: int, activation: str, gated: bool, backward: bool = False) -> LaunchPlan:
    cap, f = pre.shape
    h = f // 2 if gated else f
    kernel = "swiglu_backward_kernel" if backward else "swiglu_kernel"
    spec = make_spec("swiglu", kernel, cap=cap, h=h, L=num_local, dtype=pre.dtype, activation=activation,
                     gated=gated)
    bh = min(next_pow2(h), 128)
    if interpreting():
        cfgs = (Config.of(BM=64, BH=max(64, bh)),)
    else:
        cfgs = tuple(Config.of(BM=bm, BH=bh, num_warps=w) for bm, w in ((32, 4), (64, 8), (16, 4)))
    return LaunchPlan(spec, cfgs, lambda c: (max(1, cdiv(cap, c["BM"])), cdiv(h, c["BH"])), interpreting())


# -- launchers ------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def swiglu(pre: torch.Tensor, counts: torch.Tensor, activation: str, gated: bool,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """a [cap, h]: the activation of the valid prefix of ``pre``; rows past it are left unwritten."""
    pre = _rows(pre)
    cap, f = pre.shape
    h = f // 2 if gated else f
    out = pre.new_empty(cap, h) if out is None else out
    if out.shape != (cap, h) or out.stride(1) != 1:
        raise ValueError(f"swiglu: out {tuple(out.shape)} must be a row-major [{cap}, {h}] buffer")
    if cap and h:
        p = plan_swiglu(pre, counts.numel(), activation, gated)
        launch(p, lambda c, g: swiglu_kernel[g](pre, out, counts, cap, pre.stride(0), out.stride(0), H=h, G=counts.numel(),
                                                GP=next_pow2(counts.numel()), GATED=gated, ACT=activation,
                                                **c.kwargs(p.interpret)))
    return out


def swiglu_backward(grad_a: torch.Tensor, pre: torch.Tensor, counts: torch.Tensor, activation: str,
                    gated: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """grad pre [cap, F] over the valid prefix (rows past it are left unwritten)."""
    grad_a, pre = _rows(grad_a), _rows(pre)
    cap, f = pre.shape
    h = f // 2 if gated else f
    g_pre = torch.empty_like(pre) if out is None else out
    if g_pre.shape != pre.shape or grad_a.shape != (cap, h) or g_pre.stride(1) != 1:
        raise ValueError(f"swiglu_backward: grad_a {tuple(grad_a.shape)}, pre {tuple(pre.shape)}, out "
                         f"{tuple(g_pre.shape)} do not fit (gated={gated})")
    if cap and h:
        p = plan_swiglu(pre, counts.numel(), activation, gated, backward=True)
        launch(p, lambda c, g: swiglu_backward_kernel[g](
            grad_a, pre, g_pre, counts, cap, grad_a.stride(0), pre.stride(0), g_pre.stride(0), H=h, G=counts.numel(),
            GP=next_pow2(counts.numel()), GATED=gated, ACT=activation, **c.kwargs(p.interpret)))
    return g_pre


# -- torch references (the formulas of moe::grouped_ffn on the valid prefix) ----------------------


def swiglu_reference(pre: torch.Tensor, counts: torch.Tensor, activation: str, gated: bool) -> torch.Tensor:
    from ...ops.activations import act_forward

    p = pre[: int(counts.sum())]
    if gated:
        g, u = p.chunk(2, dim=-1)
        return act_forward(activation, g) * u
    return act_forward(activation, p)


def swiglu_backward_reference(grad_a, pre, counts, activation, gated):
    from ...ops.activations import act_backward, act_forward

    v = int(counts.sum())
    ga, p = grad_a[:v], pre[:v]
    if gated:
        g, u = p.chunk(2, dim=-1)
        return torch.cat([act_backward(activation, ga * u, g), ga * act_forward(activation, g)], dim=1)
    return act_backward(activation, ga, p)
