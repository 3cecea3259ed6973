"""The lowering table: which moe:: op runs on which Triton-backed op (codegen="triton").

    TRITON_LOWERINGS[moe op name] = TritonLowering(op="moe_triton::<name>", plan=<launches of the op>)

An op missing from the table keeps its torch kernel (the router's few small ops; the transport ops,
which move rows through the runtime's transport). Adding a kernel for a new op is one entry: register
a ``moe_triton::`` op with the moe:: op's schema and fake kernel, then call
:func:`register_triton_lowering` — as ``triton_ops`` does for each of its ops, e.g. the MXFP8 quantise:

    register_triton_lowering("quantize_mx", "moe_triton::quantize_mx", plan_quantize_mx)

This module imports no kernels; the moe_triton:: ops (``triton_ops``) fill the table when lowering
first needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TritonLowering:
    op: str  # qualified name of the Triton-backed op, e.g. "moe_triton::permute"
    plan: Callable[..., list]  # (the node's arguments, fake) → [LaunchPlan] of the kernels it launches

    @property
    def target(self) -> torch._ops.OpOverload:
        ns, name = self.op.split("::")
        return getattr(getattr(torch.ops, ns), name).default


TRITON_LOWERINGS: dict[str, TritonLowering] = {}


def register_triton_lowering(moe_op: str, triton_op: str, plan: Callable[..., list]) -> None:
    """Lower every ``moe::<moe_op>`` node to ``triton_op`` (same schema) under codegen="triton"."""
    TRITON_LOWERINGS[moe_op] = TritonLowering(triton_op, plan)


def triton_lowerings() -> dict[str, TritonLowering]:
    from . import triton_ops  # noqa: F401  (registers the moe_triton:: ops and their table entries)

    return TRITON_LOWERINGS
