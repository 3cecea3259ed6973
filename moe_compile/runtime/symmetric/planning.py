"""A symmetric heap for planning runs (``moe-compile explain`` on a fake process group): every
allocation is a meta tensor, so lease pools, slots and high-water are computed exactly while no
memory is touched and no peer exists to map."""

from __future__ import annotations

import torch

from .base import SymmetricBuffer, SymmetricHeap


class PlanningHeap(SymmetricHeap):
    name = "planning"

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._bytes = 0

    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricBuffer:
        views = [torch.empty(shape, dtype=dtype, device="meta") for _ in range(self.size)]
        self._bytes += views[0].numel() * views[0].element_size()
        return SymmetricBuffer(name, tuple(shape), dtype, views, self.rank)

    def barrier(self) -> None:
        pass

    @property
    def allocated_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        pass
