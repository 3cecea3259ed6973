"""Front end: recognise MoE blocks and install their canonical (capturable) form."""

from __future__ import annotations

from dataclasses import replace

import torch.nn as nn

from ..errors import UnsupportedFeatureError
from .canonical import ExpertWeights, expert_tensors, install, set_context
from .kept_state import kept_state
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
    candidates = find_candidates(model)
    _check_distinct(model, candidates)
    for i, c in enumerate(candidates):
        with kept_state(c.block):  # the probe runs the block's own forward: what it updates there comes back
            spec = replace(settle(c, probe_weights), index=i)
        _check_block_reads_all(c.block, spec)
        out.append((spec, c))
    return out


def _check_distinct(model: nn.Module, candidates: list[Candidate]) -> None:
    """One block module reached under two paths (used at two layers), or one experts module held by two
    blocks (a shared expert pool): each block's canonical form takes its own copy of the expert weights,
    so the tie would be cut silently (each place trained apart), and a block used twice would be
    captured twice under one name. (A router or shared expert used by two blocks is fine: the canonical
    forms read those modules themselves.)"""
    where: dict[int, list[str]] = {}  # every path of every module, in one walk
    for n, m in model.named_modules(remove_duplicate=False):
        where.setdefault(id(m), []).append(n)
    for c in candidates:
        paths = where.get(id(c.block), [])
        if len(paths) > 1:
            raise UnsupportedFeatureError(
                f"{c.path}: the same MoE block module is used at {paths} (shared weights); not supported: give "
                "each layer its own block")
    seen: dict[int, str] = {}
    for c in candidates:
        experts = getattr(c.block, c.experts_attr, None)
        if experts is not None and seen.setdefault(id(experts), c.path) != c.path:
            raise UnsupportedFeatureError(
                f"{c.path}: its experts module is also {seen[id(experts)]}'s (one expert pool shared by two MoE "
                "blocks); not supported: each block's compiled form holds its own copy of the expert weights, "
                "so the tie would be cut — give each block its own experts")


def _router_reads(spec: MoEBlockSpec) -> tuple[set[str], set[str]] | None:
    """Names (exact, and prefixes of child modules) relative to the router module that the canonical form
    reads; None when the router's own forward runs (it reads everything it holds)."""
    r = spec.router
    if r.own_forward:
        return None
    exact = {a for a in (r.weight_attr, r.logit_bias_attr, r.input_scale_attr, r.expert_scale_attr,
                         r.weight_scale_attr, r.hash_table_attr) if a}
    if r.bias_in_router and spec.router_attr and r.bias_attr.startswith(spec.router_attr + "."):
        exact.add(r.bias_attr[len(spec.router_attr) + 1:])
    return exact, {a for a in (r.input_norm_attr,) if a}


def _check_block_reads_all(block: nn.Module, spec: MoEBlockSpec) -> None:
    """The compiled forward reads the router's weight (and the attributes its spec names), the experts, the
    shared expert and its gate: a parameter or buffer elsewhere in the block or its router would be
    dropped or left unupdated, and the probe cannot always see it (a scale initialised to ones, a branch
    whose output starts at zero, a bias that is zero when compiling, a counter the forward updates). In
    "block" mode the block's own forward is replaced whole; in "components" mode its router's is."""
    def named(mod: nn.Module) -> list[tuple[str, str]]:
        return [(n, "parameter") for n, _ in mod.named_parameters()] + [(n, "buffer") for n, _ in mod.named_buffers()]

    extra = []
    router = getattr(block, spec.router_attr, None) if spec.router_attr else None
    reads = _router_reads(spec) if router is not None else None
    if reads is not None:
        exact, prefixes = reads
        extra += [(f"{spec.router_attr}.{n}", k) for n, k in named(router)
                  if n not in exact and not any(n.startswith(p + ".") for p in prefixes)]
    if spec.mode == "block":
        read = [a for a in (spec.router_attr, spec.experts_attr, spec.shared_attr, spec.shared_gate_attr) if a]
        extra += [(n, k) for n, k in named(block)
                  if n != spec.router.bias_attr and not any(n == a or n.startswith(a + ".") for a in read)]
    if extra:
        raise UnsupportedFeatureError(
            f"{spec.path}: not read by the block's compiled form: {', '.join(f'{k} {n}' for n, k in extra)} (it reads "
            "the router's weight and the routing attributes it recognised, the experts and the shared expert), so "
            "it would be dropped, or a value the forward updates left unupdated; not supported")


def canonicalize(blocks: list[tuple[MoEBlockSpec, Candidate]], ep_size: int, ep_rank: int, ctx: int) -> None:
    """Install canonical forwards keeping this rank's experts: [r·L, (r+1)·L) with L = N / ep_size."""
    for spec, c in blocks:
        w_in, w_out = c.full_weights()
        nl = spec.experts.num_experts // ep_size
        sl = slice(ep_rank * nl, (ep_rank + 1) * nl)
        biases = tuple(b[sl].detach().clone() for b in c.full_biases()) if c.full_biases else None  # shard with experts
        install(c.block, spec, w_in[sl].detach().clone(), w_out[sl].detach().clone(), ctx, biases)
