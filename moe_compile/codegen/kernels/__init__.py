"""Triton kernels of the partitioned graph, one family per file, each in tutorial shape: the
``@triton.jit`` kernel(s), a launcher that plans the launch (specialisation, config, grid) and runs
it, and a torch reference; ``tests/test_kernels.py`` compares them.

    route_map     per-expert counts/offsets, stable expert order, inverse order, transport dst rows
    permute       gather token rows into expert order
    unpermute     router-weighted combine into token order (deterministic), and its backward
    grouped_gemm  grouped GEMM over expert offsets (+ fused activation prologue / backward epilogue),
                  and the per-expert weight-gradient GEMM
    swiglu        (gated) activations over the valid prefix, forward and backward

Importing this package fixes the process's Triton mode first (interpreter on a machine without a
GPU, unless ``moe_compile`` already chose it): ``@triton.jit`` reads it when the kernel files load.
"""

from ..triton_mode import ensure_mode

ensure_mode()
