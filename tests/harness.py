"""Multi-rank test harness: spawned CPU ranks over gloo/loopback (see moe_compile.runtime.launcher).

``run_ranks(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` fresh processes with a
FileStore in a temporary directory, timeouts, a barrier before teardown, and the failing rank's own
traceback first. ``fn`` must be a module-level function (it is pickled by name). A run that succeeds
must leave no shared-memory segment for the launcher to remove: the runtime frees its own (a failed
run's removals are in ``RankFailure.cleaned``).
"""

from __future__ import annotations

from typing import Any

from moe_compile.runtime.launcher import RankFailure, spawn_ranks

__all__ = ["RankFailure", "run_ranks"]


def run_ranks(fn, world: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    cleaned: list[str] = []
    out = spawn_ranks(fn, world, *args, timeout=timeout, env={"OMP_NUM_THREADS": "1"}, cleaned=cleaned)
    assert not cleaned, (f"{fn.__name__}: the ranks left shared-memory segments that the launcher had to remove "
                         f"(the runtime must free its own): {cleaned}")
    return out
