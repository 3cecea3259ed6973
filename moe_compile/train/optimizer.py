"""OLMoDDPOptimizer: AdamW on FP32 main weights, ZeRO-1 sharded over each family's replica group.

Terms (glossary): FP32 main weight, main_grad, compute weight, copy-back, persistent training state,
checkpoint-view DTensor. Two parameter families, as in MultiGroupDistributedDataParallel:

    dense  family — replica group = the folded dp×cp group; the local tensor is the whole parameter
    expert family — replica group = ep_dp; the local tensor is this rank's ep_mp shard [L, out, in]

ZeRO-1 layout (g = size of the family's replica group, q = this rank's index in it): each local
tensor (numel n) is flattened and split torch.chunk-style, c = ceil(n/g), rank q owning
[q·c, min((q+1)·c, n)). The FP32 main weight, exp_avg and exp_avg_sq of the owned ranges live in one
flat per family, each parameter in a slot of c elements whose tail past the owned range stays zero
(it is padding for the all-gather). This is exactly DTensor's Shard(0) split of the flattened global
tensor (dense: over the dp×cp group; experts: over ep_mp, then over ep_dp), so the pieces are
checkpoint-view DTensors as they stand: topology-portable, no rank holding a full expert tensor.

    step():
        intake      grad[slot] = owned_grad(p): the bucket reduce-scattered into the owned ranges
                    (reduce_scatter=True), or main_grad(p).flatten()[lo:hi] of the all-reduced
                    bucket (False). None (auto): reduce-scatter except on CPU ranks (gloo), whose
                    reduce_scatter_tensor is 1.25–1.6× slower than its all_reduce at 1–32 MB on 2
                    and 4 CPU ranks (measured), so the all-reduce wins there; NCCL's reduce-scatter
                    moves half an all-reduce's bytes.
        norm²       = Σ over all ranks of Σ grad²  — every logical element is owned by exactly one rank (a
                      weight tied across pipeline stages: by one rank of each of its holder groups, the first)
                      (dense: one of dp×cp; expert: one of ep_dp, and ep_mp ranks own distinct shards)
        non-finite  → log, count, return skipped (nothing applied; the caller's zero_grad drops them)
        clip        grad *= min(1, max_norm / (norm + 1e-6))          (as torch clip_grad_norm_)
        AdamW       decoupled weight decay, bias correction           (as torch.optim.AdamW)
        copy-back   all_gather the main flat over the family group → each parameter's local FP32 main
                    → every registered compute weight .refresh_from(main)

FP32 main weights start from the compute weights at construction (for a BF16 model that is the BF16
anchor; load a checkpoint to start from FP32 values). Compute weights: by default the parameter tensor itself (FP32 or BF16; copy-back casts). Derived
caches (an FP8WeightStore's MXFP8 qdata/scale per orientation) register with
``add_compute_weight(name, obj)``; they are refreshed after every applied step and after a load.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import MoECompileError
from .grad_shards import chunk_range

if TYPE_CHECKING:
    from ..compiled import CompiledMoE

log = logging.getLogger("moe_compile.train")

STATE_KINDS = ("main", "exp_avg", "exp_avg_sq")


class ComputeWeight(Protocol):
    """A representation consumed by forward/backward, rebuilt from the FP32 main weight (copy-back)."""

    def refresh_from(self, main: torch.Tensor) -> None:
        """``main``: the parameter's local FP32 main weight (shape of the local parameter)."""


