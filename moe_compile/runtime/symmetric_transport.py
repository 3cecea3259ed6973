"""Rowwise transport over symmetric memory (Olmo-style): one-sided PUTs and GETs of token rows.

Route map (per permuted row i, i.e. per (token, k) through ``order``)::

    expert[i]   = the global expert of row i          (searchsorted over the expert counts)
    dst_rank[i] = expert[i] // L
    j           = i − segment_start[expert[i]]        (position inside its (dst, expert) segment)
    dst_row[i]  = e_off[dst, e] + s_off[me, dst, e] + j   if j < kept[me, dst, e], else −1 (dropped)

where the destination's receive buffer is expert-major: e_off = Σ rows of lower local experts,
s_off = Σ rows of lower source ranks. All tensor ops with fixed shapes (no host sync needed).

dispatch = PUT row i into dst_rank[i]'s receive buffer at dst_row[i]; combine = GET it back from the
expert output buffer. No host read anywhere on this path (route map, offsets, the capacity rule and the
row movement are tensor ops of fixed shapes): per destination p, with M = min(R, capacity) rows,

    start_p = Σ (dst < p)                    first of my rows to p (my rows are in (dst, expert) order)
    mine_p  = mask over p's capacity rows that I write (scatter of kept dst_row with dst = p)
    PUT     peer_p.masked_scatter_(mine_p, xs[start_p : start_p + M])   writes exactly my rows, in order
    GET     back[start_p + k] = peer_p[dst_row[start_p + k]]  for k < M, kept; others into a scratch row

(the rows of (me → p) ascend in p's expert-major buffer, so the k-th masked slot is my k-th row to p).
A GPU build runs the same map through ``codegen.kernels.route_map.dst_rows`` (Triton); the copies are
M rows per peer instead of the n_p they carry — fixed shapes cost that on a torch-ops path. Backward reverses the directions (combine_backward PUTs, dispatch_backward GETs).
Every transfer is bracketed by two signals: the first says every receive slot is acquired (its last
reader is done), the second that every row has landed.
"""

from __future__ import annotations

import torch

from ..leases import payload_name
from .lease_runtime import LeaseRuntime
from .stats import RuntimeStats
from .symmetric import SymmetricHeap
from .transport import Transport


def route_map(layout: torch.Tensor, me: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dst_rank[R], dst_row[R]) of this rank's R permuted rows; dst_row −1 for dropped rows."""
    requested, keep = layout[0], layout[1]
    ep, _, nl = keep.shape
    counts = requested[me].reshape(-1)  # [N] rows per global expert, in permuted (expert) order
    i = torch.arange(num_rows, device=layout.device)
    ends = torch.cumsum(counts, 0)
    expert = torch.searchsorted(ends, i, right=True)
    j = i - (ends - counts)[expert]
    dst, e = expert // nl, expert % nl
    per_e = keep.sum(0)  # [dst, e] rows each destination expert receives
    e_off = torch.cumsum(per_e, 1) - per_e
    s_off = (torch.cumsum(keep, 0) - keep)[me]  # [dst, e] rows from lower source ranks
    kept = j < keep[me][dst, e]
    dst_row = torch.where(kept, e_off[dst, e] + s_off[dst, e] + j, torch.full_like(j, -1))
    return dst, dst_row


