"""Checkpoint-view DTensors: global views of the compiled model's tensors for torch.distributed.checkpoint.

Each rank views the tensors of its own pipeline stages (the stages' keys are disjoint, so a checkpoint
saved under one pp loads under another). Dense parameters and buffers: replicated over the stage's dense mesh (dp, cp). Routed-expert shards:
``Shard(0)`` over ep_mp and replicated over ep_dp, so the global view is the whole [N, …] tensor while
no rank materialises it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import MoECompileError

if TYPE_CHECKING:
    from ..compiled import CompiledMoE


def _stage_meshes(cm: CompiledMoE):
    g = cm.groups
    return g.dense_mesh["dp", "cp"], g.moe_mesh["ep_dp", "ep_mp"]


def checkpoint_views(cm: CompiledMoE, fresh: bool = False) -> dict[str, Any]:
    """Views of the model's state; ``fresh``: over new storage of the same layout (a load stages into it)."""
    def own(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if fresh else t.detach()

    if cm.groups is None:
        return {k: own(cm.weight_value(k, v)) for k, v in cm.model.state_dict().items()}
    dense_mesh, moe_mesh = _stage_meshes(cm)
    ep = cm.program.ep_size
    out: dict[str, Any] = {}
    for name, t in cm.model.state_dict().items():
        if not cm.owns(name):  # another pipeline stage saves (and loads) it
            continue
        t = own(cm.weight_value(name, t))
        if cm.is_expert_param(name):
            shape = (t.shape[0] * ep,) + tuple(t.shape[1:])
            out[name] = DTensor.from_local(t, moe_mesh, [Replicate(), Shard(0)], run_check=False,
                                           shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
        else:
            out[name] = DTensor.from_local(t, dense_mesh, [Replicate(), Replicate()], run_check=False)
    return out


def load_checkpoint_views(cm: CompiledMoE, state_dict: dict[str, Any], strict: bool = True):
    own = {k: v for k, v in cm.model.state_dict().items() if cm.owns(k)}
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise MoECompileError(f"checkpoint does not match the compiled model: missing {missing}, unexpected {unexpected}")
    for name, v in state_dict.items():
        if name not in own:
            continue
        local = v.to_local() if isinstance(v, DTensor) else v
        if cm.is_expert_param(name) and not isinstance(v, DTensor):
            nl = own[name].shape[0]
            local = local[cm.program.ep_rank * nl: (cm.program.ep_rank + 1) * nl]
        if local.shape != own[name].shape:
            raise MoECompileError(f"{name}: checkpoint tensor shape {tuple(local.shape)} != model {tuple(own[name].shape)}")
        stores = [s for s in cm.compute_weights() if s.name == name]
        with torch.no_grad():
            if not any(s.anchor_released for s in stores):  # a released anchor holds no values
                own[name].copy_(local)
        for store in stores:  # copy-back: caches from the loaded weight, not a main weight held before
            store.refresh_from(local.float() if store.main is not None else None)
        for opt in cm.optimizers:  # their FP32 main weights too (the next step copies them back)
            opt.set_main(name, local)
    return missing, unexpected
