"""The local launcher's start methods: what a rank started from the forkserver sees (its own env, no
other call's env, a fresh process per rank, forked by the server, not by the caller) and how it fails."""

from __future__ import annotations

import os
from multiprocessing import forkserver

import pytest

from moe_compile.runtime.launcher import RankFailure, spawn_ranks

VAR = "MOE_COMPILE_TEST_LAUNCHER_VAR"


def env_worker(rank, world):
    return {"var": os.environ.get(VAR), "rank": os.environ["RANK"], "pid": os.getpid(), "ppid": os.getppid()}


def threads_worker(rank, world):
    import torch

    return torch.get_num_threads()


def modules_worker(rank, world):
    import sys

    return "transformers.modeling_utils" in sys.modules


def failing_worker(rank, world):
    if rank == 1:
        raise ValueError("rank one's own fault")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits on the peer that failed


def test_forkserver_ranks_see_their_own_env_only():
    # a server an earlier test started would hide a leak: this call must be the one that starts it
    forkserver._forkserver._stop()
    first = spawn_ranks(env_worker, 2, env={VAR: "first"}, start_method="forkserver", timeout=120)
    assert [r["var"] for r in first] == ["first", "first"] and [r["rank"] for r in first] == ["0", "1"]
    assert all(r["ppid"] != os.getpid() for r in first)  # forked by the server
    second = spawn_ranks(env_worker, 2, start_method="forkserver", timeout=120)
    assert [r["var"] for r in second] == [None, None]  # the first call's env did not stay in the server
    pids = {r["pid"] for r in first + second}
    assert len(pids) == 4 and os.getpid() not in pids  # a process per rank, never this one
    assert os.environ.get(VAR) is None  # and the caller's env is as it was


def test_ranks_take_the_thread_count_they_are_given():
    """OMP_NUM_THREADS in a rank's env wins: the harness sets 1 (its xdist workers already fill the cores),
    and the ranks had split the host's cores among themselves regardless (2 threads for one rank here)."""
    assert spawn_ranks(threads_worker, 2, env={"OMP_NUM_THREADS": "3"}, timeout=120) == [3, 3]
    assert spawn_ranks(threads_worker, 1, env={"OMP_NUM_THREADS": "1"}, timeout=120) == [1]


def test_forkserver_ranks_start_with_transformers_imported():
    """The server imports transformers' model code once (about 2 s of CPU a rank otherwise, in every rank
    that builds a Hugging Face model); a spawned rank starts without it (this file does not import it)."""
    assert spawn_ranks(modules_worker, 2, start_method="forkserver", timeout=120) == [True, True]
    assert spawn_ranks(modules_worker, 1, start_method="spawn", timeout=120) == [False]


def test_forkserver_reports_the_failing_rank_first():
    with pytest.raises(RankFailure) as e:
        spawn_ranks(failing_worker, 2, start_method="forkserver", timeout=120)
    assert str(e.value).startswith("rank 1 failed first") and "rank one's own fault" in str(e.value)


def test_spawn_start_method_still_runs():
    r = spawn_ranks(env_worker, 1, env={VAR: "spawned"}, start_method="spawn", timeout=120)[0]
    assert r["var"] == "spawned" and r["ppid"] == os.getpid()  # started by this process itself


def test_unknown_start_method_is_named():
    with pytest.raises(ValueError, match="start_method must be 'spawn' or 'forkserver', not 'fork'"):
        spawn_ranks(env_worker, 1, start_method="fork")
