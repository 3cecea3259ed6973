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


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` as the valid prefix of a ``rows``-row buffer (no copy if it is full; the rest unspecified)."""
    if t.shape[0] == rows:
        return t
    out = t.new_empty((rows,) + tuple(t.shape[1:]))
    out[: t.shape[0]].copy_(t)
    return out


# -- the expert FFN's GEMMs as ops of their own (what dense fusion splits moe::grouped_ffn into) ---------


@torch.library.custom_op("moe::expert_mm", mutates_args=())
def expert_mm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows [0, Σcounts) of ``a [cap, K]``, in expert order, each times its expert's ``b[e] [K, N]``:
    [cap, N], rows past the valid prefix unspecified (as in moe::grouped_ffn's outputs)."""
    valid = int(counts.sum())
    if not valid:
        return a.new_empty(a.shape[0], b.shape[-1])
    return pad_rows(grouped_mm(a[:valid], b, counts), a.shape[0])


@expert_mm.register_fake
def _(a, b, counts):
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("moe::expert_mm_weight_grad", mutates_args=())
def expert_mm_weight_grad(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per expert e, Σ over its rows r of a[r]ᵀ·b[r], for ``a [cap, M]``, ``b [cap, N]`` → [L, M, N] (the
    weight gradient of an expert GEMM; rows past the valid prefix are not read)."""
    valid = int(counts.sum())
    if not valid:
        return a.new_zeros(counts.shape[0], a.shape[1], b.shape[1])
    return grouped_mm(a[:valid].t(), b[:valid], counts)


@expert_mm_weight_grad.register_fake
def _(a, b, counts):
    return a.new_empty(counts.shape[0], a.shape[1], b.shape[1])
