"""Transports move token rows between the ranks of an EP-MP group.

``dispatch_rows``: permuted rows → the expert-major receive buffer of the rank storing their expert.
``return_rows``: expert-output rows → back to the rows they came from (dropped rows stay zero).
Backward uses the same two movements in the mirrored direction. Both take the dispatch ``layout``
([2, ep, ep, L] requested / kept rows, a tensor); each transport derives what it needs from it.

Host reads: a collective with uneven splits (``all_to_all_single``: gloo on CPU, NCCL on GPU) takes its
split sizes as Python lists, so :class:`AllToAllTransport` builds a host :class:`RoutePlan` per movement
(``RoutePlan.from_layout``: ``.tolist()`` of the send and receive splits, ``int()`` of the row totals).
That is the documented, necessary host sync of that transport; the symmetric transport has none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from ..errors import RuntimeFault
from .route_plan import RoutePlan
from .stats import RuntimeStats


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """gloo has no fp8 types: 1-byte floats travel as uint8 views."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def check_same_rows(rows_per_rank: list[int], block: str) -> None:
    """A dispatch given one capacity for every rank (a direct moe::dispatch call, without own_capacity) needs
    every rank of the EP-MP group to route as many rows: peers with other counts would size
    their buffers otherwise and move rows their peers do not expect (gloo aborts the process). Every rank
    sees the same all-gathered counts, so every rank raises here, before any row moves. (Compiled programs
    send each rank's capacity with its counts: any shapes.)"""
    if len(set(rows_per_rank)) > 1:
        by_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(rows_per_rank))
        raise RuntimeFault(
            f"{block}: the ranks of the EP-MP group route different numbers of rows ({by_rank}; rows = tokens "
            "× top-k): every rank of an EP group must pass batches of the same shape (pad them to one shape, "
            "labels -100 on the padding); no rows were moved")


class Transport(ABC):
    name: str
    ep_size: int
    ep_rank: int

    def __init__(self, stats: RuntimeStats, group_label: str) -> None:
        self.stats = stats
        self.group_label = group_label

    @abstractmethod
    def exchange_counts(self, counts: torch.Tensor, block: str = "") -> torch.Tensor:
        """counts[dst, e] of this rank → requested[src, dst, e] of the whole group."""

    @abstractmethod
    def _move(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows to each peer (split by send_splits) → rows from each peer (split by recv_splits)."""

    def plan(self, layout: torch.Tensor) -> RoutePlan:
        """The host route plan of this rank (split sizes as lists: the collective's host reads)."""
        return RoutePlan.from_layout(layout, self.ep_rank)

    def dispatch_rows(self, xs: torch.Tensor, layout: torch.Tensor, capacity: int, what: str,
                      block: str = "", same_rows: bool = True) -> torch.Tensor:
        """``same_rows``: the layout's drops assumed one capacity for every rank (check the ranks agree)."""
        plan = self.plan(layout)
        if same_rows:
            check_same_rows(plan.rows_per_rank, block)
        send = xs if plan.send_identity else xs.index_select(0, plan.send_index)
        flat = self._move(send, plan.send_splits, plan.recv_splits)
        self._count(what, send, plan.send_splits, plan.me)
        recv = xs.new_empty((capacity,) + tuple(xs.shape[1:]))
        head = recv[: plan.valid]
        if plan.recv_identity:
            head.copy_(flat)
        else:
            torch.index_select(flat, 0, plan.recv_inverse, out=head)
        return recv

    def return_rows(self, out: torch.Tensor, layout: torch.Tensor, num_rows: int, what: str,
                    block: str = "") -> torch.Tensor:
        plan = self.plan(layout)
        head = out[: plan.valid]
        flat = head if plan.recv_identity else head.index_select(0, plan.recv_pos)
        back_rows = self._move(flat, plan.recv_splits, plan.send_splits)
        self._count(what, flat, plan.recv_splits, plan.me)
        if plan.send_identity:
            return back_rows.clone() if back_rows is flat else back_rows  # never hand back `out`'s own rows
        back = out.new_zeros((num_rows,) + tuple(out.shape[1:]))
        back.index_copy_(0, plan.send_index, back_rows)
        return back

    def _count(self, what: str, send: torch.Tensor, splits: list[int], me: int) -> None:
        row_bytes = send[0].numel() * send.element_size() if send.shape[0] else 0
        peer_rows = sum(splits) - splits[me]
        self.stats.add_bytes(self.group_label, what, peer_rows * row_bytes, sum(splits) * row_bytes)


class LocalTransport(Transport):
    """EP-MP group of one rank: rows stay where they are."""

    name = "local"

    def __init__(self, stats: RuntimeStats, group_label: str = "ep_mp") -> None:
        super().__init__(stats, group_label)
        self.ep_size, self.ep_rank = 1, 0

    def exchange_counts(self, counts: torch.Tensor, block: str = "") -> torch.Tensor:
        return counts.unsqueeze(0).clone()

    def _move(self, send, send_splits, recv_splits):
        return send


class AllToAllTransport(Transport):
    """torch.distributed ``all_to_all_single`` with uneven splits (gloo on CPU, NCCL on GPU)."""

    name = "all_to_all"

    def __init__(self, group: dist.ProcessGroup, stats: RuntimeStats, group_label: str = "ep_mp") -> None:
        super().__init__(stats, group_label)
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)

    def exchange_counts(self, counts: torch.Tensor, block: str = "") -> torch.Tensor:
        parts = [torch.empty_like(counts) for _ in range(self.ep_size)]
        dist.all_gather(parts, counts.contiguous(), group=self.group)
        return torch.stack(parts)

    def _move(self, send, send_splits, recv_splits):
        recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
        dist.all_to_all_single(
            wire_view(recv), wire_view(send.contiguous()), recv_splits, send_splits, group=self.group
        )
        return recv
