"""Sleeping waits on shared-memory flags: Linux futexes on the flag words themselves.

Why: the host heap's ranks signal through int64 flags in shared segments (host.py), and a waiter used to
poll them, yielding or napping between polls. When ranks outnumber cores (4 CPU ranks on 2 cores) a
poller takes time slices from the very rank it waits for; measured on 2 cores, 4 ranks: the gradient
reduction's exposed time was 10–23 ms of a 150 ms step polling, against 3–7 ms with 1 ms naps (which add
a millisecond of latency instead). A futex wait sleeps in the kernel until the flag's writer wakes it:
no CPU taken, and the wake-up comes as soon as the flag is written.

    waiter   v ← flag (low 32 bits);  if not ready(v): futex(FUTEX_WAIT, &flag, v, timeout)
             (returns at once if the flag no longer holds v, so a write between the read and the
             wait is never missed)
    writer   flag ← new value;  futex(FUTEX_WAKE, &flag, all)

The flags are shared file mappings, so the futexes are process-shared (no FUTEX_PRIVATE_FLAG). x86-64 is
little-endian: the futex word is the int64 flag's low half, which is where the flag changes. Waits are
bounded (``timeout_s``), and the caller re-checks its condition and its own deadline after each, so a wake
that never comes (a crashed peer) costs at most one timeout, never a hang. Elsewhere than Linux x86-64
``available()`` is False and callers poll as before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

import torch

_SYS_FUTEX = 202  # x86-64 syscall number
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load():
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if os.environ.get("MOE_COMPILE_NO_FUTEX"):  # poll instead (benchmarks compare the two)
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load()


def available() -> bool:
    return _syscall is not None


def word(flags: torch.Tensor, index: int) -> int:
    """The address of int64 flag ``flags[index]`` (a view of a shared mapping) as a futex word."""
    if flags.dtype != torch.int64 or not flags.is_contiguous():
        raise ValueError(f"futex word: needs a contiguous int64 flag tensor, got {flags.dtype}")
    return flags.data_ptr() + 8 * index


def wait(addr: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``addr`` still holds ``seen`` (its low half), at most ``timeout_s``;
    spurious returns are allowed: the caller re-checks."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    r = _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAIT),
                 ctypes.c_long(seen & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_long(0))
    if r == -1 and ctypes.get_errno() not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
        raise OSError(ctypes.get_errno(), f"futex wait: {os.strerror(ctypes.get_errno())}")


def wake(addr: int) -> None:
    """Wake every process sleeping on the word at ``addr`` (none: a cheap no-op syscall)."""
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAKE),
             ctypes.c_long(_WAKE_ALL), None, None, ctypes.c_long(0))
