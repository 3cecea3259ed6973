"""Gradient-bucket reduction through host shared memory, for CPU ranks on one host.

Terms: gradient bucket, dense/expert bucket (train/ddp.py), symmetric memory (runtime/symmetric/host.py:
one segment per member, every member maps every peer's). Why not the process group: a gloo collective
costs a chain of process wake-ups whatever its size. Back to back, a 4 KB all-reduce took 2.5 ms between
2 CPU ranks and 6.8 ms among 4 on 2 cores of this VM, and 1.2 MB took 3.5 and 7.9 ms (measured
2026-12-02). The bucket the backward completes last is waited for after the backward, so that latency
is the exposed reduction time of a step. Here each member copies its bucket into its own segment and
raises a flag, and at the wait every member sums all segments itself:

    start(r)   wait until every member's done ≥ r−1     (they have read round r−1 of my segment)
               my segment ← src;  arrived[me] ← r        (nothing waits for the peers here)
    wait()     wait until every member's arrived ≥ r
               out ← Σ_q segment_q[part], q = 0, 1, …, g−1 in this order: the same bits on every member
               done[me] ← r

    all-reduce       src = part = the whole flat bucket, out = the flat bucket    (reads g·n elements)
    reduce-scatter   src = BucketShards' packed rows [g, W], part = row me, out = the owned gradient
                     (ZeRO-1; reads g·W ≈ n)

A start never waits for peers to arrive, so a bucket started in the backward needs no progress thread to
overlap it: its data is in place when the peers look. The flags rely on x86-64 storing in program order
(the data is visible before the flag that follows it), as HostShmHeap's barrier does; other machines and
ranks on several hosts reduce through the process group (options.py: grad_transport).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.symmetric.host import HostShmHeap, park_on, raise_flag, spin_until

ARRIVED, DONE = 0, 1  # a member's flags: the last round it started, the last round it finished reading


class HostShmReduction:
    """Bucket reductions over one replica group. Construction is collective over the group."""

    def __init__(self, group: dist.ProcessGroup, family: str) -> None:
        self.heap = HostShmHeap(group)
        self.group, self.family = group, family

    def bucket(self, numel: int, dtype: torch.dtype) -> ShmBucket:
        """A segment of ``numel`` elements per member (collective: every member, in the same order)."""
        return ShmBucket(self, self.heap.alloc(f"{self.family}_bucket", (numel,), dtype),
                         self.heap.alloc(f"{self.family}_flags", (2,), torch.int64))

    def global_ranks(self, members: list[int]) -> list[int]:
        return [dist.get_global_rank(self.group, m) for m in members]


class ShmBucket:
    """One bucket's segment and flags; ``start`` returns the pending reduction (``wait()``, as a Work)."""

    def __init__(self, red: HostShmReduction, data, flags) -> None:
        self.red, self.data, self.flags = red, data, flags
        self.round = 0
        self._out: torch.Tensor | None = None
        self._part = (0, 0)

    def _until(self, which: int, r: int, what: str) -> None:
        views = self.flags.views
        spin_until(lambda: all(int(v[which]) >= r for v in views),
                   lambda: f"{self.red.family} gradient bucket ({self.data.local.numel()} elements), round {r}: "
                           f"ranks {self.red.global_ranks([m for m, v in enumerate(views) if int(v[which]) < r])} "
                           f"({what})",
                   park=park_on([(v, which) for v in views], r))

    def start(self, src: torch.Tensor, out: torch.Tensor, part: tuple[int, int] | None = None) -> ShmBucket:
        if self._out is not None:
            self.wait()  # a previous round nobody waited for (an abandoned backward)
        r = self.round + 1
        self._until(DONE, r - 1, f"reading round {r - 1}")
        self.data.local.copy_(src.reshape(-1))
        raise_flag(self.flags.local, ARRIVED, r)  # after the data: x86-64 keeps the two stores in this order
        self.round, self._out = r, out
        self._part = part or (0, src.numel())
        return self

    def wait(self) -> None:
        out = self._out
        if out is None:
            return
        r = self.round
        self._until(ARRIVED, r, "their gradients")
        lo, hi = self._part
        views = [v[lo:hi] for v in self.data.views]
        flat = out.view(-1)
        if len(views) == 1:
            flat.copy_(views[0])
        else:
            torch.add(views[0], views[1], out=flat)
            for v in views[2:]:
                flat.add_(v)
        raise_flag(self.flags.local, DONE, r)
        self._out = None

    def release(self) -> None:
        """Finish a round nobody waited for, then drop this rank's mappings (a re-bucketed or closed
        reducer; local: each member releases its own, and the memory goes with the last)."""
        self.wait()
        self.red.heap.free(self.data)
        self.red.heap.free(self.flags)
