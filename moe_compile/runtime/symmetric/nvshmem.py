"""NVSHMEM symmetric heap for GPUs, through nvshmem4py (imported lazily, on first use).

NVSHMEM is initialised with the EP group as its team of PEs (unique id broadcast over the EP process
group), so every allocation is collective over the EP group only. Peer buffers are NVLink-mapped
tensors (``get_peer_tensor``): puts and gets are device memory writes and reads into a peer's buffer.
This backend needs a CUDA device with NVSHMEM; it cannot run on this project's CPU CI (the tests
there drive it with a fake nvshmem module; ``benchmarks/gpu_check.py`` runs it on a GPU).

One NVSHMEM runtime per process, reference-counted: the first heap that needs it initialises it
(sized as below), later heaps of the same EP group (two compiled models in one process) share it,
and ``finalize`` runs when the last heap closes. A heap joins the runtime lazily — at its first
``reserve`` or ``alloc``, both collective over the EP group — so the symmetric heap can be sized from
the lease plan's bytes before NVSHMEM reads its environment:

    NVSHMEM_SYMMETRIC_SIZE   set by the user: kept, and every reserve/alloc is checked against it
                             unset: set here to max(1 GiB, needed + needed/8 + 64 MiB) before init,
                             needed = what the first ``reserve`` announced (else the first alloc)

The symmetric size cannot grow after init: a later plan or model that needs more than the size in
force fails with a RuntimeFault naming the bytes needed and the bytes available (set
NVSHMEM_SYMMETRIC_SIZE before the first compile to fix it).

nvshmem4py API used (0.1 – 0.4): ``get_unique_id``, ``init(device=, uid=, rank=, nranks=,
initializer_method="uid")``, ``finalize``, ``barrier_all(stream)`` — the stream must implement the
CUDA stream protocol (``__cuda_stream__``; None is rejected), so torch's current stream is wrapped
in ``nvshmem.core.NvshmemStream`` —, and ``nvshmem.core.interop.torch``'s ``tensor``,
``get_peer_tensor``, ``free_tensor`` (collective). ``cuda.core``'s ``Device`` lives in
``cuda.core`` in current cuda-python and in ``cuda.core.experimental`` in older releases.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

from ...errors import RuntimeFault
from .base import SymmetricBuffer, SymmetricHeap

SIZE_ENV = "NVSHMEM_SYMMETRIC_SIZE"
DEFAULT_SYMMETRIC_SIZE = 1 << 30  # NVSHMEM's own default when NVSHMEM_SYMMETRIC_SIZE is unset
MIN_HEADROOM = 64 << 20  # NVSHMEM's internal symmetric allocations and allocation alignment
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of an NVSHMEM size variable: a number with an optional k/m/g/t suffix (powers of 1024,
    case-insensitive; "1.5G" is allowed), rounded up as NVSHMEM does."""
    s = text.strip().lower().removesuffix("b")
    unit = s[-1:] if s[-1:] in _UNITS and s[-1:] else ""
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise RuntimeFault(f"{SIZE_ENV}={text!r} is not a size (a number with an optional K/M/G/T suffix)") from None
    return int(-(-value * _UNITS[unit] // 1))


def heap_size_for(needed: int) -> int:
    """The symmetric size this module sets when the user did not: the bytes needed plus headroom."""
    return max(DEFAULT_SYMMETRIC_SIZE, needed + needed // 8 + MIN_HEADROOM)


# -- lazy imports (monkeypatched in the CPU tests) ------------------------------------------------


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream():
    return torch.cuda.current_stream()


def cuda_core_device():
    """cuda.core's Device class: ``cuda.core`` (cuda-python ≥ 13 / cuda-core ≥ 0.4) or
    ``cuda.core.experimental`` (older releases, and the nvshmem4py versions built against them)."""
    try:
        from cuda.core import Device
    except ImportError as first:
        try:
            from cuda.core.experimental import Device
        except ImportError as second:
            raise ImportError(f"neither cuda.core ({first}) nor cuda.core.experimental ({second}) provides "
                              "Device") from second
    return Device


def _nvshmem():
    """(nvshmem.core, nvshmem.core.interop.torch, cuda.core Device), imported on first use."""
    if not _cuda_available():
        raise RuntimeFault("the NVSHMEM symmetric heap needs a CUDA device; this process has none "
                           "(use transport='all_to_all', or the host shared-memory heap on CPU ranks)")
    try:
        import nvshmem.core as nvc
        from nvshmem.core.interop import torch as nvt
    except ImportError as e:
        raise RuntimeFault(f"the NVSHMEM symmetric heap needs nvshmem4py (pip install nvshmem4py-cu12): {e}") from e
    try:
        device = cuda_core_device()
    except ImportError as e:
        raise RuntimeFault(f"the NVSHMEM symmetric heap needs cuda-python's cuda.core (pip install cuda-core): {e}") from e
    return nvc, nvt, device


class _TorchStream:
    """CUDA stream protocol over a torch stream (for nvshmem4py releases without NvshmemStream)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __cuda_stream__(self):
        return (0, int(self.stream.cuda_stream))


def nvshmem_stream(nvc, stream=None):
    """torch's current CUDA stream (or ``stream``) as the stream object nvshmem4py's on-stream calls
    take: ``barrier_all(stream=None)`` raises NvshmemInvalid ("Stream may not be None")."""
    stream = _current_stream() if stream is None else stream
    wrap = getattr(nvc, "NvshmemStream", None)
    return wrap(stream) if wrap is not None else _TorchStream(stream)


# -- one NVSHMEM runtime per process, reference-counted ---------------------------------------------


class _Runtime:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs = 0  # heaps joined
        self.team: tuple[int, ...] | None = None  # global ranks of the PEs (the EP group)
        self.size = 0  # symmetric heap bytes in force
        self.allocated = 0  # bytes allocated by every heap of this process
        self.set_env: str | None = None  # the NVSHMEM_SYMMETRIC_SIZE value this module set, if it did
        self.nvc = None
        self.inits = 0  # NVSHMEM init calls in this process (inspection)
        self.finalizes = 0

    def available(self) -> int:
        return self.size - self.allocated


RUNTIME = _Runtime()


def _needs(what: str, nbytes: int, size: int, allocated: int, preset: bool) -> RuntimeFault:
    how = (f"{SIZE_ENV} is set to {size} bytes" if preset else
           f"this process initialised NVSHMEM with {SIZE_ENV}={size} bytes")
    return RuntimeFault(
        f"NVSHMEM symmetric heap: {what} needs {nbytes} bytes, but only {size - allocated} bytes are available "
        f"({how}, {allocated} already allocated; it cannot grow after init). Set {SIZE_ENV} to at least "
        f"{heap_size_for(allocated + nbytes)} bytes before the first compile.")


class NvshmemHeap(SymmetricHeap):
    name = "nvshmem"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._nvc, self._nvt, self._device = _nvshmem()  # fail here, at compile time, without a GPU
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._team = tuple(dist.get_process_group_ranks(group))
        self._tensors: list[torch.Tensor] = []
        self._bytes = 0
        self._joined = False
        self._closed = False

    # -- the process's NVSHMEM runtime ---------------------------------------------------------
    def _join(self, needed: int, what: str) -> None:
        """Join (or start) the process's NVSHMEM runtime; collective over the EP group."""
        if self._closed:
            raise RuntimeFault("NVSHMEM symmetric heap used after close()")
        if self._joined:
            return
        rt = RUNTIME
        with rt.lock:
            if rt.refs:
                if rt.team != self._team:
                    raise RuntimeFault(
                        f"NVSHMEM is initialised once per process, here with the EP group of global ranks "
                        f"{list(rt.team or ())}; this heap's EP group has ranks {list(self._team)}. One process "
                        "can serve symmetric heaps of one EP group only (use transport='all_to_all' for the other)")
                rt.refs += 1
                self._joined = True
                return
            preset = os.environ.get(SIZE_ENV)
            if preset is not None:
                size = parse_size(preset)
                if needed > size:
                    raise _needs(what, needed, size, 0, True)
            else:
                size = heap_size_for(needed)
                rt.set_env = str(size)
                os.environ[SIZE_ENV] = rt.set_env  # read by NVSHMEM at init
            nvc = self._nvc
            uid = [nvc.get_unique_id() if self.rank == 0 else None]
            dist.broadcast_object_list(uid, group_src=0, group=self.group)
            dev = self._device(_current_device())
            dev.set_current()
            nvc.init(device=dev, uid=uid[0], rank=self.rank, nranks=self.size, initializer_method="uid")
            rt.refs, rt.team, rt.size, rt.allocated, rt.nvc = 1, self._team, size, 0, nvc
            rt.inits += 1
            self._joined = True

    def _leave(self) -> None:
        rt = RUNTIME
        with rt.lock:
            rt.refs -= 1
            if rt.refs:
                return
            try:
                rt.nvc.finalize()
            finally:
                rt.finalizes += 1
                if rt.set_env is not None and os.environ.get(SIZE_ENV) == rt.set_env:
                    del os.environ[SIZE_ENV]  # a later init sizes itself afresh
                rt.team, rt.size, rt.allocated, rt.nvc, rt.set_env = None, 0, 0, None, None

    # -- SymmetricHeap ----------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Before a lease plan's pools are allocated (collective): size NVSHMEM for them if it is not
        initialised yet, else check they fit in what is left."""
        what = "a lease plan's pools"
        if not self._joined:
            self._join(nbytes, what)
        if nbytes > RUNTIME.available():
            raise _needs(what, nbytes, RUNTIME.size, RUNTIME.allocated, RUNTIME.set_env is None)

    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricBuffer:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        what = f"allocation {name!r} {tuple(shape)} {dtype}"
        self._join(nbytes, what)
        if nbytes > RUNTIME.available():
            raise _needs(what, nbytes, RUNTIME.size, RUNTIME.allocated, RUNTIME.set_env is None)
        if not nbytes:  # nvshmem_malloc(0) gives no buffer: an empty tensor needs no memory
            t = torch.empty(shape, dtype=dtype, device=f"cuda:{_current_device()}")
            return SymmetricBuffer(name, tuple(shape), dtype, [t] * self.size, self.rank)
        t = self._nvt.tensor(tuple(shape), dtype=dtype)  # collective over the PEs (= the EP group)
        t.zero_()
        views = [t if p == self.rank else self._nvt.get_peer_tensor(t, p) for p in range(self.size)]
        self._tensors.append(t)
        self._bytes += nbytes
        RUNTIME.allocated += nbytes
        return SymmetricBuffer(name, tuple(shape), dtype, views, self.rank)

    def barrier(self) -> None:
        # Host sync first (conservative: every copy this rank enqueued has run), then the NVSHMEM
        # barrier on torch's current stream, which later copies on that stream are ordered after.
        _current_stream().synchronize()
        self._nvc.barrier_all(stream=nvshmem_stream(self._nvc))

    @property
    def allocated_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        """Free this heap's tensors (collective) and leave the runtime; the last heap finalizes it."""
        if self._closed:
            return
        self._closed = True
        if not self._joined:
            return
        try:
            if self._tensors:
                _current_stream().synchronize()  # no kernel still reads or writes them
            for t in self._tensors:
                self._nvt.free_tensor(t)
        finally:
            RUNTIME.allocated -= self._bytes
            self._tensors.clear()
            self._bytes = 0
            self._leave()
