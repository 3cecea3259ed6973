"""Symmetric heap interface: collective allocation over one EP group, one-sided row puts and gets.

Glossary: *symmetric memory* is collectively established storage that the ranks of one team can
address through one-sided operations. Every allocation has the same shape on every member; rank r
reads and writes a peer's buffer directly (``peer(buf, p)``), with no collective call per transfer.
Ordering between ranks comes from ``barrier()`` (a signal, not a data collective).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class SymmetricBuffer:
    """One collective allocation: this rank's segment and a view of every member's segment."""

    name: str
    shape: tuple[int, ...]  # per member
    dtype: torch.dtype
    views: list[torch.Tensor]  # views[p]: member p's segment, addressable from this rank
    rank: int
    key: int = -1  # the allocation's number in its heap (heaps that free single buffers)

    @property
    def local(self) -> torch.Tensor:
        return self.views[self.rank]

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()


class SymmetricHeap(ABC):
    """Collective allocation over an EP group; puts and gets of rows into peers' buffers."""

    rank: int  # rank inside the EP group
    size: int  # EP group size
    name: str

    @abstractmethod
    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricBuffer:
        """Collective over the EP group: every member allocates the same shape."""

    def reserve(self, nbytes: int) -> None:
        """Collective: ``nbytes`` are about to be allocated (a lease plan's pools, before the first of
        them). Heaps with a fixed capacity size themselves from it or check it fits (NVSHMEM); heaps
        that map memory per allocation ignore it."""
        return None

    @abstractmethod
    def barrier(self) -> None:
        """All members reach this point; writes before it are visible to every member after it."""

    @abstractmethod
    def close(self) -> None:
        """Release every segment this heap mapped."""

    def peer(self, buf: SymmetricBuffer, p: int) -> torch.Tensor:
        return buf.views[p]

    def put_rows(self, buf: SymmetricBuffer, p: int, rows: torch.Tensor, src: torch.Tensor) -> None:
        """One-sided write: member p's ``buf[rows[i]] = src[i]``."""
        if rows.numel():
            buf.views[p].index_copy_(0, rows, src)

    def get_rows(self, buf: SymmetricBuffer, p: int, rows: torch.Tensor) -> torch.Tensor:
        """One-sided read of member p's ``buf[rows]``."""
        return buf.views[p].index_select(0, rows)

    @property
    def allocated_bytes(self) -> int:
        return 0
