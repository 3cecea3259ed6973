"""Other pipeline stages' weights, released: a pp > 1 rank holds its own stages' parameters only.

Glossary: P / PP, P_local. ``moe_compile`` takes the whole single-device model on every rank; once
the stage split is planned, each parameter that none of this rank's stages owns keeps its Parameter
object, shape, dtype and ``requires_grad`` but gives up its storage: it becomes a stride-0 view of one
zero (as a released MXFP8 anchor), so a rank's weights are its stages' P_local, not the whole model's.
Its MXFP8 compute-weight caches go with it. Nothing on this rank reads those values: its compiled
stages read their own parameters, gradient buckets, optimizer, checkpoints and ``full_state_dict``
cover owned parameters only (``CompiledMoE.owns``).

The whole model is still what dynamo captures before the graph is split into stages (the first
train_step, the first forward-only evaluation of a shape, explain's plan): ``materialized`` gives the
released parameters fresh uninitialised storage of their old layout for that capture alone — the trace
reads shapes and strides, never values (CPU pages that are never written are never backed) — and
releases it again after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class Released:
    param: nn.Parameter
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _placeholder(p: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(1, dtype=p.dtype, device=p.device).expand(shape)


def release_foreign_weights(model: nn.Module, owned: set[str], ctx, dense_stores: dict) -> dict[str, Released]:
    """Release every parameter none of whose names is in ``owned`` (a parameter tied under an owned name
    stays) and drop its FP8WeightStores (the runtime context's, the program's ``dense_stores``). Name →
    what was released."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    out: dict[str, Released] = {}
    with torch.no_grad():
        for key, p in params.items():
            if any(n in owned for n in names[key]):
                continue
            r = Released(p, tuple(p.shape), tuple(p.stride()))
            p.data = _placeholder(p, r.shape)
            p.grad = None
            for n in names[key]:
                out[n] = r
    gone = set(out)
    for k in [k for k, s in ctx.weight_stores.items() if s.name in gone]:
        del ctx.weight_stores[k]  # expert (block, w_in/w_out) and dense (name, "w") caches of released weights
    for n in gone & set(dense_stores):
        del dense_stores[n]
    return out


@contextlib.contextmanager
def materialized(released: dict[str, Released]) -> Iterator[None]:
    """Released parameters with uninitialised storage of their old layout, for a whole-model capture."""
    todo = {id(r.param): r for r in released.values()}.values()
    with torch.no_grad():
        for r in todo:
            r.param.data = torch.empty_strided(r.shape, r.stride, dtype=r.param.dtype, device=r.param.device)
    try:
        yield
    finally:
        with torch.no_grad():
            for r in todo:
                r.param.data = _placeholder(r.param, r.shape)
                r.param.grad = None  # explain's plan runs the other stages' backward too
