"""Host shared-memory symmetric heap for CPU ranks on one host.

Each member creates one POSIX shared-memory segment per allocation (/dev/shm/<prefix>_<alloc>_<rank>)
and maps every peer's segment, so puts and gets are plain memory writes and reads into a peer's
pages. Names are unlinked as soon as every member has mapped them (the mappings stay valid), so a
rank that crashes later leaves nothing in /dev/shm; ``cleanup_prefix`` removes what a crash during an
allocation can leave. The signal between ranks is a shared epoch array (one writer per entry).
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...errors import RuntimeFault
from . import futex
from .base import SymmetricBuffer, SymmetricHeap

SHM_DIR = "/dev/shm"
PREFIX = "moe_compile"


BARRIER_TIMEOUT_S = 600.0  # a peer that never reaches the barrier (crashed, hung) fails it after this


def job_prefix(job: str | None = None) -> str:
    """Per-job name prefix: the launcher exports MOE_COMPILE_JOB so it can clean up after crashes."""
    return f"{PREFIX}_{job or os.environ.get('MOE_COMPILE_JOB', 'nojob')}"


def cleanup_prefix(prefix: str) -> list[str]:
    """Remove leftover segments whose names start with ``prefix``; returns what was removed."""
    removed = []
    if os.path.isdir(SHM_DIR):
        for f in os.listdir(SHM_DIR):
            if f.startswith(prefix):
                try:
                    os.unlink(os.path.join(SHM_DIR, f))
                    removed.append(f)
                except FileNotFoundError:
                    pass
    return removed


def shm_signals_supported() -> bool:
    """Whether ranks may signal through flags in shared memory: x86-64 stores become visible in program
    order (TSO), so data written before a flag is visible to a peer that sees the flag."""
    return platform.machine() in ("x86_64", "AMD64")


def spin_until(ready: Callable[[], bool], late: Callable[[], str], timeout_s: float | None = None,
               park: Callable[[], None] | None = None) -> None:
    """Poll ``ready()`` until it holds; after a short spin, sleep in ``park()`` (a futex wait on a flag
    not yet raised, see park_on) or, without one, yield the core between polls (ranks may outnumber
    cores); after ``timeout_s`` raise a RuntimeFault that starts with ``late()`` (who did not arrive)."""
    timeout_s = BARRIER_TIMEOUT_S if timeout_s is None else timeout_s
    spins, deadline = 0, None
    while not ready():
        spins += 1
        if spins > 64:
            if park is not None:
                park()  # may sleep up to PARK_S: the deadline is checked after every one
            else:
                time.sleep(0 if spins < 2000 else 1e-5)  # yield: ranks may outnumber cores
        if spins % 4096 == 0 or (park is not None and spins > 64):
            deadline = deadline or time.monotonic() + timeout_s
            if time.monotonic() > deadline:
                raise RuntimeFault(f"{late()} did not arrive within {timeout_s:.0f} s")


PARK_S = 0.05  # longest futex sleep before re-checking: bounds a wake that never comes (a crashed peer)


def park_on(flags: list[tuple[torch.Tensor, int]], target: int) -> Callable[[], None] | None:
    """A ``park`` for spin_until over int64 flags ``t[i]`` that their writers raise with raise_flag: sleep
    on the first flag still below ``target`` until it changes. None where futexes are unavailable."""
    if not futex.available():
        return None
    words = [(t, i, futex.word(t, i)) for t, i in flags]

    def park() -> None:
        for t, i, addr in words:
            v = int(t[i])
            if v < target:
                futex.wait(addr, v, PARK_S)
                return

    return park


def raise_flag(flags: torch.Tensor, i: int, value: int) -> None:
    """``flags[i] = value`` (after the data it announces: x86-64 keeps stores in order), then wake the
    peers sleeping on it."""
    flags[i] = value
    if futex.available():
        futex.wake(futex.word(flags, i))


def _map(path: str, nbytes: int, create: bool, what: str = "") -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, max(nbytes, 1))
        elif (have := os.fstat(fd).st_size) < max(nbytes, 1):  # the peer allocated another shape
            raise RuntimeFault(f"{what}: this rank allocates {nbytes} bytes but a peer's segment {path} has "
                               f"{have}; every member must allocate the same shape, in the same order")
        return mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)


class HostShmHeap(SymmetricHeap):
    name = "host_shm"

    def __init__(self, group: dist.ProcessGroup) -> None:
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"host shared-memory symmetric heap needs {SHM_DIR}, which this system lacks")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, group_src=0, group=group)
        self.prefix = f"{job_prefix()}_{token[0]}"
        self._maps: dict[int, list[mmap.mmap]] = {}  # allocation number → every member's mapping
        self._closed = False
        self._count = 0
        self._bytes = 0
        self._epoch = 0
        # x86-64 stores become visible in program order (TSO): data written before the flag is
        # visible to a peer that sees the flag. Elsewhere fall back to the process group's barrier.
        self._shm_signal = shm_signals_supported()
        self._flags = self.alloc("signal", (self.size,), torch.int64).views[0] if self._shm_signal else None

    def alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SymmetricBuffer:
        if self._closed:
            raise RuntimeFault(f"host shared-memory heap {self.prefix}: alloc({name!r}) after close()")
        n = self._count
        self._count += 1
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        paths = [os.path.join(SHM_DIR, f"{self.prefix}_{n}_{p}") for p in range(self.size)]
        mine = _map(paths[self.rank], nbytes, create=True)
        try:
            dist.barrier(group=self.group)  # every segment exists
            what = f"host shared-memory allocation {name!r} {tuple(shape)} {dtype}, member {self.rank} of {self.size}"
            maps, bad = [], None
            for p in range(self.size):
                try:
                    maps.append(mine if p == self.rank else _map(paths[p], nbytes, create=False, what=what))
                except RuntimeFault as e:  # a shape mismatch: every member must hear of it before anyone unlinks
                    bad = bad or e
            flag = torch.tensor([int(bad is not None)])
            dist.all_reduce(flag, group=self.group)  # also the barrier: every member mapped every segment
        finally:
            os.unlink(paths[self.rank])  # the name can go (mappings keep the memory alive), also on failure
        if bad is not None:
            raise bad
        if int(flag):
            raise RuntimeFault(f"{what}: another member's segment has another size (that member names both); every "
                               "member must allocate the same shape, in the same order")
        self._maps[n] = maps
        self._bytes += nbytes
        views = [torch.frombuffer(m, dtype=torch.uint8, count=nbytes).view(dtype).view(shape) if nbytes
                 else torch.zeros(shape, dtype=dtype) for m in maps]
        # no zero_() here: a new segment is zero-filled (O_EXCL + ftruncate), and a peer that left the
        # barrier first may already be writing into it
        return SymmetricBuffer(name, tuple(shape), dtype, views, self.rank, key=n)

    def free(self, buf: SymmetricBuffer) -> None:
        """Drop this rank's mappings of one allocation (local, not collective: the memory goes when the
        last member's mappings and views of it are gone; the names were unlinked at alloc). ``buf`` is
        unusable afterwards."""
        if self._maps.pop(buf.key, None) is not None:
            self._bytes -= buf.nbytes
        buf.views = []

    def barrier(self) -> None:
        if self._closed:
            raise RuntimeFault(f"host shared-memory heap {self.prefix}: barrier() after close()")
        if not self._shm_signal:
            dist.barrier(group=self.group)
            return
        self._epoch += 1
        flags, epoch = self._flags, self._epoch
        raise_flag(flags, self.rank, epoch)
        spin_until(lambda: int(flags.min()) >= epoch,
                   lambda: f"host shared-memory barrier {epoch} of {self.prefix}: EP-group ranks "
                           f"{[r for r in range(self.size) if int(flags[r]) < epoch]}",
                   park=park_on([(flags, r) for r in range(self.size)], epoch))

    @property
    def allocated_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        self._closed = True
        self._maps.clear()  # views hold the buffers; the OS unmaps when the last reference goes
        self._flags, self._bytes = None, 0
