"""The ``moe::`` custom ops (torch.library: fake kernels + autograd). Importing this package
registers them; graphs refer to them as ``torch.ops.moe.<name>.default``."""

import torch

from . import experts, leases, mx, routing, transport  # noqa: F401  (registration)

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


def op_name(target: object) -> str | None:
    """'dispatch' for torch.ops.moe.dispatch(.default), None for anything else."""
    name = getattr(target, "_name", None) or getattr(target, "_qualified_op_name", None)
    if isinstance(name, str) and name.startswith("moe::"):
        return name[len("moe::"):].split(".")[0]
    return None
