"""Front end: recognise MoE blocks and install their canonical (capturable) form."""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

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
    out = []
    for i, c in enumerate(find_candidates(model)):
        out.append((replace(settle(c), index=i), c))
    return out


def canonicalize(blocks: list[tuple[MoEBlockSpec, Candidate]], ep_size: int, ep_rank: int, ctx: int) -> None:
    """Install canonical forwards keeping this rank's experts: [r·L, (r+1)·L) with L = N / ep_size."""
    for spec, c in blocks:
        w_in, w_out = c.full_weights()
        nl = spec.experts.num_experts // ep_size
        sl = slice(ep_rank * nl, (ep_rank + 1) * nl)
        biases = tuple(b[sl].detach().clone() for b in c.full_biases()) if c.full_biases else None  # shard with experts
        install(c.block, spec, w_in[sl].detach().clone(), w_out[sl].detach().clone(), ctx, biases)
