"""Lease ops that lowering places in the executable graphs (symmetric transport only):

    moe::lease_activate(ctx, plan, phase, saved)
                                            first node of a graph: the lease plan its payloads belong to;
                                            a forward (phase 0) claims a free instance of the plan's lease
                                            slots, a backward (phase 1) finds its forward's instance from
                                            the saved payloads among ``saved``
    moe::lease_check(ctx, payload, like)    before every reader: the lease is live, its slot unchanged
    moe::lease_release(ctx, payload, like)  after the last reader: the slot may be reused

Producers acquire their payloads inside the transport ops (the writer knows when it writes).
``like`` (and ``saved``) are tensors of the graph: the ops dispatch on their device, so on meta
tensors (planning runs, where the transport ops run their fake kernels too) they do nothing.
"""

from __future__ import annotations

import torch

from ..runtime import get_context


def _leases(ctx: int):
    return get_context(ctx).leases


@torch.library.custom_op("moe::lease_activate", mutates_args=())
def lease_activate(ctx: int, plan: int, phase: int, saved: list[torch.Tensor]) -> None:
    _leases(ctx).activate(plan, phase, saved)


@torch.library.custom_op("moe::lease_check", mutates_args=())
def lease_check(ctx: int, payload: str, like: torch.Tensor) -> None:
    _leases(ctx).check(payload)


@torch.library.custom_op("moe::lease_release", mutates_args=())
def lease_release(ctx: int, payload: str, like: torch.Tensor) -> None:
    _leases(ctx).release(payload)


for _op in (lease_activate, lease_check, lease_release):
    _op.register_fake(lambda *a: None)
