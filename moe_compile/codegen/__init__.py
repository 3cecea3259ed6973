"""Codegen: lowers the partitioned graph's MoE ops to kernels.

``codegen="torch"`` (the CPU default) keeps each ``moe::`` op on its torch implementation
(grouped mm, index ops, torch.distributed transport); GPU kernels come as their own lowering.
"""

from .lowering import lower

__all__ = ["lower"]