class SymmetricTransport(Transport):
    name = "symmetric"

    def __init__(self, heap: SymmetricHeap, leases: LeaseRuntime, stats: RuntimeStats,
                 group_label: str = "ep_mp") -> None:
        super().__init__(stats, group_label)
        self.heap = heap
        self.leases = leases
        self.ep_size = heap.size
        self.ep_rank = heap.rank

    def exchange_counts(self, counts: torch.Tensor, block: str = "") -> torch.Tensor:
        name = payload_name(block, "counts")
        lease = self.leases.acquire(name)
        self.heap.barrier()  # every member's matrix slot is acquired
        row = counts.unsqueeze(0)
        me = self.ep_rank
        for p in range(self.ep_size):
            lease.peer(p)[me: me + 1].copy_(row)  # PUT my requested row into every member's matrix (any device)
        self.heap.barrier()
        out = lease.local.clone()
        self.heap.barrier()  # everyone has read the matrix before the slot can be reused
        self.leases.release(name)
        return out

    @staticmethod
    def segments(plan) -> list[tuple[int, int, int, int]]:
        """(dst rank, first permuted row, first destination row, rows) of every kept (dst, expert) segment
        of a host :class:`~moe_compile.runtime.route_plan.RoutePlan`: the route map's rows of one segment are
        contiguous at both ends. An inspection aid (host reads); the transport moves rows with the tensor
        route map (:meth:`row_map`) instead."""
        req, keep = plan.layout[0], plan.layout[1]
        me = plan.me
        seg_len = req[me].reshape(-1)
        src0 = (torch.cumsum(seg_len, 0) - seg_len).view(req.shape[1], -1)
        per_e = keep.sum(0)
        dst0 = (torch.cumsum(per_e, 1) - per_e) + (torch.cumsum(keep, 0) - keep)[me]
        rows = keep[me]
        return [(d, int(src0[d, e]), int(dst0[d, e]), n)
                for (d, e), n in zip(torch.nonzero(rows).tolist(), rows[rows > 0].tolist())]

    def row_map(self, layout: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dst_rank [R], dst_row [R] (−1 dropped), start [ep] first permuted row to each rank): tensors."""
        if layout.is_cuda:
            from ..codegen.kernels.route_map import dst_rows

            dst, row = dst_rows(layout, self.ep_rank, num_rows)
        else:
            dst, row = route_map(layout, self.ep_rank, num_rows)
        req = layout[0][self.ep_rank].sum(1)  # [ep] rows I route to each rank
        return dst, row, torch.cumsum(req, 0) - req

    def _count_rows(self, what: str, layout: torch.Tensor, row_bytes: int) -> None:
        kept = layout[1][self.ep_rank].sum(1)  # [ep] rows that move between me and each rank (tensor)
        self.stats.add_bytes(self.group_label, what, (kept.sum() - kept[self.ep_rank]) * row_bytes,
                             kept.sum() * row_bytes)

    def dispatch_rows(self, xs: torch.Tensor, layout: torch.Tensor, capacity: int, what: str,
                      block: str = "", same_rows: bool = True) -> torch.Tensor:
        # same_rows is not checked here: the lease plans (pool sizes follow each rank's rows) must agree
        name = payload_name(block, what)
        lease = self.leases.acquire(name)
        r = xs.shape[0]
        dst, row, start = self.row_map(layout, r)
        m = min(r, capacity)
        k = torch.arange(m, device=xs.device)
        scratch = torch.full_like(row, capacity)
        self.heap.barrier()  # receive slots acquired everywhere
        for p in range(self.ep_size):
            peer = lease.peer(p)
            slots = torch.where((dst == p) & (row >= 0), row, scratch)  # my kept rows' slots at p (else scratch)
            mine = torch.zeros(capacity + 1, dtype=torch.bool, device=xs.device).index_fill_(0, slots, True)[:capacity]
            src = xs.index_select(0, (start[p] + k).clamp(max=max(r - 1, 0))) if r else xs
            peer.masked_scatter_(mine.view((-1,) + (1,) * (xs.dim() - 1)).expand_as(peer), src)  # PUT my rows
        self.heap.barrier()  # every row landed
        self._count_rows(what, layout, xs[0].numel() * xs.element_size() if r else 0)
        if lease.payload.leased:  # the lease also ends if backward's graph is dropped unrun
            return self.leases.bind(lease, lease.local)
        return lease.local

    def return_rows(self, out: torch.Tensor, layout: torch.Tensor, num_rows: int, what: str,
                    block: str = "") -> torch.Tensor:
        name = payload_name(block, what)
        lease = self.leases.acquire(name)
        lease.local.copy_(out)  # expose the rows for peers to GET (whole buffer: the valid count stays a tensor)
        dst, row, start = self.row_map(layout, num_rows)
        capacity = out.shape[0]
        m = min(num_rows, capacity)
        k = torch.arange(m, device=out.device)
        back = out.new_zeros((num_rows + 1,) + tuple(out.shape[1:]))  # + one scratch row; dropped rows stay zero
        self.heap.barrier()
        for p in range(self.ep_size):
            i = (start[p] + k).clamp(max=max(num_rows - 1, 0))  # my k-th row to p
            ok = (i == start[p] + k) & (dst[i] == p) & (row[i] >= 0)
            got = lease.peer(p).index_select(0, row[i].clamp(min=0))  # GET from the expert's rank
            back.index_copy_(0, torch.where(ok, i, torch.full_like(i, num_rows)), got)
        self.heap.barrier()  # every member finished reading my rows
        self.leases.release(name)
        self._count_rows(what, layout, out[0].numel() * out.element_size() if capacity else 0)
        return back[:num_rows]

    def _move(self, send, send_splits, recv_splits):  # rows move by PUT/GET, never as a collective
        raise NotImplementedError("SymmetricTransport moves rows with dispatch_rows/return_rows")
