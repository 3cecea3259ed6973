"""Unpermute-combine: router-weighted accumulation of expert-order rows into token order, and its
backward. Deterministic (no atomics) and bit-compatible with moe::unpermute's summation order.

Terms: T tokens, K = top_k, R = T·K rows in expert order, pos = inverse of order (route_map).

    y[t] = Σ_k  (back[pos[t, k]] · w[t, k]).to(dtype)     summed in fp32 in increasing pos, rounded
           to dtype once — the order and rounding of ``index_add_`` in moe::unpermute (on the CPU)
    (w = 1 without weights: moe::permute_backward, the gradient of the gather)

    backward, per expert-order row r (i = order[r], t = i // K):
    grad_back[r] = (grad_y[t] · w[i]).to(dtype)
    grad_w[i]    = Σ_d grad_y[t, d] · back[r, d]           (in the weights' dtype)

One program of unpermute_kernel owns BT tokens × BD columns: it ranks each token's K positions
(a K×K comparison, no sort) and adds the rows in that order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_cache import Config, LaunchPlan, cdiv, launch, make_spec, next_pow2
from ..triton_mode import interpreting
from ._lang import cast_, round_, sum_
from .route_map import invert_order

# -- kernels --------------------------------------------------------------------------------------


@triton.jit
def unpermute_kernel(src_ptr, pos_ptr, w_ptr, out_ptr, T, stride_src, stride_out,
                     D: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr,
                     BT: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    tm = t < T
    ks = tl.arange(0, KP)
    flat = t.to(tl.int64)[:, None] * TOP_K + ks[None, :]
    p = tl.load(pos_ptr + flat, mask=tm[:, None] & (ks < TOP_K)[None, :], other=1 << 40)  # pad k: ranks last
    p = tl.where(tm[:, None], p, 0)  # tokens past T: in range (their loads and stores are masked)
    rank = sum_((p[:, None, :] < p[:, :, None]).to(tl.int32), 2)  # [BT, KP]: earlier positions
    m = tm[:, None] & (cols < D)[None, :]
    acc = tl.full([BT, BD], 0, tl.float32)
    for j in tl.static_range(TOP_K):
        sel = rank == j
        pj = sum_(tl.where(sel, p, 0), 1)
        rows = tl.load(src_ptr + pj[:, None] * stride_src + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_W:
            kj = sum_(tl.where(sel, ks[None, :], 0), 1)
            w = tl.load(w_ptr + t.to(tl.int64) * TOP_K + kj, mask=tm, other=0.0).to(tl.float32)
            rows = rows * w[:, None]
        # the contribution is rounded to the output dtype (moe::unpermute's .to(back.dtype)); the sum
        # stays fp32 until the store, as index_add_ accumulates bf16 on the CPU
        acc += round_(rows, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_out + cols[None, :], cast_(acc, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def unpermute_backward_kernel(gy_ptr, back_ptr, order_ptr, w_ptr, gback_ptr, gw_ptr, R,
                              stride_gy, stride_back, stride_gback,
                              D: tl.constexpr, TOP_K: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < R
    i = tl.load(order_ptr + r, mask=rm, other=0)
    t = i // TOP_K
    w = tl.load(w_ptr + i, mask=rm, other=0.0)
    wf = w.to(tl.float32)
    wdt = w_ptr.dtype.element_ty
    dot = tl.full([BR], 0, tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m = rm[:, None] & (cols < D)[None, :]
        gy = tl.load(gy_ptr + t[:, None] * stride_gy + cols[None, :], mask=m, other=0.0)
        bk = tl.load(back_ptr + r.to(tl.int64)[:, None] * stride_back + cols[None, :], mask=m, other=0.0)
        gb = gy.to(tl.float32) * wf[:, None]
        tl.store(gback_ptr + r.to(tl.int64)[:, None] * stride_gback + cols[None, :],
                 cast_(gb, gback_ptr.dtype.element_ty), mask=m)
        prod = round_(gy.to(tl.float32), wdt) * round_(bk.to(tl.float32), wdt)  # product in the weights' dtype
        dot += sum_(round_(prod, wdt), 1)
    tl.store(gw_ptr + i, cast_(dot, gw_ptr.dtype.element_ty), mask=rm)


# -- launch plans ---------------------------------------------------------------------------------


def plan_unpermute(src: torch.Tensor, num_tokens: int, top_k: int, weighted: bool) -> LaunchPlan:
    d = src.shape[1]
    spec = make_spec("unpermute", "unpermute_kernel", T=num_tokens, d=d, top_k=top_k, dtype=src.dtype,
                     weighted=weighted)
    bd = min(next_pow2(d), 256)
    if interpreting():
        cfgs = (Config.of(BT=64, BD=max(64, bd)),)
    else:
        cfgs = tuple(Config.of(BT=bt, BD=b, num_warps=w) for bt, b, w in ((16, bd, 4), (32, bd, 8), (8, bd, 4)))
    return LaunchPlan(spec, cfgs, lambda c: (max(1, cdiv(num_tokens, c["BT"])), cdiv(d, c["BD"])), interpreting())


def plan_unpermute_backward(back: torch.Tensor, weights: torch.Tensor) -> LaunchPlan:
    r, d = back.shape
    spec = make_spec("unpermute", "unpermute_backward_kernel", R=r, d=d, top_k=weights.shape[1],
                     dtype=back.dtype, weights=weights.dtype)
    bd = min(next_pow2(d), 256)
    if interpreting():
        cfgs = (Config.of(BR=64, BD=max(64, bd)),)
    else:
        cfgs = tuple(Config.of(BR=br, BD=bd, num_warps=w) for br, w in ((16, 4), (32, 8), (8, 4)))
    return LaunchPlan(spec, cfgs, lambda c: (max(1, cdiv(r, c["BR"])),), interpreting())


# -- launchers ------------------------------------------------------------------------------------


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def combine_rows(src: torch.Tensor, order: torch.Tensor, num_tokens: int, top_k: int,
                 weights: torch.Tensor | None) -> torch.Tensor:
    """y [T, d]: Σ_k (w ·) src[pos[t, k]] in moe::unpermute's order and rounding."""
    if not (src.shape[0] == order.numel() == num_tokens * top_k) or (weights is not None and weights.shape !=
                                                                       (num_tokens, top_k)):
        raise ValueError(f"unpermute: rows {tuple(src.shape)}, order {tuple(order.shape)}, weights "
                         f"{None if weights is None else tuple(weights.shape)} do not fit T={num_tokens}, K={top_k}")
    src = _rows(src)
    d = src.shape[1]
    out = src.new_empty(num_tokens, d)
    if not (num_tokens and d):
        return out
    pos = invert_order(order)
    w = weights.contiguous() if weights is not None else pos  # unused pointer when unweighted
    p = plan_unpermute(src, num_tokens, top_k, weights is not None)
    launch(p, lambda c, g: unpermute_kernel[g](src, pos, w, out, num_tokens, src.stride(0), out.stride(0), D=d,
                                               TOP_K=top_k, KP=next_pow2(top_k), HAS_W=weights is not None,
                                               **c.kwargs(p.interpret)))
    return out


