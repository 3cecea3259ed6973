"""MultiGroupDistributedDataParallel: gradient reduction with one process group per parameter family.

    dense bucket   — dense parameters, reduced over the folded dp×cp replica group
    expert bucket  — routed-expert shards, reduced over ep_dp (replicas of the same shard)

Both families end as the gradient of the mean of the data-parallel ranks' losses, and both reduce
as a *mean* over their group, so gradients that were already reduced (accumulated over steps without
zeroing) stay unchanged by a later reduction. Dense: mean over dp·cp. An expert shard's local
gradient sums the tokens of its whole EP-MP group, so incoming expert gradients are pre-scaled by
1/ep_mp (a tensor hook, before accumulation) and then averaged over ep_dp: (1/ep_dp)·Σ(1/ep_mp)·Σ = 1/(dp·cp)·Σ.

Gradients live as views into flat persistent buckets (one per family and dtype, split at
``bucket_bytes``). A bucket's all-reduce starts (async) as soon as all its gradients are accumulated,
in bucket order on every rank (collectives must match across ranks); the end-of-backward callback
starts the rest and waits. ``no_sync()`` defers reduction for gradient accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class ParamFamily:
    name: str  # "dense" | "expert"
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None  # None: a group of one rank (nothing to reduce)
    scale: float  # multiply the summed gradient by this (1 / group size: a mean)
    pre_scale: float = 1.0  # multiply each incoming gradient by this before it accumulates


@dataclass
class GradBucket:
    family: str
    group: dist.ProcessGroup | None
    scale: float
    params: list[nn.Parameter]
    flat: torch.Tensor  # [Σ numel] persistent gradient storage; param grads are views into it
    offsets: list[int]
    ready: set[int] = field(default_factory=set)
    work: object = None

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.flat[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)

    def adopt(self, i: int) -> None:
        """Make params[i].grad a view into the bucket (copying a grad autograd created elsewhere)."""
        p, v = self.params[i], self.view(i)
        if p.grad is None:
            v.zero_()
        elif p.grad.data_ptr() != v.data_ptr():
            v.copy_(p.grad)
        p.grad = v

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class MultiGroupDistributedDataParallel:
    def __init__(self, families: list[ParamFamily], bucket_bytes: int = 25 * 2**20) -> None:
        self.families = families
        self.buckets: list[GradBucket] = []
        self._where: dict[int, tuple[GradBucket, int]] = {}
        self._sync = True
        self._in_backward = False
        self._next = 0
        for fam in families:
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in reversed([p for p in fam.params if p.requires_grad]):  # backward order, roughly
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, params in by_dtype.items():
                chunk: list[nn.Parameter] = []
                size = 0
                for p in params:
                    chunk.append(p)
                    size += p.numel() * p.element_size()
                    if size >= bucket_bytes:
                        self._add_bucket(fam, dtype, chunk)
                        chunk, size = [], 0
                if chunk:
                    self._add_bucket(fam, dtype, chunk)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                b.adopt(i)
                p.register_post_accumulate_grad_hook(self._hook)
        for fam in families:
            if fam.pre_scale != 1.0:
                for p in fam.params:
                    if p.requires_grad:
                        p.register_hook(lambda g, s=fam.pre_scale: g * s)

    def _add_bucket(self, fam: ParamFamily, dtype: torch.dtype, params: list[nn.Parameter]) -> None:
        offsets, n = [], 0
        for p in params:
            offsets.append(n)
            n += p.numel()
        dev = params[0].device
        b = GradBucket(fam.name, fam.group, fam.scale, list(params), torch.zeros(n, dtype=dtype, device=dev), offsets)
        for i, p in enumerate(params):
            self._where[id(p)] = (b, i)
        self.buckets.append(b)

    # -- autograd hooks ----------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b, i = self._where[id(p)]
        b.ready.add(i)
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not force and len(b.ready) < len(b.params):
                return
            for i in range(len(b.params)):
                b.adopt(i)
            if b.group is not None:
                b.work = dist.all_reduce(b.flat, group=b.group, async_op=True)
            self._next += 1

    def _finish(self) -> None:
        self._launch_ready(force=True)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if b.scale != 1.0:
                b.flat.mul_(b.scale)
            b.ready.clear()
        self._next = 0
        self._in_backward = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces the total."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def bucket_summary(self) -> list[dict[str, object]]:
        return [
            {"family": b.family, "dtype": str(b.flat.dtype), "params": len(b.params), "bytes": b.nbytes}
            for b in self.buckets
        ]
