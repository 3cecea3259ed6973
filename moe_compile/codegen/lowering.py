"""Lowering: choose the kernel for every MoE node of the forward and backward graphs."""

from __future__ import annotations

import torch.fx as fx

from ..errors import OptionError
from ..passes.base import PassContext


def resolve_codegen(requested: str) -> str:
    if requested in ("auto", "torch"):
        return "torch"
    raise OptionError(f"codegen={requested!r} is not available")


def lower(gm: fx.GraphModule, ctx: PassContext, kind: str) -> fx.GraphModule:
    """Torch codegen runs each moe:: op's own torch kernel: nothing to rewrite."""
    resolve_codegen(ctx.program.options.codegen)
    gm.meta["moe_codegen"] = "torch"
    return gm