def unpermute(back: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe::unpermute: y [T, d] = Σ_k weights[t, k] · back[row(t, k)]."""
    return combine_rows(back, order, weights.shape[0], weights.shape[1], weights)


def permute_backward(grad_xs: torch.Tensor, order: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """moe::permute_backward: gradient of the gather, Σ_k grad_xs[row(t, k)]."""
    return combine_rows(grad_xs, order, num_tokens, top_k, None)


def unpermute_backward(grad_y: torch.Tensor, back: torch.Tensor, order: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe::unpermute_backward: (grad back [R, d], grad weights [T, K])."""
    if not (back.shape[0] == order.numel() == weights.numel()) or grad_y.shape != (weights.shape[0], back.shape[1]):
        raise ValueError(f"unpermute_backward: grad_y {tuple(grad_y.shape)}, back {tuple(back.shape)}, order "
                         f"{tuple(order.shape)}, weights {tuple(weights.shape)} do not fit together")
    grad_y, back, w = _rows(grad_y), _rows(back), weights.contiguous()
    r, d = back.shape
    g_back = torch.empty_like(back)
    g_w = torch.empty_like(w)
    if r:
        p = plan_unpermute_backward(back, w)
        launch(p, lambda c, g: unpermute_backward_kernel[g](
            grad_y, back, order, w, g_back, g_w, r, grad_y.stride(0), back.stride(0), g_back.stride(0),
            D=d, TOP_K=w.shape[1], **c.kwargs(p.interpret)))
    return g_back, g_w


# -- torch references -----------------------------------------------------------------------------


def unpermute_reference(back, order, weights):
    return torch.ops.moe.unpermute(back, order, weights, "reference")


def permute_backward_reference(grad_xs, order, num_tokens, top_k):
    return torch.ops.moe.permute_backward(grad_xs, order, num_tokens, top_k, "reference")


def unpermute_backward_reference(grad_y, back, order, weights):
    return torch.ops.moe.unpermute_backward(grad_y, back, order, weights, "reference")