class ParamComputeWeight:
    """The parameter tensor itself as compute weight: copy-back casts FP32 main to its dtype."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param

    def refresh_from(self, main: torch.Tensor) -> None:
        with torch.no_grad():
            self.param.copy_(main.view(self.param.shape))


@dataclass
class _Slot:
    name: str  # canonical parameter name in cm.model
    param: nn.Parameter
    lo: int  # owned range of the flattened local tensor
    hi: int
    off: int  # slot start in the family flats
    width: int  # c = ceil(n / g)
    global_numel: int  # numel of the whole (global) parameter
    global_offset: int  # where the owned range starts in the flattened global tensor
    compute: list[ComputeWeight] = field(default_factory=list)

    @property
    def owned(self) -> int:
        return self.hi - self.lo


@dataclass
class _Family:
    name: str  # "dense" | "expert"
    group: dist.ProcessGroup | None  # replica group (None: one rank)
    size: int
    mesh: Any  # DeviceMesh of the checkpoint views (None in a single process)
    placements: tuple
    slots: list[_Slot]
    width: int  # Σ slot widths
    state: dict[str, torch.Tensor]  # main / exp_avg / exp_avg_sq: [width] FP32
    grad: torch.Tensor  # [width] FP32 main_grad pieces (padding stays zero)


@dataclass
class StepResult:
    grad_norm: float  # global, before clipping
    skipped: bool  # non-finite gradients: nothing was applied
    clip_coef: float = 1.0


def auto_reduce_scatter(cm: CompiledMoE) -> bool:
    """reduce_scatter=None: reduce-scatter the gradient buckets on accelerators (NCCL), all-reduce them on
    CPU ranks (gloo, whose reduce-scatter is the slower of the two)."""
    return cm.groups is not None and cm.groups.device_type != "cpu"


class OLMoDDPOptimizer:
    """AdamW with FP32 main weights over a CompiledMoE's parameters; see the module docstring."""

    def __init__(self, cm: CompiledMoE, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, max_grad_norm: float | None = None,
                 reduce_scatter: bool | None = None) -> None:
        # written as `not (x >= 0)` so NaN is refused too (a NaN lr turns every weight NaN in one step)
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and math.isfinite(lr + eps + weight_decay)
                and all(0 <= b < 1 for b in betas)):
            raise MoECompileError(f"OLMoDDPOptimizer: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}: "
                                  "need lr, eps, weight_decay finite and ≥ 0 and 0 ≤ beta < 1")
        if max_grad_norm is not None and not (max_grad_norm > 0):  # NaN would switch clipping off
            raise MoECompileError(f"OLMoDDPOptimizer: max_grad_norm={max_grad_norm} must be positive (or None)")
        self.cm = cm
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.max_grad_norm = max_grad_norm
        self.step_count = 0  # applied steps (AdamW bias correction)
        self.skipped_steps = 0
        if cm.ddp is not None and any(p.dtype != torch.float32 for p in cm.parameters()):
            cm.ddp.set_grad_dtype(torch.float32)  # main_grad: accumulate and reduce in FP32
        self.families = [self._family(kind) for kind in ("dense", "expert")]
        self.slots = {s.name: s for f in self.families for s in f.slots}
        # the step reads only the owned ranges: the buckets may be reduce-scattered into them (grad_shards.py)
        self.reduce_scatter = cm.ddp is not None and (auto_reduce_scatter(cm) if reduce_scatter is None else reduce_scatter)
        if cm.ddp is not None:
            cm.ddp.shard_gradients(self.reduce_scatter)
            bad = [s.name for s in self.slots.values() if self.reduce_scatter and cm.ddp.owned_grad(s.param).numel() != s.owned]
            if bad:
                raise MoECompileError(f"OLMoDDPOptimizer: the gradient buckets' reduce-scatter ranges of {bad[:3]} differ from "
                                      "the ZeRO-1 owned ranges (the reducer and the optimizer disagree on a replica group)")
        for store in cm.compute_weights():  # MXFP8 compute-weight caches refresh from the FP32 main
            self.add_compute_weight(store.name, store)
        self.copy_back()  # the caches start from the FP32 main weights, not the BF16 anchors
        cm.optimizers.add(self)  # cm.load_state_dict sets the main weights (set_main)

    def set_main(self, name: str, local: torch.Tensor) -> None:
        """The FP32 main weight of parameter ``name`` from a loaded local tensor (the whole dense tensor
        or this rank's expert shard), as cm.load_state_dict loads it; the moments are kept, as torch's
        optimizers keep theirs over a model.load_state_dict. Local: each rank sets its owned range."""
        s = self.slots.get(name)
        if s is None:  # not trained here: frozen, or another pipeline stage's
            return
        fam = next(f for f in self.families if s in f.slots)
        with torch.no_grad():
            fam.state["main"][s.off: s.off + s.owned] = local.detach().reshape(-1)[s.lo: s.hi].float()

    def release_anchors(self) -> int:
        """Drop the BF16 anchor storage of every FP8WeightStore-backed parameter: from now on the FP32
        main weight here is its only full-precision copy (caches and checkpoints read it). Collective."""
        from .fp8_weight_store import FP8WeightStore

        released = 0
        for f in self.families:
            for s, main in zip(f.slots, self._gather(f, "main")):
                stores = [cw for cw in s.compute if isinstance(cw, FP8WeightStore)]
                if stores and not stores[0].anchor_released:
                    s.compute = [cw for cw in s.compute if not isinstance(cw, ParamComputeWeight)]
                    stores[0].release_anchor(main.clone())
                    released += 1
        return released

    # -- layout ------------------------------------------------------------------------------------
    def _family(self, kind: str) -> _Family:
        cm, g = self.cm, self.cm.groups
        params = [(n, p) for n, p in cm.model.named_parameters()  # this rank's pipeline stages only
                  if p.requires_grad and cm.owns(n) and cm.is_expert_param(n) == (kind == "expert")]
        ep, ep_rank = cm.program.ep_size, cm.program.ep_rank
        group, mesh, placements = None, None, ()
        if g is not None:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import Shard

            if kind == "dense":
                group = g.dense
                mesh, placements = DeviceMesh.from_group(g.dense, g.device_type), (Shard(0),)
            else:
                group = g.ep_dp
                stage = g.spec.dense_coords(g.rank)[0]
                layout = g.spec.moe_mesh_tensor()[stage].T.contiguous()  # [ep_mp, ep_dp]
                mesh = DeviceMesh.from_group([g.ep_mp, g.ep_dp], g.device_type, mesh=layout,
                                             mesh_dim_names=("ep_mp", "ep_dp"))
                placements = (Shard(0), Shard(0))
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        slots, off = [], 0
        for name, p in params:
            n = p.numel()
            lo, hi = chunk_range(n, size, rank)
            width = -(-n // size) if n else 0
            expert = kind == "expert"
            slots.append(_Slot(name, p, lo, hi, off, width, n * ep if expert else n,
                               (ep_rank * n if expert else 0) + lo, [ParamComputeWeight(p)]))
            off += width
        state = {k: torch.zeros(off, dtype=torch.float32) for k in STATE_KINDS}
        for s in slots:
            state["main"][s.off: s.off + s.owned] = s.param.detach().reshape(-1)[s.lo: s.hi].float()
        fam = _Family(kind, group if size > 1 else None, size, mesh, placements, slots, off, state,
                      torch.zeros(off, dtype=torch.float32))
        if mesh is not None:
            self._check_layout(fam)
        return fam

    @staticmethod
    def _check_layout(fam: _Family) -> None:
        """Our ZeRO-1 ranges must be DTensor's own split, or the checkpoint views would be wrong."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for s in fam.slots:
            shape, offset = compute_local_shape_and_global_offset((s.global_numel,), fam.mesh, fam.placements)
            if shape[0] != s.owned or (s.owned and offset[0] != s.global_offset):
                raise MoECompileError(
                    f"{s.name}: ZeRO-1 range [{s.global_offset}, +{s.owned}) differs from DTensor's split "
                    f"[{offset[0]}, +{shape[0]}) of {s.global_numel} elements over {fam.name} mesh {fam.mesh}")

    def add_compute_weight(self, name: str, weight: ComputeWeight) -> None:
        """Register another compute weight of parameter ``name`` (e.g. an MXFP8 cache) for copy-back."""
        if name not in self.slots:
            raise MoECompileError(f"add_compute_weight: {name!r} is not a trainable parameter of the compiled model")
        self.slots[name].compute.append(weight)

    # -- the step ----------------------------------------------------------------------------------
    def _main_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        if self.cm.ddp is not None:
            return self.cm.ddp.main_grad(p)
        return p.grad

    def _intake(self) -> None:
        for f in self.families:
            for s in f.slots:
                if self.reduce_scatter:
                    f.grad[s.off: s.off + s.owned].copy_(self.cm.ddp.owned_grad(s.param))
                    continue
                g = self._main_grad(s.param)
                piece = f.grad[s.off: s.off + s.owned]
                if g is None:
                    piece.zero_()
                else:
                    piece.copy_(g.reshape(-1)[s.lo: s.hi])

    def global_grad_norm(self) -> float:
        """L2 norm of the whole model's gradient, each logical parameter counted once. Collective."""
        sq = torch.zeros((), dtype=torch.float64)
        copies = self.cm.program.tied_copies  # a weight tied across stages counts on its first holder only
        for f in self.families:
            sq += f.grad.double().pow(2).sum()
            for s in f.slots:
                if s.name in copies:
                    sq -= f.grad[s.off: s.off + s.owned].double().pow(2).sum()
        if self.cm.groups is not None and dist.get_world_size() > 1:
            dist.all_reduce(sq)
        return math.sqrt(sq.item())  # nan stays nan: step() skips non-finite gradients

    def step(self) -> StepResult:
        """Take gradients from the buckets, clip, update FP32 main weights, copy back. Collective."""
        self._intake()
        norm = self.global_grad_norm()
        if not math.isfinite(norm):
            self.skipped_steps += 1
            log.warning("optimizer step skipped: non-finite gradient norm %s (%d applied, %d skipped so far)",
                        norm, self.step_count, self.skipped_steps)
            return StepResult(norm, skipped=True, clip_coef=0.0)
        coef = 1.0
        if self.max_grad_norm is not None:
            coef = min(1.0, self.max_grad_norm / (norm + 1e-6))
        self.step_count += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        for f in self.families:
            if not f.width:
                continue
            g, p, m, v = f.grad, f.state["main"], f.state["exp_avg"], f.state["exp_avg_sq"]
            if coef != 1.0:
                g.mul_(coef)
            p.mul_(1 - self.lr * self.weight_decay)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bc1)
        self.copy_back()
        return StepResult(norm, skipped=False, clip_coef=coef)

    def zero_grad(self) -> None:
        if self.cm.ddp is not None:
            self.cm.ddp.zero_grad()
        else:
            for s in self.slots.values():
                s.param.grad = None
        for f in self.families:
            f.grad.zero_()

    def copy_back(self) -> None:
        """Rebuild every compute weight from the FP32 main weights (after an update or a load). Collective."""
        for f in self.families:
            for s, main in zip(f.slots, self._gather(f, "main")):
                for cw in s.compute:
                    cw.refresh_from(main)

    def _gather(self, f: _Family, kind: str) -> list[torch.Tensor]:
        """Each parameter's whole local tensor of state ``kind``, gathered over the family group."""
        flat = f.state[kind]
        if f.group is None:
            return [flat[s.off: s.off + s.param.numel()].view(s.param.shape) for s in f.slots]
        out = torch.empty(f.size * f.width, dtype=flat.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, flat, group=f.group)
        rows = out.view(f.size, f.width)
        return [rows[:, s.off: s.off + s.width].reshape(-1)[: s.param.numel()].view(s.param.shape) for s in f.slots]

    # -- state: checkpoint views and full tensors ----------------------------------------------------
    def new_state(self) -> list[dict[str, torch.Tensor]]:
        """Zeroed storage shaped like the optimizer state (a load stages into it)."""
        return [{k: torch.zeros_like(v) for k, v in f.state.items()} for f in self.families]

    def checkpoint_views(self, state: list[dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
        """Checkpoint-view DTensors of the optimizer state (of ``state`` if given): per parameter and
        kind, the flattened global tensor ``[global numel]`` whose shards are the ZeRO-1 pieces."""
        from torch.distributed.tensor import DTensor

        state = state or [f.state for f in self.families]
        out: dict[str, Any] = {}
        for f, st in zip(self.families, state):
            for s in f.slots:
                for k in STATE_KINDS:
                    piece = st[k][s.off: s.off + s.owned]
                    key = f"{s.name}.{k}"
                    if f.mesh is None:
                        out[key] = piece
                    else:
                        out[key] = DTensor.from_local(piece, f.mesh, f.placements, run_check=False,
                                                      shape=torch.Size((s.global_numel,)), stride=(1,))
        return out

    def load_state(self, state: list[dict[str, torch.Tensor]], step_count: int, skipped_steps: int = 0) -> None:
        """Adopt a (fully loaded) staged state, then copy back the compute weights. Collective."""
        for f, st in zip(self.families, state):
            for k in STATE_KINDS:
                f.state[k].copy_(st[k])
        self.step_count, self.skipped_steps = int(step_count), int(skipped_steps)
        self.copy_back()

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Whole FP32 main weights and moments by canonical name (experts gathered over ep_mp).
        Collective; for tests and inspection — it materialises full expert tensors."""
        out: dict[str, dict[str, torch.Tensor]] = {s.name: {} for s in self.slots.values()}
        for k in STATE_KINDS:
            for f in self.families:
                for s, t in zip(f.slots, self._gather(f, k)):
                    if f.name == "expert" and self.cm.program.ep_size > 1:
                        t = self.cm._gather_experts(t)
                    out[s.name][k] = t.detach().clone()
        return out
