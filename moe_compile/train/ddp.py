"""MultiGroupDistributedDataParallel: gradient reduction with one process group per parameter family.

    dense bucket   — dense parameters, reduced over the folded dp×cp replica group
    expert bucket  — routed-expert shards, reduced over ep_dp (replicas of the same shard)

Both families end as the gradient of the mean of the data-parallel ranks' losses, and both reduce
as a *mean* over their group, so gradients that were already reduced (accumulated over steps without
zeroing) stay unchanged by a later reduction. Dense: mean over dp·cp. An expert shard's local
gradient sums the tokens of its whole EP-MP group, so incoming expert gradients are pre-scaled by
1/ep_mp (before accumulation: a tensor hook, or the graph node) and then averaged over ep_dp: (1/ep_dp)·Σ(1/ep_mp)·Σ = 1/(dp·cp)·Σ.

Gradients live in flat persistent buckets (one per family and gradient dtype, split at
``bucket_bytes``); ``main_grad(p)`` is a parameter's view into its bucket, the optimizer-facing
gradient. Two modes:

    grad_dtype = param dtype (default): p.grad *is* the bucket view; autograd accumulates into it.
    grad_dtype = float32 for BF16 params: each post-accumulate hook adds p.grad into the FP32 bucket
                 and drops p.grad, so accumulation over microbatches and the reduction run in FP32.

Under the ZeRO-1 optimizer (``shard_gradients``: OLMoDDPOptimizer(reduce_scatter=True), its default
except on CPU ranks, where gloo's reduce-scatter is slower than its all-reduce) a bucket is
reduce-scattered instead (train/grad_shards.py): each rank receives the reduced gradient of its owned
ranges only (``owned_grad``), half the all-reduce's traffic; the flat bucket then holds this rank's
local gradient, and ``main_grad`` refuses (``full_grad`` gathers, collectively).

A bucket's reduction (all-reduce or reduce-scatter) starts (async) as soon as all its gradients are
in, in bucket order on every rank (collectives must match across ranks). It runs over the family's
process group, or (``host_shm``: CPU ranks of one x86-64 host, the grad_transport option) through host
shared memory (train/shm_reduce.py): the start copies the bucket into this rank's segment, the wait
sums the members' segments; a gloo collective's latency among CPU processes is what the last bucket
would otherwise expose. Two ways the gradients come in:

    in graph (default; passes/grad_reduction.py): the compiled backward itself adds each gradient
        into its bucket (``graph_ready``, a moe_ddp:: node right after the bucket's last gradient is
        produced) and waits for the reductions before it returns (``graph_finish``); it returns None
        for these parameters, so autograd never accumulates them. ``claim`` re-buckets by the
        backward's production order, so buckets fill (and their all-reduces start) one after another
        while the backward still computes.
    hooks (``grad_reduction="hooks"``, or parameters no compiled backward claimed): post-accumulate
        hooks mark gradients ready; the end-of-backward callback starts the rest and waits. Under a
        captured graph all gradients arrive when the compiled backward returns: little overlap.

Once a compiled backward claimed parameters, a gradient reaching any parameter through autograd
outside it under sync raises (its bucket may already be reduced); models with parameters used outside
the compiled graph compile with ``grad_reduction="hooks"``.

Gradient accumulation over m microbatches: run the first m−1 backwards under ``no_sync()``; the
last one reduces the accumulated total once.

A backward that raises never runs its end-of-backward callback (autograd drops queued callbacks) nor
the graph's finish node, so the reduction state is keyed by autograd's graph-task id: the first hook
or graph node of a new backward (or ``zero_grad``) finds the state of an abandoned one, waits for its
in-flight reductions and starts afresh. That step's gradients are partial, as in plain PyTorch;
``zero_grad()`` before the next step discards them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import MoECompileError, RuntimeFault
from .grad_shards import BucketShards
from .shm_reduce import HostShmReduction, ShmBucket

# ctx_id → the reducer of that program (graph nodes carry ints; see attach)
_REDUCERS: weakref.WeakValueDictionary[int, MultiGroupDistributedDataParallel] = weakref.WeakValueDictionary()


def reducer(ctx_id: int) -> MultiGroupDistributedDataParallel:
    try:
        return _REDUCERS[ctx_id]
    except KeyError:
        raise RuntimeFault(f"no gradient reducer for runtime context {ctx_id} (was the CompiledMoE released?)") from None


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
    shards: BucketShards | None = None  # reduce-scatter into the ZeRO-1 owned ranges (shard_gradients)
    shm_group: HostShmReduction | None = None  # reduce through host shared memory (train/shm_reduce.py)
    shm: ShmBucket | None = None  # this bucket's segment, allocated at its first reduction

    def shm_bucket(self) -> ShmBucket:
        """The shared-memory segment for the next reduction (collective over the group the first time,
        and again when sharding changed the send's size)."""
        numel = self.shards.send_numel if self.shards is not None else self.flat.numel()
        if self.shm is None or self.shm.data.local.numel() != numel:
            self.release_shm()
            self.shm = self.shm_group.bucket(numel, self.flat.dtype)
        return self.shm

    def release_shm(self) -> None:
        if self.shm is not None:
            self.shm.release()
            self.shm = None

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


def bucket_layout(families: list[ParamFamily], rank: Callable[[nn.Parameter], int | None], bucket_bytes: int,
                  grad_dtype: torch.dtype | None) -> list[tuple[ParamFamily, torch.dtype, list[nn.Parameter]]]:
    """The buckets of ``families``' trainable parameters, in bucket order: per family and gradient dtype,
    in production order (``rank(p)``: p's place in the compiled backwards' production order; None: not
    produced yet, after the rest, in reverse registration order, roughly the backward's), split once a
    bucket holds ``bucket_bytes``; ordered by when their last gradient is produced."""
    trained = [p for fam in families for p in fam.params if p.requires_grad]
    last = 1 + max((r for p in trained if (r := rank(p)) is not None), default=-1)
    order = lambda p: r if (r := rank(p)) is not None else last  # noqa: E731
    out = []
    for fam in families:
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        params = sorted(reversed([p for p in fam.params if p.requires_grad]), key=order)  # stable
        for p in params:
            by_dtype.setdefault(grad_dtype or p.dtype, []).append(p)
        for dtype, params in by_dtype.items():
            chunk: list[nn.Parameter] = []
            size = 0
            for p in params:
                chunk.append(p)
                size += p.numel() * dtype.itemsize
                if size >= bucket_bytes:
                    out.append((fam, dtype, chunk))
                    chunk, size = [], 0
            if chunk:
                out.append((fam, dtype, chunk))
    if last:  # bucket order = the order the compiled backward completes them in
        out.sort(key=lambda b: max(order(p) for p in b[2]))
    return out


class MultiGroupDistributedDataParallel:
    def __init__(self, families: list[ParamFamily], bucket_bytes: int = 25 * 2**20,
                 grad_dtype: torch.dtype | None = None, host_shm: bool = False,
                 tied: list[tuple[nn.Parameter, dist.ProcessGroup, int]] = ()) -> None:
        self.families = families
        # weights tied across pipeline stages: (parameter, its holders' group, their number), summed over the
        # group after the reduction as a mean of gradients pre-scaled by the number (runtime/tied_weights.py)
        self.tied = list(tied)
        # host_shm: reduce over host shared memory (CPU ranks of one host; collective over each family's group)
        self._shm = {f.name: HostShmReduction(f.group, f.name) for f in families if host_shm and f.group is not None}
        self.bucket_bytes = bucket_bytes
        self.buckets: list[GradBucket] = []
        self._where: dict[int, tuple[GradBucket, int]] = {}
        self._sync = True
        self._task: int | None = None  # graph-task id of the backward whose reductions are in flight
        self._next = 0
        # in-graph reduction: stable slot per parameter (graph nodes name parameters by slot)
        self.slots = [p for fam in families for p in fam.params if p.requires_grad]
        self._slot_of = {id(p): k for k, p in enumerate(self.slots)}
        tied_n = {id(p): n for p, _, n in self.tied}
        self._pre_scale = [fam.pre_scale * tied_n.get(id(p), 1) for fam in families for p in fam.params
                           if p.requires_grad]
        self._names: list[str] = [f"parameter {k}" for k in range(len(self.slots))]
        self._rank: dict[int, int] = {}  # slot → position in the compiled backwards' production order
        self._claimed: set[int] = set()  # slots some compiled backward reduces in graph
        self._reduced_task: int | None = None  # graph task whose in-graph reduction already finished
        self._shard = False  # reduce-scatter instead of all-reduce (shard_gradients)
        self._gathered: dict[int, list[torch.Tensor]] = {}  # bucket id → whole reduced grads (full_grad)
        self._build_buckets(grad_dtype)
        self._arrived = [False] * len(self.slots)  # a defined gradient reached the slot through autograd
        with torch.enable_grad():  # each parameter's AccumulateGrad node, held so that autograd keeps it
            self._acc = [p.view_as(p).grad_fn.next_functions[0][0] for p in self.slots]
        for k, p in enumerate(self.slots):
            p.register_hook(self._grad_hook(k))
            p.register_post_accumulate_grad_hook(self._hook)

    def _build_buckets(self, grad_dtype: torch.dtype | None) -> None:
        if self._task is not None:  # reductions a failed backward left in flight finish on the old buckets
            self._abandon()
        old = {id(p): b.view(i).clone() for b in self.buckets for i, p in enumerate(b.params)}
        for b in self.buckets:  # their shared-memory segments go with them (new buckets map their own)
            b.release_shm()
        self.grad_dtype = grad_dtype
        self.buckets, self._where = [], {}
        for fam, dtype, chunk in bucket_layout(self.families, self._production_rank(), self.bucket_bytes, grad_dtype):
            self._add_bucket(fam, dtype, chunk)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if id(p) in old:  # re-bucketing: carry the accumulated gradient over
                    b.view(i).copy_(old[id(p)])
                    p.grad = b.view(i) if b.adopts(i) else None
                else:
                    b.adopt(i)

    def _production_rank(self):
        return lambda p: self._rank.get(self._slot_of[id(p)])

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
        b = GradBucket(fam.name, fam.group, fam.scale, list(params), torch.zeros(n, dtype=dtype, device=dev), offsets,
                       shm_group=self._shm.get(fam.name))
        if self._shard and fam.group is not None:
            b.shards = BucketShards(b.flat, offsets, [p.numel() for p in params], fam.group)
        for i, p in enumerate(params):
            self._where[id(p)] = (b, i)
        self.buckets.append(b)

    # -- the optimizer's view ----------------------------------------------------------------------
    def main_grad(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s gradient as the optimizer reads it: its view into the (reduced) bucket."""
        b, i = self._where[id(p)]
        if b.shards is not None:
            raise MoECompileError(
                f"main_grad({self._names[self._slot_of[id(p)]]}): gradients are reduce-scattered into the ZeRO-1 "
                "optimizer's owned ranges (OLMoDDPOptimizer(reduce_scatter=True)), so no rank holds the whole reduced "
                "gradient; read owned_grad(p), full_grad(p) (collective), or build the optimizer with reduce_scatter=False")
        return b.view(i)

    def shard_gradients(self, enable: bool = True) -> None:
        """Reduce-scatter every bucket of a group of more than one rank into the ZeRO-1 owned ranges
        (train/grad_shards.py) instead of all-reducing it. Not allowed inside a backward."""
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError("MultiGroupDistributedDataParallel.shard_gradients called during a backward")
        if self._task is not None:
            self._abandon()
        self._shard = enable
        self._gathered.clear()
        for b in self.buckets:
            b.shards = (BucketShards(b.flat, b.offsets, [p.numel() for p in b.params], b.group)
                        if enable and b.group is not None else None)

    def owned_grad(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s reduced gradient over this rank's ZeRO-1 owned range of its flattened local tensor."""
        b, i = self._where[id(p)]
        if b.shards is not None:
            return b.shards.owned(i)
        return b.view(i).reshape(-1)  # a group of one rank owns the whole tensor

    def full_grad(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s whole reduced gradient. Collective over p's replica group when reduce-scattered (every
        rank of the group must ask for the same parameters in the same order)."""
        b, i = self._where[id(p)]
        if b.shards is None:
            return b.view(i)
        if id(b) not in self._gathered:
            self._gathered[id(b)] = b.shards.gather()
        return self._gathered[id(b)][i].view(p.shape)

    def zero_grad(self) -> None:
        if self._task is not None and self._task != torch._C._current_graph_task_id():
            self._abandon()  # a backward that raised left its reduction state behind
        self._gathered.clear()
        for b in self.buckets:
            b.flat.zero_()
            if b.shards is not None:
                b.shards.out.zero_()
            for i, p in enumerate(b.params):
                if not b.adopts(i):
                    p.grad = None

    # -- autograd hooks ----------------------------------------------------------------------------
    def _grad_hook(self, k: int):
        """Tensor hook: pre-scale the incoming gradient; note whether one came (autograd also runs the
        hooks of a parameter whose gradient is None, e.g. one the compiled backward reduced itself)."""
        s = self._pre_scale[k]

        def hook(g: torch.Tensor | None) -> torch.Tensor | None:
            self._arrived[k] = g is not None
            return g * s if g is not None and s != 1.0 else None

        return hook

    def _hook(self, p: torch.Tensor) -> None:
        b, i = self._where[id(p)]
        if not b.adopts(i):  # move the fresh gradient into the high-precision bucket, even under no_sync
            b.adopt(i)
        if not self._sync:
            return
        k = self._slot_of[id(p)]
        if self._claimed and not self._arrived[k]:
            return  # nothing came through autograd: the compiled backward reduces this one itself
        if self._claimed:
            raise RuntimeFault(
                f"{self._names[k]} received a gradient outside the compiled backward, which "
                "reduces the gradients itself (its bucket may be reduced already); compile with "
                "grad_reduction='hooks' when parameters are used outside the compiled graph")
        task = torch._C._current_graph_task_id()
        if self._task != task:
            if self._task is not None:
                self._abandon()
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b.ready.add(i)
        self._launch_ready()

    # -- in-graph reduction (passes/grad_reduction.py places the nodes that call these) ------------
    def attach(self, ctx_id: int, param_names: dict[int, str]) -> None:
        """Let the graphs of runtime context ``ctx_id`` reach this reducer; ``param_names``: id → name."""
        _REDUCERS[ctx_id] = self
        self._names = [param_names.get(id(p), f"parameter {k}") for k, p in enumerate(self.slots)]

    def slot(self, name: str) -> int | None:
        """The slot of the parameter called ``name`` (None: not reduced here, e.g. frozen)."""
        try:
            return self._names.index(name)
        except ValueError:
            return None

    def claim(self, produced: list[int]) -> list[list[int]]:
        """A compiled backward produces the gradients of ``produced`` (slots, in production order) and
        will reduce them itself. The first claim of new parameters re-buckets by production order
        (accumulated gradients carry over). Returns the claimed slots grouped by bucket, in bucket order."""
        new = [k for k in produced if k not in self._rank]
        task = torch._C._current_graph_task_id()  # aot_autograd may compile a backward when it first runs
        if new and (self._task is None or self._task != task):  # never re-bucket under in-flight reductions
            if self._task is not None:
                self._abandon()
            for k in new:
                self._rank[k] = len(self._rank)
            self._build_buckets(self.grad_dtype)
        self._claimed.update(produced)
        groups: dict[int, list[int]] = {}
        index = {id(b): j for j, b in enumerate(self.buckets)}
        for k in produced:
            groups.setdefault(index[id(self._where[id(self.slots[k])][0])], []).append(k)
        return [groups[j] for j in sorted(groups)]

    def graph_ready(self, slots: list[int], grads: list[torch.Tensor]) -> None:
        """Add a compiled backward's gradients of ``slots`` into their buckets; under sync, mark them
        ready and start the all-reduce of every bucket now complete (in bucket order)."""
        task = torch._C._current_graph_task_id()
        if self._task is not None and self._task != task:
            self._abandon()  # a backward that raised left its reduction state behind
        # as autograd would: accumulate only into parameters this backward accumulates into (not under
        # torch.autograd.grad(outputs, inputs=activations), e.g. a pipeline stage's metadata inference)
        todo = [(k, g) for k, g in zip(slots, grads) if torch._C._will_engine_execute_node(self._acc[k])]
        if not todo:
            return
        if self._sync and self._reduced_task == task:
            raise RuntimeFault(
                "a second compiled backward ran in one autograd backward after the first reduced the gradients "
                "(a summed loss of several forwards): compile with forwards_in_flight=k (those programs reduce at "
                "the end of the backward) or grad_reduction='hooks'")
        for k, g in todo:
            b, i = self._where[id(self.slots[k])]
            b.adopt(i)  # a p.grad set elsewhere (or None) becomes the bucket's starting value
            b.view(i).add_(g, alpha=self._pre_scale[k])  # pre-scaled as the hooks path's tensor hook, no temporary
            if self._sync:
                b.ready.add(i)
        if self._sync:
            self._task = task
            self._launch_ready()

    def graph_finish(self) -> None:
        """End of a compiled backward under sync: start the buckets still pending (parameters this
        graph does not produce), wait for every reduction, scale."""
        task = torch._C._current_graph_task_id()
        if not self._sync or self._task != task:
            return  # nothing accumulated under sync in this backward: nothing to reduce (as with hooks)
        self._finish()
        self._reduced_task = task

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not force and len(b.ready) < len(b.params):
                return
            for i in range(len(b.params)):
                b.adopt(i)
            shm = b.shm_bucket() if b.shm_group is not None else None
            if b.shards is not None:
                b.work = b.shards.launch(shm)
            elif shm is not None:
                b.work = shm.start(b.flat, b.flat)
            elif b.group is not None:
                b.work = dist.all_reduce(b.flat, group=b.group, async_op=True)
            self._next += 1

    def _finish(self) -> None:
        self._launch_ready(force=True)
        self._gathered.clear()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if b.shards is not None:
                b.shards.release()
            if b.scale != 1.0:
                (b.flat if b.shards is None else b.shards.out).mul_(b.scale)
            b.ready.clear()
        for p, group, n in self.tied:  # every holder's part summed (mean of parts pre-scaled by n)
            b, i = self._where[id(p)]
            g = b.view(i) if b.shards is None else b.shards.owned(i)
            dist.all_reduce(g, group=group)
            g.div_(n)
        self._next = 0
        self._task = None

    def _abandon(self) -> None:
        """Drop the reduction state of a backward that raised before its end callback ran: finish
        the reductions it started (every rank issued them, so they complete) and forget the rest."""
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if b.shards is not None:
                b.shards.release()
            b.ready.clear()
        self._next = 0
        self._task = None

    def close(self) -> None:
        """Release the gradient buckets' shared-memory segments and heaps (host_shm); a reduction after
        this fails naming the closed heap. Local to the rank."""
        if self._task is not None:
            self._abandon()
        for b in self.buckets:
            b.release_shm()
        for red in self._shm.values():
            red.heap.close()

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
            {"family": b.family, "dtype": str(b.flat.dtype), "params": len(b.params), "bytes": b.nbytes,
             "transport": "none" if b.group is None else "host_shm" if b.shm_group is not None else "process_group",
             "reduction": "reduce-scatter" if b.shards is not None else "all-reduce"}
            for b in self.buckets
        ]
