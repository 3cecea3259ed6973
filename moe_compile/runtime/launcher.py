"""Local multi-rank launcher: start N CPU ranks (gloo over loopback) and run a function on each.

Used by ``moe-compile train`` when it is not run under torchrun, and by the test harness. Each rank
gets a FileStore in a fresh temporary directory, a timeout on initialisation and on the whole run,
and a barrier before teardown. When a rank fails, its own traceback is reported first (the other
ranks' errors are usually consequences: a peer that vanished mid-collective).

Shared-memory segments are the runtime's to free (the host heap unlinks every name as soon as all
members mapped it). After the ranks exit the launcher removes whatever the job's prefix still names
(a rank killed mid-allocation) and reports it: into the caller's ``cleaned`` list when one is given
(and ``RankFailure.cleaned``), else as a warning and a line in the file ``$MOE_COMPILE_SHM_CLEANUP_LOG``
names (the test suite fails on such lines). For a normal run the report is empty.
"""

from __future__ import annotations

import io
import os
import queue
import shutil
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .symmetric.host import cleanup_prefix, job_prefix

CLEANUP_LOG_ENV = "MOE_COMPILE_SHM_CLEANUP_LOG"  # a file: one line per segment the launcher had to remove


class RankFailure(RuntimeError):
    """One or more ranks failed; the message starts with the first failing rank's traceback."""

    def __init__(self, failures: list[tuple[int, str]], note: str = "", cleaned: list[str] | None = None) -> None:
        self.failures = failures
        self.cleaned = list(cleaned or [])  # shared-memory segments the launcher removed after the ranks
        first_rank, first_tb = failures[0] if failures else (-1, "")
        parts = [f"rank {first_rank} failed first:\n{first_tb}"] if failures else []
        parts += [f"rank {r} also failed:\n{tb}" for r, tb in failures[1:]]
        if note:
            parts.append(note)
        super().__init__("\n".join(parts))


def _threads(world: int) -> int:
    """Intra-op threads per rank: $OMP_NUM_THREADS where set, else this host's cores shared by the ranks."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) // world)


def _worker(rank: int, world: int, store_dir: str, fn: Callable, args: tuple, q: Any, init_timeout: float,
            env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(rank), str(world), str(rank)
    # Share the cores: oversubscribed OpenMP pools spin against each other and stall every collective.
    # An OMP_NUM_THREADS the caller set wins (the forkserver imported torch before this rank's env arrived).
    torch.set_num_threads(_threads(world))
    try:
        store = dist.FileStore(os.path.join(store_dir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=init_timeout))
        # every rank's gloo mesh is connected before fn runs: a rank that replaces the group at once
        # (destroy + init) would otherwise close sockets a slower peer is still connecting through
        dist.barrier()
        result = fn(rank, world, *args)
        dist.barrier()
        # Serialised by value: tensors sent through a multiprocessing queue refer to this process's
        # shared memory, which is gone once the rank exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        q.put((rank, "ok", buf.getvalue(), time.time()))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        q.put((rank, "err", traceback.format_exc(), time.time()))
        q.close()
        q.join_thread()  # flush the report before leaving
        os._exit(1)  # peers may be stuck in a collective with us; do not wait on them
    dist.destroy_process_group()


def _report_cleanup(job: str, fn: Callable, removed: list[str], cleaned: list[str] | None) -> None:
    if cleaned is not None:
        cleaned.extend(removed)
        return
    if not removed:
        return
    what = getattr(fn, "__qualname__", repr(fn))
    warnings.warn(f"moe_compile launcher: the ranks of job {job} ({what}) left {len(removed)} shared-memory "
                  f"segment(s), removed now: {removed}", RuntimeWarning, stacklevel=3)
    log = os.environ.get(CLEANUP_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write("".join(f"{job} {what} {name}\n" for name in removed))


def _context(start_method: str):
    if start_method == "spawn":
        return mp.get_context("spawn")
    if start_method != "forkserver":
        raise ValueError(f"spawn_ranks: start_method must be 'spawn' or 'forkserver', not {start_method!r}")
    ctx = mp.get_context("forkserver")
    # The server imports torch, dynamo, moe_compile and transformers' model code once (about 3 s and 2 s of
    # CPU per rank otherwise; transformers starts no threads on import) and runs nothing, so every rank
    # forks from a process that holds no threads and no compiled state.
    ctx.set_forkserver_preload(["moe_compile", "transformers.modeling_utils"])
    return ctx


def spawn_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0, init_timeout: float = 120.0,
                env: dict[str, str] | None = None, cleaned: list[str] | None = None,
                start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.
    ``cleaned``: receives the names of the shared-memory segments the launcher had to remove after the
    ranks exited (empty when the runtime freed its own; see the module docstring).
    ``start_method``: "forkserver" (the default: ranks fork from one server per calling process that has
    imported moe_compile, about 3 s of CPU less per rank) or "spawn" (a fresh interpreter per rank). Under
    "forkserver" a rank's environment is the caller's as of the server's start (its first use), updated
    with ``env`` when the rank starts: before ``fn`` runs, after the preloaded imports."""
    ctx = _context(start_method)
    store_dir = tempfile.mkdtemp(prefix="moe_compile_store_")
    env = dict(env or {})
    job = env.setdefault("MOE_COMPILE_JOB", uuid.uuid4().hex[:12])
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store_dir, fn, args, q, init_timeout, env), daemon=False)
        for r in range(world_size)
    ]
    if start_method == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()  # started outside the env update below: one call's env must not leak
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned children read variables like TRITON_INTERPRET at start, before any import
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results: dict[int, Any] = {}
    failures: list[tuple[float, int, str]] = []
    deadline = time.time() + timeout
    note = ""
    try:
        while len(results) + len(failures) < world_size:
            left = deadline - time.time()
            if left <= 0:
                note = f"timed out after {timeout:.0f}s; ranks without a result: " + str(
                    sorted(set(range(world_size)) - set(results) - {r for _, r, _ in failures}))
                break
            try:
                rank, status, payload, when = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and i not in results and i not in {r for _, r, _ in failures}]
                if dead and not failures:
                    # A rank died without reporting (killed, segfault): give the others a moment.
                    time.sleep(1.0)
                    if q.empty():
                        note = f"rank(s) {dead} exited with codes {[procs[i].exitcode for i in dead]} without a report"
                        break
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                failures.append((when, rank, payload))
                # Collect the other ranks' reports for a short while, then stop everyone.
                grace = time.time() + 3.0
                while time.time() < grace and len(results) + len(failures) < world_size:
                    try:
                        r2, s2, p2, w2 = q.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    if s2 == "ok":
                        results[r2] = torch.load(io.BytesIO(p2), weights_only=False)
                    else:
                        failures.append((w2, r2, p2))
                break
    finally:
        for p in procs:
            p.join(timeout=5.0 if not failures and not note else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        shutil.rmtree(store_dir, ignore_errors=True)
        # Symmetric-memory segments are unlinked once mapped; a rank killed mid-allocation can still
        # leave one behind, so remove whatever this job's prefix names.
        removed = cleanup_prefix(job_prefix(job) + "_")  # "_": job "a1" must not match job "a12"
        _report_cleanup(job, fn, removed, cleaned)
    if failures or note:
        failures.sort()
        raise RankFailure([(r, tb) for _, r, tb in failures], note, removed)
    return [results[r] for r in range(world_size)]
