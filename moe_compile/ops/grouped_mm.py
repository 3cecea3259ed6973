"""Grouped matrix multiply over expert offsets (the torch path of the expert GEMMs).

Two shapes, as in ``torch.nn.functional.grouped_mm``:

* ``a [M, K] , b [G, K, N]`` → ``[M, N]``: rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]``;
* ``a [K, M] , b [M, N]`` → ``[G, K, N]``: weight gradients, groups along the shared M dimension.

``F.grouped_mm`` needs 16-byte aligned strides; other shapes take a per-group loop of ``mm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _aligned(t: torch.Tensor) -> bool:
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or (s * es) % 16 == 0 for s in t.stride())


def grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM with per-group row counts ``counts [G]`` (sum = the grouped dimension)."""
    if _aligned(a) and _aligned(b):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return F.grouped_mm(a, b, offs=offs)
    sizes = counts.tolist()
    if b.dim() == 3:  # a [M, K] · b[g] [K, N]
        parts = [ai @ b[g] for g, ai in enumerate(a.split(sizes, 0))]
        return torch.cat(parts, 0) if parts else a.new_zeros(0, b.shape[-1])
    # a [K, M], b [M, N] → out[g] = a[:, rows_g] @ b[rows_g]
    return torch.stack([ai @ bi for ai, bi in zip(a.split(sizes, 1), b.split(sizes, 0))])
