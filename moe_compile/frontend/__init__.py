"""Front end: recognise MoE blocks and install their canonical (capturable) form."""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from ..errors import UnsupportedFeatureError
from .canonical import ExpertWeights, expert_tensors, install, set_context
from .probe import settle
from .recognize import Candidate, find_candidates, read_block, register_recognizer, unregister_recognizer
from .spec import ExpertsSpec, MoEBlockSpec, ParamView, RouterSpec

__all__ = [
    "Candidate",
    "ExpertWeights",
    "ExpertsSpec",
    "MoEBlockSpec",
    "ParamView",
    "RouterSpec",
    "canonicalize",
    "expert_tensors",
    "read_block",
    "recognize",
    "register_recognizer",
    "set_context",
    "unregister_recognizer",
]


def recognize(model: nn.Module) -> list[tuple[MoEBlockSpec, Candidate]]:
    """Find, read and probe every MoE block. Raises RecognitionError naming the block on failure."""
    out, probe_weights = [], {}
    for i, c in enumerate(find_candidates(model)):
        spec = replace(settle(c, probe_weights), index=i)
        _check_block_reads_all(c.block, spec)
        out.append((spec, c))
    return out


def _check_block_reads_all(block: nn.Module, spec: MoEBlockSpec) -> None:
    """In "block" mode the compiled forward replaces the block's own and reads only its router, experts,
    shared expert and gate: a parameter elsewhere in the block would be dropped, and the probe cannot
    always see it (a scale initialised to ones, a branch whose output starts at zero)."""
    if spec.mode != "block":
        return
    read = [a for a in (spec.router_attr, spec.experts_attr, spec.shared_attr, spec.shared_gate_attr) if a]
    extra = [n for n, _ in block.named_parameters()
             if n != spec.router.bias_attr and not any(n == a or n.startswith(a + ".") for a in read)]
    if extra:
        raise UnsupportedFeatureError(
            f"{spec.path}: parameters {extra} are outside the block's router, experts and shared expert; its compiled "
            "form would not use them (not supported)")


def canonicalize(blocks: list[tuple[MoEBlockSpec, Candidate]], ep_size: int, ep_rank: int, ctx: int) -> None:
    """Install canonical forwards keeping this rank's experts: [r·L, (r+1)·L) with L = N / ep_size."""
    for spec, c in blocks:
        w_in, w_out = c.full_weights()
        nl = spec.experts.num_experts // ep_size
        sl = slice(ep_rank * nl, (ep_rank + 1) * nl)
        biases = tuple(b[sl].detach().clone() for b in c.full_biases()) if c.full_biases else None  # shard with experts
        install(c.block, spec, w_in[sl].detach().clone(), w_out[sl].detach().clone(), ctx, biases)
