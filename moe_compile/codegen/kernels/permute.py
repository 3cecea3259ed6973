"""Permute: gather token rows into expert order (the data half of moe::permute).

    xs[r, :] = x[order[r] // K, :]        r < R = T·K,  order from route_map.expert_order

One program copies a BR × BD tile; rows are gathered, the output is written contiguously.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_cache import Config, LaunchPlan, cdiv, launch, make_spec, next_pow2
from ..triton_mode import interpreting
from .route_map import expert_order

# -- kernel ---------------------------------------------------------------------------------------


@triton.jit
def gather_rows_kernel(x_ptr, order_ptr, out_ptr, R, stride_x, stride_out,
                       D: tl.constexpr, TOP_K: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    rm = r < R
    src = tl.load(order_ptr + r, mask=rm, other=0) // TOP_K
    m = rm[:, None] & (cols < D)[None, :]
    rows = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_out + cols[None, :], rows, mask=m)


# -- launch plan ----------------------------------------------------------------------------------


def plan_gather(x: torch.Tensor, num_rows: int, top_k: int) -> LaunchPlan:
    d = x.shape[1]
    spec = make_spec("permute", "gather_rows_kernel", R=num_rows, d=d, top_k=top_k, dtype=x.dtype)
    bd = min(next_pow2(d), 256)
    if interpreting():
        cfgs = (Config.of(BR=64, BD=max(64, bd)),)
    else:
        cfgs = tuple(Config.of(BR=br, BD=b, num_warps=w) for br, b, w in ((32, bd, 4), (64, bd, 8), (16, bd, 4)))
    return LaunchPlan(spec, cfgs, lambda c: (max(1, cdiv(num_rows, c["BR"])), cdiv(d, c["BD"])), interpreting())


# -- launcher -------------------------------------------------------------------------------------


def gather_rows(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    if order.numel() % top_k or order.numel() // top_k != x.shape[0]:
        raise ValueError(f"permute: order of {order.numel()} rows does not fit x {tuple(x.shape)} with top_k={top_k}")
    x = x.contiguous() if x.stride(1) != 1 else x
    r, d = order.numel(), x.shape[1]
    out = x.new_empty(r, d)
    if r and d:
        p = plan_gather(x, r, top_k)
        launch(p, lambda c, g: gather_rows_kernel[g](x, order, out, r, x.stride(0), out.stride(0), D=d, TOP_K=top_k,
                                                     **c.kwargs(p.interpret)))
    return out


def permute(x: torch.Tensor, idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xs [R, d] in expert order, order [R], counts [N]) — moe::permute's outputs."""
    order, counts, _offsets = expert_order(idx, num_experts)
    return gather_rows(x, order, idx.shape[1]), order, counts


# -- torch reference ------------------------------------------------------------------------------


def permute_reference(x: torch.Tensor, idx: torch.Tensor, num_experts: int):
    return torch.ops.moe.permute(x, idx, num_experts, "reference")
