"""Symmetric heaps: host shared memory (CPU ranks on one host) and NVSHMEM (GPUs)."""

from __future__ import annotations

import torch.distributed as dist

from .base import SymmetricBuffer, SymmetricHeap
from .host import HostShmHeap, cleanup_prefix, job_prefix


def make_heap(group: dist.ProcessGroup, device_type: str) -> SymmetricHeap:
    """The symmetric heap for an EP group of ranks on ``device_type`` (collective over the group); a
    fake process group (planning without ranks) gets a heap of meta tensors."""
    if dist.get_backend(group) == "fake":
        from .planning import PlanningHeap

        return PlanningHeap(dist.get_rank(group), dist.get_world_size(group))
    if device_type == "cuda":
        from .nvshmem import NvshmemHeap

        return NvshmemHeap(group)
    return HostShmHeap(group)


__all__ = ["HostShmHeap", "SymmetricBuffer", "SymmetricHeap", "cleanup_prefix", "job_prefix", "make_heap"]
