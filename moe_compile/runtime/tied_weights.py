"""Weights tied across pipeline stages: one tensor read by several stages (input and output embeddings).

Glossary: P / PP (stages). A model with tied input and output embeddings reads one parameter on its first
stage (the token embedding) and its last (the LM head). Each rank of a stage that holds one of its names
keeps the tensor (runtime/stage_weights.py releases only parameters no local name owns), and each stage's
backward adds its own use's gradient to it. The gradient of the tied weight is the sum of those parts:

    group(pipeline)  = its ranks holding a stage of the parameter's names (pp-rank = stage mod pp); a
                       rank holding them all needs no group (autograd sums its stages' parts)
    pre-scale        = n (the group's size) on each incoming gradient, beside the family's
    after reduction  = mean over the group (train/ddp.py), so Σ of the parts; a gradient already summed and
                       accumulated into by a later backward stays as it is (n·g_new averaged, not Σ again)

Every holder then reads the same gradient and applies the same update: the copies stay one tensor. The
gradient norm counts it once (the optimizer leaves out its copies on every holder but the first). Cost: one
all-reduce of the tied tensor's gradient per step over its holders, after the data-parallel reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn

from ..mesh import _groups_along


@dataclass
class TiedWeight:
    names: tuple[str, ...]  # its names in the model (every alias)
    param: nn.Parameter
    group: dist.ProcessGroup  # this pipeline's ranks holding it
    size: int  # the group's size
    first: bool  # this rank is the group's first (the one whose copy the gradient norm counts)


def tied_weights(model: nn.Module, tied: dict[str, tuple[int, ...]], spec, groups) -> list[TiedWeight]:
    """This rank's weights tied across pipeline stages held by more than one rank of its pipeline (``tied``:
    StageSplit.tied). Collective: every rank creates every pipeline's groups, in the same order."""
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in tied and p.requires_grad:  # a frozen one has no gradient to sum
            aliases.setdefault(id(p), []).append(n)
            params[id(p)] = p
    pipes = _groups_along(spec.dense_mesh_tensor(), (0,))
    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    out = []
    for key, names in aliases.items():
        holders = tuple(sorted({st % spec.pp for st in tied[names[0]]}))
        if len(holders) < 2:
            continue
        if holders not in made:
            made[holders] = None
            for pipe in pipes:
                g = dist.new_group([pipe[q] for q in holders])
                if groups.rank in pipe:
                    made[holders] = g
        if groups.pp_rank in holders:
            out.append(TiedWeight(tuple(names), params[key], made[holders], len(holders),
                                  groups.pp_rank == holders[0]))
    return out
