"""Lease ops that lowering places in the executable graphs (symmetric transport only):

    moe::lease_activate(ctx, plan, like)    first node of a graph: the lease plan its payloads belong to
    moe::lease_check(ctx, payload, like)    before every reader: the lease is live, its slot unchanged
    moe::lease_release(ctx, payload, like)  after the last reader: the slot may be reused

Producers acquire their payloads inside the transport ops (the writer knows when it writes).
``like`` is a tensor of the graph (the reader's input): the ops dispatch on its device, so on meta
tensors (planning runs, where the transport ops run their fake kernels too) they do nothing.
"""

from __future__ import annotations

import torch

from ..runtime import get_context


def _leases(ctx: int):
    return get_context(ctx).leases


@torch.library.custom_op("moe::lease_activate", mutates_args=())
def lease_activate(ctx: int, plan: int, like: torch.Tensor) -> None:
    _leases(ctx).activate(plan)


@torch.library.custom_op("moe::lease_check", mutates_args=())
def lease_check(ctx: int, payload: str, like: torch.Tensor) -> None:
    _leases(ctx).check(payload)


@torch.library.custom_op("moe::lease_release", mutates_args=())
def lease_release(ctx: int, payload: str, like: torch.Tensor) -> None:
    _leases(ctx).release(payload)


for _op in (lease_activate, lease_check, lease_release):
    _op.register_fake(lambda *a: None)
