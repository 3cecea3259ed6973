"""Route-map build: per-expert counts and offsets, the stable expert order of the routed rows, its
inverse, and the destination rows of a dispatch.

Terms: R = T·K routed rows (flat (token, k) index i), N experts, B rows per program (a block).

    hist[b, e]    = #{i in block b : idx[i] = e}                               block_histogram_kernel
    counts[e]     = Σ_b hist[b, e];   offsets[e] = Σ_{e' < e} counts[e']
    base[b, e]    = offsets[e] + Σ_{b' < b} hist[b', e]                         scan_kernel (1 program)
    pos[i]        = base[block(i), idx[i]] + #{i' < i in block(i) : idx[i'] = idx[i]}
    order[pos[i]] = i                                                           route_rows_kernel
  a stable counting sort: order = argsort(idx.flatten(), stable=True), as moe::permute computes it.

    pos[order[r]] = r                                                           invert_order_kernel

Destination rows of a dispatch (the symmetric transport's route map; layout [2, ep, ep, L] holds the
requested / kept rows, see moe_compile.runtime.symmetric_transport.route_map):

    expert[i]  = #{n : ends[n] ≤ i}   (ends = cumsum of requested[me] over global experts n = dst·L + e)
    j          = i − (ends − requested[me])[expert[i]]
    dst_row[i] = e_off[dst, e] + s_off[dst, e] + j   if j < kept[me, dst, e]   else −1   dst_rows_kernel

Everything runs on device with static grids: no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_cache import Config, LaunchPlan, cdiv, launch, make_spec, next_pow2
from ..triton_mode import interpreting
from ._lang import cumsum_, sum_

# -- kernels --------------------------------------------------------------------------------------


@triton.jit
def block_histogram_kernel(idx_ptr, hist_ptr, R, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(idx_ptr + i, mask=i < R, other=-1)
    experts = tl.arange(0, NP)
    onehot = (e[:, None] == experts[None, :]).to(tl.int32)
    tl.store(hist_ptr + b * N + experts, sum_(onehot, 0), mask=experts < N)


@triton.jit
def scan_kernel(hist_ptr, base_ptr, counts_ptr, offsets_ptr, NB, N: tl.constexpr, NP: tl.constexpr):
    experts = tl.arange(0, NP)
    m = experts < N
    total = tl.full([NP], 0, tl.int64)
    for b in range(0, NB):
        total += tl.load(hist_ptr + b * N + experts, mask=m, other=0).to(tl.int64)
    offsets = cumsum_(total, 0) - total
    tl.store(counts_ptr + experts, total, mask=m)
    tl.store(offsets_ptr + experts, offsets, mask=m)
    run = offsets
    for b in range(0, NB):
        tl.store(base_ptr + b * N + experts, run, mask=m)
        run += tl.load(hist_ptr + b * N + experts, mask=m, other=0).to(tl.int64)


@triton.jit
def route_rows_kernel(idx_ptr, base_ptr, order_ptr, R, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    valid = i < R
    e = tl.load(idx_ptr + i, mask=valid, other=-1)
    onehot = (e[:, None] == tl.arange(0, NP)[None, :]).to(tl.int32)
    rank = sum_(cumsum_(onehot, 0) * onehot, 1) - 1  # earlier rows of the same expert in this block
    base = tl.load(base_ptr + b * N + e, mask=valid, other=0)
    tl.store(order_ptr + base + rank, i.to(tl.int64), mask=valid)


@triton.jit
def invert_order_kernel(order_ptr, pos_ptr, R, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = r < R
    i = tl.load(order_ptr + r, mask=valid, other=0)
    tl.store(pos_ptr + i, r.to(tl.int64), mask=valid)


@triton.jit
def dst_rows_kernel(layout_ptr, dst_rank_ptr, dst_row_ptr, me, R,
                    EP: tl.constexpr, L: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.arange(0, NP)  # global expert n = dst·L + e
    m = n < EP * L
    kept_ptr = layout_ptr + EP * EP * L  # layout[1]
    req = tl.load(layout_ptr + me * EP * L + n, mask=m, other=0)  # requested[me, dst, e]
    keep_me = tl.load(kept_ptr + me * EP * L + n, mask=m, other=0)  # kept[me, dst, e]
    per_e = tl.full([NP], 0, tl.int64)  # Σ_s kept[s, dst, e]
    s_off = tl.full([NP], 0, tl.int64)  # Σ_{s < me} kept[s, dst, e]
    for s in tl.static_range(EP):
        k = tl.load(kept_ptr + s * EP * L + n, mask=m, other=0)
        per_e += k
        s_off += tl.where(me > s, k, 0)  # (tensor on the left: s is a constexpr)
    # e_off[n] = rows of lower local experts on the same destination
    lower = ((n[:, None] // L) == (n[None, :] // L)) & (n[None, :] < n[:, None])
    e_off = sum_(tl.where(lower, per_e[None, :], 0), 1)
    ends = cumsum_(req, 0)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = i < R
    expert = sum_(((ends[None, :] <= i[:, None]) & m[None, :]).to(tl.int32), 1)
    pick = expert[:, None] == n[None, :]
    j = i - sum_(tl.where(pick, (ends - req)[None, :], 0), 1)
    kept = j < sum_(tl.where(pick, keep_me[None, :], 0), 1)
    row = sum_(tl.where(pick, (e_off + s_off)[None, :], 0), 1) + j
    tl.store(dst_rank_ptr + i, (expert // L).to(tl.int64), mask=valid)
    tl.store(dst_row_ptr + i, tl.where(kept, row, -1).to(tl.int64), mask=valid)


# -- launch plans (shapes and dtypes only: lowering calls them on fake tensors) --------------------


def _block(num_experts: int) -> int:
    # rows per program of the histogram/route-rows pair (one value for both: the base table is per
    # block); the one-hot tile is BLOCK × next_pow2(N) int32.
    return 256 if interpreting() or next_pow2(num_experts) <= 64 else 128


def plan_histogram(idx: torch.Tensor, num_experts: int) -> LaunchPlan:
    r, blk = idx.numel(), _block(num_experts)
    spec = make_spec("route_map", "block_histogram_kernel", R=r, N=num_experts, idx=idx.dtype, BLOCK=blk)
    return LaunchPlan(spec, (Config.of(BLOCK=blk),), lambda c: (max(1, cdiv(r, c["BLOCK"])),), interpreting())


def plan_scan(idx: torch.Tensor, num_experts: int) -> LaunchPlan:
    spec = make_spec("route_map", "scan_kernel", R=idx.numel(), N=num_experts, BLOCK=_block(num_experts))
    return LaunchPlan(spec, (Config.of(num_warps=1, num_stages=1),), lambda c: (1,), interpreting())


def plan_route_rows(idx: torch.Tensor, num_experts: int) -> LaunchPlan:
    r, blk = idx.numel(), _block(num_experts)
    spec = make_spec("route_map", "route_rows_kernel", R=r, N=num_experts, idx=idx.dtype, BLOCK=blk)
    return LaunchPlan(spec, (Config.of(BLOCK=blk),), lambda c: (max(1, cdiv(r, c["BLOCK"])),), interpreting())


def plan_invert(order: torch.Tensor) -> LaunchPlan:
    r = order.numel()
    spec = make_spec("route_map", "invert_order_kernel", R=r)
    cfgs = (Config.of(BLOCK=1024),) if interpreting() else (Config.of(BLOCK=1024), Config.of(BLOCK=256))
    return LaunchPlan(spec, cfgs, lambda c: (max(1, cdiv(r, c["BLOCK"])),), interpreting())


def plan_dst_rows(layout: torch.Tensor, num_rows: int) -> LaunchPlan:
    ep, nl = layout.shape[1], layout.shape[3]
    spec = make_spec("route_map", "dst_rows_kernel", R=num_rows, ep=ep, L=nl)
    return LaunchPlan(spec, (Config.of(BLOCK=128),), lambda c: (max(1, cdiv(num_rows, c["BLOCK"])),), interpreting())


# -- launchers -------------------------------------------------------------------------------------


def expert_order(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [R], counts [N], offsets [N]) of routes ``idx [T, K]``: a stable counting sort by expert."""
    flat = idx.reshape(-1).contiguous()
    r, n = flat.numel(), num_experts
    order = torch.empty(r, dtype=torch.int64, device=idx.device)
    counts = torch.empty(n, dtype=torch.int64, device=idx.device)
    offsets = torch.empty(n, dtype=torch.int64, device=idx.device)
    if r == 0:
        return order, counts.zero_(), offsets.zero_()
    hp = plan_histogram(flat, n)
    nb = hp.grid(hp.config())[0]
    hist = torch.empty(nb, n, dtype=torch.int32, device=idx.device)
    base = torch.empty(nb, n, dtype=torch.int64, device=idx.device)
    np2 = next_pow2(n)
    launch(hp, lambda c, g: block_histogram_kernel[g](flat, hist, r, N=n, NP=np2, **c.kwargs(hp.interpret)))
    sp = plan_scan(flat, n)
    launch(sp, lambda c, g: scan_kernel[g](hist, base, counts, offsets, nb, N=n, NP=np2, **c.kwargs(sp.interpret)))
    rp = plan_route_rows(flat, n)
    launch(rp, lambda c, g: route_rows_kernel[g](flat, base, order, r, N=n, NP=np2, **c.kwargs(rp.interpret)))
    return order, counts, offsets


