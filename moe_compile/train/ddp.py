"""MultiGroupDistributedDataParallel: gradient reduction with one process group per parameter family.

    dense bucket   — dense parameters, reduced over the folded dp×cp replica group
    expert bucket  — routed-expert shards, reduced over ep_dp (replicas of the same shard)

Both families end as the gradient of the mean of the data-parallel ranks' losses, and both reduce
as a *mean* over their group, so gradients that were already reduced (accumulated over steps without
zeroing) stay unchanged by a later reduction. Dense: mean over dp·cp. An expert shard's local
gradient sums the tokens of its whole EP-MP group, so incoming expert gradients are pre-scaled by
1/ep_mp (a tensor hook, before accumulation) and then averaged over ep_dp: (1/ep_dp)·Σ(1/ep_mp)·Σ = 1/(dp·cp)·Σ.

Gradients live in flat persistent buckets (one per family and gradient dtype, split at
``bucket_bytes``); ``main_grad(p)`` is a parameter's view into its bucket, the optimizer-facing
gradient. Two modes:

    grad_dtype = param dtype (default): p.grad *is* the bucket view; autograd accumulates into it.
    grad_dtype = float32 for BF16 params: each post-accumulate hook adds p.grad into the FP32 bucket
                 and drops p.grad, so accumulation over microbatches and the reduction run in FP32.

A bucket's all-reduce starts (async) as soon as all its gradients are accumulated, in bucket order on
every rank (collectives must match across ranks); the end-of-backward callback starts the rest and
waits. Under a fully captured graph the compiled backward returns all gradients at once, so the
overlap is with the tail of the backward that autograd still runs (AccumulateGrad, hooks), not with
the compiled region itself.

Gradient accumulation over m microbatches: run the first m−1 backwards under ``no_sync()``; the
last one reduces the accumulated total once.

A backward that raises never runs its end-of-backward callback (autograd drops queued callbacks), so
the reduction state is keyed by autograd's graph-task id: the first hook of a new backward finds the
state of an abandoned one, waits for its in-flight reductions and starts afresh. That step's gradients
are partial, as in plain PyTorch; ``zero_grad()`` before the next step discards them.
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
    flat: torch.Tensor  # [Σ numel] persistent gradient storage (grad dtype); main_grads are views into it
    offsets: list[int]
    ready: set[int] = field(default_factory=set)
    work: object = None

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.flat[self.offsets[i]: self.offsets[i] + p.numel()].view(p.shape)

    def adopts(self, i: int) -> bool:
        """p.grad is the bucket view itself (same dtype); otherwise grads are moved into the bucket."""
        return self.flat.dtype == self.params[i].dtype

    def adopt(self, i: int) -> None:
        """Bring params[i]'s gradient into the bucket (copying a grad autograd created elsewhere)."""
        p, v = self.params[i], self.view(i)
        if not self.adopts(i):
            if p.grad is not None:
                v.add_(p.grad)
                p.grad = None
            return
        if p.grad is None:
            v.zero_()
        elif p.grad.data_ptr() != v.data_ptr():
            v.copy_(p.grad)
        p.grad = v

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class MultiGroupDistributedDataParallel:
    def __init__(self, families: list[ParamFamily], bucket_bytes: int = 25 * 2**20,
                 grad_dtype: torch.dtype | None = None) -> None:
        self.families = families
        self.bucket_bytes = bucket_bytes
        self.buckets: list[GradBucket] = []
        self._where: dict[int, tuple[GradBucket, int]] = {}
        self._sync = True
        self._task: int | None = None  # graph-task id of the backward whose end callback is queued
        self._next = 0
        self._build_buckets(grad_dtype)
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._hook)
        for fam in families:
            if fam.pre_scale != 1.0:
                for p in fam.params:
                    if p.requires_grad:
                        p.register_hook(lambda g, s=fam.pre_scale: g * s)

    def _build_buckets(self, grad_dtype: torch.dtype | None) -> None:
        old = {id(p): b.view(i).clone() for b in self.buckets for i, p in enumerate(b.params)}
        self.grad_dtype = grad_dtype
        self.buckets, self._where = [], {}
        for fam in self.families:
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in reversed([p for p in fam.params if p.requires_grad]):  # backward order, roughly
                by_dtype.setdefault(grad_dtype or p.dtype, []).append(p)
            for dtype, params in by_dtype.items():
                chunk: list[nn.Parameter] = []
                size = 0
                for p in params:
                    chunk.append(p)
                    size += p.numel() * dtype.itemsize
                    if size >= self.bucket_bytes:
                        self._add_bucket(fam, dtype, chunk)
                        chunk, size = [], 0
                if chunk:
                    self._add_bucket(fam, dtype, chunk)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if id(p) in old:  # re-bucketing: carry the accumulated gradient over
                    b.view(i).copy_(old[id(p)])
                    p.grad = b.view(i) if b.adopts(i) else None
                else:
                    b.adopt(i)

    def set_grad_dtype(self, dtype: torch.dtype | None) -> None:
        """Re-create the buckets with gradients in ``dtype`` (None: each parameter's own dtype).
        Accumulated gradients are carried over. Not allowed inside a backward."""
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("MultiGroupDistributedDataParallel.set_grad_dtype called during a backward")
        if dtype != self.grad_dtype:
            self._build_buckets(dtype)

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

    # -- the optimizer's view ----------------------------------------------------------------------
    def main_grad(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient as the optimizer reads it: its view into the (reduced) bucket."""
        b, i = self._where[id(p)]
        return b.view(i)

    def zero_grad(self) -> None:
        if self._task is not None and self._task != torch._C._current_graph_task_id():
            self._abandon()  # a backward that raised left its reduction state behind
        for b in self.buckets:
            b.flat.zero_()
            for i, p in enumerate(b.params):
                if not b.adopts(i):
                    p.grad = None

    # -- autograd hooks ----------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        if not b.adopts(i):  # move the fresh gradient into the high-precision bucket, even under no_sync
            b.adopt(i)
        if not self._sync:
            return
        task = torch._C._current_graph_task_id()
        if self._task != task:
            if self._task is not None:
                self._abandon()
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
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
        self._task = None

    def _abandon(self) -> None:
        """Drop the reduction state of a backward that raised before its end callback ran: finish
        the reductions it started (every rank issued them, so they complete) and forget the rest."""
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            b.ready.clear()
        self._next = 0
        self._task = None

    def sync_now(self) -> None:
        """Reduce every bucket now: the gradients that backwards under ``no_sync`` accumulated (a
        pipeline schedule runs one backward per microbatch and stage)."""
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("MultiGroupDistributedDataParallel.sync_now called during a backward")
        if self._task is not None:
            self._abandon()
        for b in self.buckets:
            b.ready.clear()
        self._finish()

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
