"""BucketShards: reduce-scatter a gradient bucket into the ZeRO-1 optimizer's owned ranges.

Terms: gradient bucket (train/ddp.py), ZeRO-1 owned range (train/optimizer.py: each parameter of n
elements split torch.chunk-style over the family's replica group of g ranks, c = ceil(n/g), rank q
owning [q·c, min((q+1)·c, n))). The optimizer reads only its owned range of each reduced gradient, so an
all-reduce of the whole bucket sends twice what it needs: a reduce-scatter moves (g−1)/g of the bucket
per rank instead of 2(g−1)/g, and the copy-back all-gather (which the optimizer runs anyway) restores
the full weights. Together that is the traffic of one all-reduce instead of one and a half. (Not so
on gloo: its reduce_scatter_tensor is slower than its all_reduce, so OLMoDDPOptimizer's default
leaves the all-reduce there; see auto_reduce_scatter.)

The bucket's flat gradient keeps every parameter contiguous (autograd accumulates into those views),
while a reduce-scatter hands rank q the q-th contiguous part of its input. So, at launch:

    send [g, W]   W = Σ c_i; row q, columns o_i … o_i + c_i  ←  piece q of parameter i (zero padded)
    out  [W]      ← Σ over the group of row q (reduce_scatter_tensor), scaled after the wait

``send`` is transient: made at launch, dropped once the reduce-scatter completed (``release``; through
host shared memory, as soon as the start copied it). Kept beside the flat bucket for good, it was one
more copy of every reduce-scattered bucket in the persistent state (5.18 GiB per rank for OLMoE-1B-7B
at dp=64, ep_mp=8); now only ``out``, 1/g of the bucket, stays.

``owned(i)`` is parameter i's reduced owned range, ``out[o_i : o_i + (hi − lo)]``. The flat gradient
itself stays local (unreduced): accumulating another backward into it and reducing again gives the
reduced total, as an all-reduce of the accumulated bucket would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .shm_reduce import ShmBucket


def chunk_range(n: int, g: int, q: int) -> tuple[int, int]:
    """Rank q's range of n elements split torch.chunk-style over g ranks (c = ceil(n/g))."""
    c = -(-n // g) if n else 0
    lo = min(q * c, n)
    return lo, min(lo + c, n)


class BucketShards:
    def __init__(self, flat: torch.Tensor, offsets: list[int], numels: list[int], group: dist.ProcessGroup) -> None:
        self.group = group
        self.g, self.q = dist.get_world_size(group), dist.get_rank(group)
        self.widths = [-(-n // self.g) if n else 0 for n in numels]
        self.cols = [sum(self.widths[:i]) for i in range(len(numels))]
        self.width = sum(self.widths)
        self.out = torch.zeros(self.width, dtype=flat.dtype, device=flat.device)
        self._flat, self._offsets, self._numels = flat, offsets, numels
        self._send: torch.Tensor | None = None  # from launch until the reduce-scatter completed

    @property
    def send_numel(self) -> int:
        return self.g * self.width

    def _pack(self) -> torch.Tensor:
        send = torch.empty(self.g, self.width, dtype=self._flat.dtype, device=self._flat.device)
        for off, n, c, col in zip(self._offsets, self._numels, self.widths, self.cols):
            if not n:
                continue
            v = self._flat[off: off + n]
            full, rest = divmod(n, c)
            send[:full, col: col + c].copy_(v[: full * c].view(full, c))
            if rest:
                send[full, col: col + rest].copy_(v[full * c:])
                send[full, col + rest: col + c].zero_()
            send[full + (1 if rest else 0):, col: col + c].zero_()  # padding: zero
        return send

    def launch(self, shm: ShmBucket | None = None):
        """Pack the flat gradient into per-rank rows and start the reduce-scatter (async): over the
        process group, or through ``shm``, a host shared-memory bucket of the send's size."""
        send = self._pack()
        if shm is not None:  # the start copies the rows into the segment
            return shm.start(send, self.out, (self.q * self.width, (self.q + 1) * self.width))
        self._send = send
        return dist.reduce_scatter_tensor(self.out, send.view(-1), group=self.group, async_op=True)

    def release(self) -> None:
        """Drop the packed rows once the reduce-scatter completed (after its wait)."""
        self._send = None

    def owned(self, i: int) -> torch.Tensor:
        """Parameter i's reduced gradient over this rank's owned range (valid after the wait)."""
        lo, hi = chunk_range(self._numels[i], self.g, self.q)
        return self.out[self.cols[i]: self.cols[i] + hi - lo]

    def gather(self) -> list[torch.Tensor]:
        """Every parameter's whole reduced gradient, flattened (all-gather of ``out``). Collective."""
        rows = self.out.new_empty(self.g, self.width)
        dist.all_gather_into_tensor(rows.view(-1), self.out, group=self.group)
        return [rows[:, col: col + c].reshape(-1)[:n] for n, c, col in zip(self._numels, self.widths, self.cols)]
