"""Exact parameter counts of a (compiled) model, classified by family.

Routed-expert parameters are the canonical expert tensors (``CompiledMoE.is_expert_param``; each rank
holds 1/ep_mp of them). Everything else is dense: routers, shared experts (and their gates), and the
backbone (embeddings, attention, norms, output head, dense MLPs). Tied parameters count once, as
``named_parameters`` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import MoECompileError
from ..frontend import MoEBlockSpec


class LedgerError(MoECompileError, ValueError):
    """The ledger cannot describe this model or program (the message says which part and why)."""


@dataclass(frozen=True)
class MoEShape:
    """The MoE layer shape shared by every MoE block of the model."""

    d: int
    h_e: int
    N: int
    K: int
    gated: bool
    layers: int  # L
    m_s: int  # shared-expert width (0: none)
    fp32_route_weights: bool
    bias: bool = False  # expert biases b_in [N, F], b_out [N, d]


@dataclass(frozen=True)
class ParamCounts:
    expert_local: int  # this rank's routed-expert parameters
    expert_total: int  # all ranks' (expert_local · ep_mp)
    router_projections: int  # the routers' [N, d] projections, the formula's P_router = L·N·d
    shared: int  # shared experts without their gates
    shared_gate: int
    lookup: int  # embedding tables used only by lookup
    vector: int  # 1-D parameters (norm scales, biases)
    dense: int
    local_bytes: int  # bytes of the parameters this rank holds
    local: int  # parameters this rank holds

    @property
    def backbone(self) -> int:
        """Dense parameters besides the router projections and shared experts: a router's other parameters
        (biases, scales, a router network's layers, rows scoring zero-computation experts) count here."""
        return self.dense - self.router_projections - self.shared - self.shared_gate


def moe_shape(blocks: Iterable[MoEBlockSpec]) -> MoEShape:
    blocks = list(blocks)
    if not blocks:
        raise LedgerError("the program has no MoE blocks; the ledger describes MoE models")

    def key(s: MoEBlockSpec) -> tuple:
        e, r = s.experts, s.router
        return (e.d_model, e.hidden, e.num_experts, r.top_k, e.gated, s.shared_hidden, r.fp32_weights, e.bias)

    first = key(blocks[0])
    for s in blocks[1:]:
        if key(s) != first:
            raise LedgerError(
                f"MoE blocks differ in shape (d, h_e, N, K, gated, m_s, fp32 route weights, expert biases): {blocks[0].path} has "
                f"{first}, {s.path} has {key(s)}; the ledger's formulas describe one MoE layer shape"
            )
    d, h, n, k, gated, m_s, fp32, bias = first
    return MoEShape(d, h, n, k, gated, len(blocks), m_s, fp32, bias)


def _under(name: str, prefix: str) -> bool:
    return name.startswith(prefix + ".")


def count_params(model: nn.Module, blocks: Iterable[MoEBlockSpec], is_expert: Callable[[str], bool],
                 ep_mp: int) -> ParamCounts:
    """Classify ``model``'s parameters (``is_expert`` names the routed-expert tensors)."""
    blocks = list(blocks)
    routers = [f"{b.path}.{b.router_attr}" for b in blocks]
    shared = [f"{b.path}.{b.shared_attr}" for b in blocks if b.shared_attr]
    gates = [f"{b.path}.{b.shared_gate_attr}" for b in blocks if b.shared_gate_attr]
    linear_weights = {id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Linear)}
    lookup_ids = {id(mod.weight) for mod in model.modules()
                  if isinstance(mod, nn.Embedding) and id(mod.weight) not in linear_weights}
    c = dict(expert_local=0, shared=0, shared_gate=0, lookup=0, vector=0, dense=0, local_bytes=0, local=0)
    for name, p in model.named_parameters():
        n = p.numel()
        c["local"] += n
        c["local_bytes"] += n * p.element_size()
        if is_expert(name):
            c["expert_local"] += n
            continue
        c["dense"] += n
        if any(_under(name, r) for r in routers):
            pass  # a router's: its [N, d] projection is P_router, its other parameters backbone
        elif any(_under(name, s) for s in shared):
            c["shared"] += n
        elif any(_under(name, g) for g in gates):
            c["shared_gate"] += n
        if id(p) in lookup_ids:
            c["lookup"] += n
        elif p.dim() == 1:
            c["vector"] += n
    projections = sum(b.experts.num_experts * b.experts.d_model for b in blocks)
    return ParamCounts(expert_total=c["expert_local"] * ep_mp, router_projections=projections, **c)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
