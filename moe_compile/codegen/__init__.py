"""Codegen: lowers the partitioned graph's MoE ops to kernels.

``codegen="torch"`` (the CPU default) keeps each ``moe::`` op on its torch implementation (grouped
mm, index ops, torch.distributed transport). ``codegen="triton"`` (the GPU default; on CPU tensors it
runs under the Triton interpreter) swaps the expert-side ops for ``moe_triton::`` twins that launch
generated, shape-specialised Triton kernels (``kernels/``): see ``lowering.py`` and
``lowering_table.py``. Kernel modules are imported lazily, once ``triton_mode`` fixed the mode.
"""

from .lowering import lower

__all__ = ["lower"]
