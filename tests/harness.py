"""Multi-rank test harness: spawned CPU ranks over gloo/loopback (see moe_compile.runtime.launcher).

``run_ranks(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh processes with a
FileStore in a temporary directory, timeouts, a barrier before teardown, and the failing rank's own
traceback first. ``fn`` must be a module-level function (it is pickled by name).
"""

from __future__ import annotations

from typing import Any

from moe_compile.runtime.launcher import RankFailure, spawn_ranks

__all__ = ["RankFailure", "run_ranks"]


def run_ranks(fn, world: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    return spawn_ranks(fn, world, *args, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
