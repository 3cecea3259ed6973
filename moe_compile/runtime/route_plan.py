"""Row layout of one dispatch: which rows leave, where they land, what capacity drops.

Counts travel as ``layout``: an int64 tensor ``[2, ep, ep, L]`` — requested[src, dst, expert] and
kept[src, dst, expert] for the EP-MP group (L = num_local_experts). Every rank holds the same layout,
so every rank derives the same drops. From it, each rank derives its own :class:`RoutePlan`.

Capacity rule (rank-level, deterministic tail drop): destination rank r takes at most its ``capacity``
rows (its own receive buffer, sent with its counts by compiled programs on the all_to_all transport, so
ranks whose buffers differ — batches of different shapes — agree on every drop); its requested rows are
ordered by (source rank, local expert, token, k) and the tail is dropped.
``capacity_rows(R, ep, None)`` = ep·T·K is the dropless bound, which no request can exceed; dropless
dispatch allocates less — the load-following capacity of :mod:`moe_compile.runtime.dropless` — and
reruns a forward whose counts overflow it, so the tail drop never applies to a returned dropless forward.
With a capacity factor :func:`capacity_rows` is the one place the number is computed (the dispatch pass
sizes receive buffers with it; the ledger's figure ``C = ceiling(c_f·T·K)`` substitutes
:func:`exact_capacity_factor`, so the two agree exactly).

Host reads: :meth:`RoutePlan.from_layout` produces Python split lists (``.tolist()``) and row totals
(``int()``, and each rank's routed rows, which must agree) — what a collective with uneven splits needs;
only ``AllToAllTransport`` builds one.

The order does not depend on the order in which the router lists a token's K experts: a token routes
to an expert at most once, so inside one (source, expert) segment the rows are in token order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch


def exact_capacity_factor(capacity_factor: float) -> Fraction:
    """The capacity factor as the decimal the user wrote: ``Fraction(str(cf))`` — 1.1 is 11/10, not the
    binary double 1.100000000000000088… (whose product with 90 rows is 99.00000000000001)."""
    return Fraction(str(capacity_factor))


def capacity_rows(rows: int, ep: int, capacity_factor: float | None) -> int:
    """Receive-buffer rows per rank for ``rows`` = T·K routed rows per rank and an EP-MP group of ``ep``:
    ep·rows, the dropless bound (``capacity_factor`` None; dropless buffers are sized by
    ``runtime.dropless.dropless_rows`` below it), else the exact ceiling ⌈cf·rows⌉ of the decimal
    value (cf=1.1, rows=90 → 99; cf=1.25, rows=8 → 10; cf=0.5, rows=7 → 4; cf=1.0 → rows)."""
    if capacity_factor is None:
        return ep * rows
    return math.ceil(exact_capacity_factor(capacity_factor) * rows)  # Fraction.__ceil__: exact


def keep_counts(requested: torch.Tensor, capacity: int | torch.Tensor) -> torch.Tensor:
    """kept[src, dst, e] under the capacity rule, for requested[src, dst, e]; ``capacity``: one number for
    every destination, or each destination's ([ep] tensor: ranks routing different numbers of rows)."""
    ep, _, nl = requested.shape
    per_dst = requested.permute(1, 0, 2).reshape(ep, ep * nl)  # [dst, (src, e)]
    before = torch.cumsum(per_dst, dim=1) - per_dst
    if isinstance(capacity, torch.Tensor):
        capacity = capacity.view(ep, 1)
    kept = torch.minimum(per_dst, (capacity - before).clamp(min=0))
    return kept.reshape(ep, ep, nl).permute(1, 0, 2).contiguous()


def segment_rows(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    total = int(lengths.sum())
    if total == 0:
        return starts.new_zeros(0)
    seg_first = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - seg_first, lengths, output_size=total) + torch.arange(
        total, device=starts.device
    )


@dataclass
class RoutePlan:
    """One rank's view of a dispatch. Rows of the send side are in (dst, expert, token) order; the
    receive buffer is expert-major: [expert 0 rows from src 0, src 1, …][expert 1 …] then padding."""

    send_index: torch.Tensor  # [n_send] rows of the permuted input that leave (kept rows)
    send_splits: list[int]  # [ep] rows to each destination
    recv_pos: torch.Tensor  # [n_recv] expert-major receive row of each arriving row (source-major order)
    recv_splits: list[int]  # [ep] rows from each source
    recv_counts: torch.Tensor  # [L] rows per local expert (valid prefix = their sum)
    me: int
    layout: torch.Tensor  # [2, ep, ep, L] requested / kept rows (the plan is derived from it)
    send_identity: bool  # nothing dropped: the rows leave in the order they are (send_index = arange)
    recv_identity: bool  # one source or one local expert: arrival order is already expert-major
    rows_per_rank: list[int]  # [ep] routed rows (T·K) each rank of the group requested

    @property
    def valid(self) -> int:
        return int(self.recv_pos.numel())

    @property
    def recv_inverse(self) -> torch.Tensor:
        """[valid] arriving row that lands at each expert-major row (inverse of recv_pos)."""
        inv = torch.empty_like(self.recv_pos)
        inv[self.recv_pos] = torch.arange(self.recv_pos.numel(), device=inv.device)
        return inv

    @classmethod
    def from_layout(cls, layout: torch.Tensor, me: int) -> RoutePlan:
        req, keep = layout[0], layout[1]
        ep, _, nl = req.shape
        # Send side: the permuted input holds, per (dst, e), a segment of req rows; the first kept leave.
        seg_len = req[me].reshape(-1)
        seg_start = torch.cumsum(seg_len, 0) - seg_len
        send_index = segment_rows(seg_start, keep[me].reshape(-1))
        # Receive side: rows arrive source-major (s, e); expert-major offset of (s, e) is
        # Σ_{e'<e} Σ_s keep[s, me, e'] + Σ_{s'<s} keep[s', me, e].
        k_in = keep[:, me, :]  # [src, e]
        per_e = k_in.sum(0)
        e_off = torch.cumsum(per_e, 0) - per_e
        s_off = torch.cumsum(k_in, 0) - k_in
        recv_pos = segment_rows((e_off.unsqueeze(0) + s_off).reshape(-1), k_in.reshape(-1))
        # one host read for the three [ep] lists: send splits, receive splits, each rank's routed rows
        splits = torch.cat([keep[me].sum(1), k_in.sum(1), req.sum((1, 2))]).tolist()
        return cls(
            send_index=send_index,
            send_splits=splits[:ep],
            recv_pos=recv_pos,
            recv_splits=splits[ep:2 * ep],
            recv_counts=per_e,
            me=me,
            layout=layout,
            send_identity=bool(send_index.numel() == int(seg_len.sum())),
            recv_identity=ep == 1 or nl == 1,
            rows_per_rank=splits[2 * ep:],
        )
