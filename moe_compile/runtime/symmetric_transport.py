"""Rowwise transport over symmetric memory (Olmo-style): one-sided PUTs and GETs of token rows.

Route map (per permuted row i, i.e. per (token, k) through ``order``)::

    expert[i]   = the global expert of row i          (searchsorted over the expert counts)
    dst_rank[i] = expert[i] // L
    j           = i − segment_start[expert[i]]        (position inside its (dst, expert) segment)
    dst_row[i]  = e_off[dst, e] + s_off[me, dst, e] + j   if j < kept[me, dst, e], else −1 (dropped)

where the destination's receive buffer is expert-major: e_off = Σ rows of lower local experts,
s_off = Σ rows of lower source ranks. All tensor ops with fixed shapes (no host sync needed).

dispatch = PUT row i into dst_rank[i]'s receive buffer at dst_row[i]; combine = GET it back from the
expert output buffer. Backward reverses the directions (combine_backward PUTs, dispatch_backward GETs).
Every transfer is bracketed by two signals: the first says every receive slot is acquired (its last
reader is done), the second that every row has landed.
"""

from __future__ import annotations

import torch

from ..leases import payload_name
from .lease_runtime import LeaseRuntime
from .route_plan import RoutePlan
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
    def segments(plan: RoutePlan) -> list[tuple[int, int, int, int]]:
        """(dst rank, first permuted row, first destination row, rows) of every kept (dst, expert)
        segment: the route map's rows of one segment are contiguous at both ends, so each moves as
        one block copy (the per-row ``route_map`` is the same mapping, for kernels that move rows)."""
        req, keep = plan.layout[0], plan.layout[1]
        me = plan.me
        seg_len = req[me].reshape(-1)
        src0 = (torch.cumsum(seg_len, 0) - seg_len).view(req.shape[1], -1)
        per_e = keep.sum(0)
        dst0 = (torch.cumsum(per_e, 1) - per_e) + (torch.cumsum(keep, 0) - keep)[me]
        rows = keep[me]
        out = []
        for (d, e), n in zip(torch.nonzero(rows).tolist(), rows[rows > 0].tolist()):
            out.append((d, int(src0[d, e]), int(dst0[d, e]), n))
        return out

    def dispatch_rows(self, xs: torch.Tensor, plan: RoutePlan, capacity: int, what: str, block: str = "") -> torch.Tensor:
        name = payload_name(block, what)
        lease = self.leases.acquire(name)
        segs = self.segments(plan)
        self.heap.barrier()  # receive slots acquired everywhere
        peers = [lease.peer(p) for p in range(self.ep_size)]
        for d, s0, d0, n in segs:
            peers[d][d0: d0 + n].copy_(xs[s0: s0 + n])  # PUT into the destination's receive rows
        self.heap.barrier()  # every row landed
        self._count(what, xs, plan.send_splits, plan.me)  # segment rows per destination = send_splits
        if lease.payload.leased:  # the lease also ends if backward's graph is dropped unrun
            return self.leases.bind(lease, lease.local)
        return lease.local

    def return_rows(self, out: torch.Tensor, plan: RoutePlan, num_rows: int, what: str, block: str = "") -> torch.Tensor:
        name = payload_name(block, what)
        lease = self.leases.acquire(name)
        lease.local[: plan.valid].copy_(out[: plan.valid])  # expose the rows for peers to GET
        segs = self.segments(plan)
        self.heap.barrier()
        back = out.new_empty((num_rows,) + tuple(out.shape[1:])) if plan.send_identity else \
            out.new_zeros((num_rows,) + tuple(out.shape[1:]))  # dropped rows return as zero
        peers = [lease.peer(p) for p in range(self.ep_size)]
        for d, s0, d0, n in segs:
            back[s0: s0 + n].copy_(peers[d][d0: d0 + n])  # GET from the expert's rank
        self.heap.barrier()  # every member finished reading my rows
        self.leases.release(name)
        self._count(what, out, plan.send_splits, plan.me)
        return back

    def _move(self, send, send_splits, recv_splits):  # rows move by PUT/GET, never as a collective
        raise NotImplementedError("SymmetricTransport moves rows with dispatch_rows/return_rows")
