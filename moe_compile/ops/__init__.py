"""The ``moe::`` custom ops (torch.library: fake kernels + autograd). Importing this package
registers them; graphs refer to them as ``torch.ops.moe.<name>.default``."""

import torch

from . import context_parallel, experts, index_check, leases, mx, routing, sink_attention, transport  # noqa: F401

ops = torch.ops.moe

# Forward op → its backward mirror (the op autograd inserts for it in the joint graph).
MIRRORS = {
    "router": "router_backward",
    "permute": "permute_backward",
    "dispatch": "dispatch_backward",
    "grouped_ffn": "grouped_ffn_backward",
    "combine": "combine_backward",
    "unpermute": "unpermute_backward",
}


# Namespaces of MoE ops: moe:: (the IR) and the kernel namespaces codegen lowers them to, whose ops keep
# the moe:: op's name and schema (moe_triton::permute is still a "permute" node to passes and tools).
MOE_NAMESPACES = ("moe", "moe_triton")


def op_name(target: object) -> str | None:
    """'dispatch' for torch.ops.moe.dispatch(.default) (or its lowered twin), None for anything else."""
    name = getattr(target, "_name", None) or getattr(target, "_qualified_op_name", None)
    if isinstance(name, str) and "::" in name:
        ns, rest = name.split("::", 1)
        if ns in MOE_NAMESPACES:
            return rest.split(".")[0]
    return None


def op_namespace(target: object) -> str | None:
    """'moe' or 'moe_triton' for a MoE op, None for anything else."""
    name = getattr(target, "_name", None) or getattr(target, "_qualified_op_name", None)
    return name.split("::", 1)[0] if op_name(target) is not None else None
