"""NVSHMEM symmetric heap for GPUs, through nvshmem4py (imported lazily).

NVSHMEM is initialised with the EP group as its team of PEs (unique id broadcast over the EP process
group), so every allocation is collective over the EP group only. Peer buffers are NVLink-mapped
tensors (``get_peer_tensor``): puts and gets are device memory writes and reads into a peer's buffer.
This backend needs a CUDA device with NVSHMEM; it cannot run on this project's CPU CI.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import RuntimeFault
from .base import SymmetricBuffer, SymmetricHeap


def _nvshmem():
    if not torch.cuda.is_available():
        raise RuntimeFault("the NVSHMEM symmetric heap needs a CUDA device; this process has none "
                           "(use transport='all_to_all', or the host shared-memory heap on CPU ranks)")
    try:
        import nvshmem.core as nvc
        from cuda.core import Device
        from nvshmem.core.interop import torch as nvt
    except ImportError as e:
        raise RuntimeFault(f"the NVSHMEM symmetric heap needs nvshmem4py (pip install nvshmem4py-cu12): {e}") from e
    return nvc, nvt, Device


class NvshmemHeap(SymmetricHeap):
    name = "nvshmem"

    def __init__(self, group: dist.ProcessGroup) -> None:
        nvc, nvt, Device = _nvshmem()
        self._nvc, self._nvt = nvc, nvt
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        uid = [nvc.get_unique_id() if self.rank == 0 else None]
        dist.broadcast_object_list(uid, group_src=0, group=group)
        dev = Device(torch.cuda.current_device())
        dev.set_current()
        nvc.init(device=dev, uid=uid[0], rank=self.rank, nranks=self.size, initializer_method="uid")
        self._tensors: list[torch.Tensor] = []
        self._bytes = 0

    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricBuffer:
        t = self._nvt.tensor(tuple(shape), dtype=dtype)  # collective over the PEs (= the EP group)
        t.zero_()
        views = [t if p == self.rank else self._nvt.get_peer_tensor(t, p) for p in range(self.size)]
        self._tensors.append(t)
        self._bytes += t.numel() * t.element_size()
        return SymmetricBuffer(name, tuple(shape), dtype, views, self.rank)

    def barrier(self) -> None:
        torch.cuda.current_stream().synchronize()
        self._nvc.barrier_all(stream=None)

    @property
    def allocated_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        for t in self._tensors:
            self._nvt.free_tensor(t)
        self._tensors.clear()
        self._nvc.finalize()