def invert_order(order: torch.Tensor) -> torch.Tensor:
    """pos [R] with pos[order[r]] = r (where each (token, k) row sits in expert order)."""
    r = order.numel()
    pos = torch.empty_like(order)
    if r:
        p = plan_invert(order)
        launch(p, lambda c, g: invert_order_kernel[g](order, pos, r, **c.kwargs(p.interpret)))
    return pos


def dst_rows(layout: torch.Tensor, me: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst_rank [R], dst_row [R]) of this rank's permuted rows; dst_row −1 where the capacity rule drops."""
    layout = layout.contiguous()
    ep, nl = layout.shape[1], layout.shape[3]
    dst = torch.empty(num_rows, dtype=torch.int64, device=layout.device)
    row = torch.empty(num_rows, dtype=torch.int64, device=layout.device)
    if num_rows:
        p = plan_dst_rows(layout, num_rows)
        launch(p, lambda c, g: dst_rows_kernel[g](layout, dst, row, me, num_rows, EP=ep, L=nl,
                                                  NP=next_pow2(ep * nl), **c.kwargs(p.interpret)))
    return dst, row


# -- torch references ------------------------------------------------------------------------------


def expert_order_reference(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts, torch.cumsum(counts, 0) - counts


def invert_order_reference(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def dst_rows_reference(layout: torch.Tensor, me: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ...runtime.symmetric_transport import route_map

    return route_map(layout, me, num_rows)
