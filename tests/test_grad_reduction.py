"""Gradient reduction inside the compiled backward (passes/grad_reduction.py): gradients equal the dense
reference, each bucket's reduction is issued by a node right after its last gradient (buckets in
production order), no_sync accumulates, and a backward that raised does not poison the next step.
The ZeRO-1 optimizer is attached, so the buckets are reduce-scattered into its owned ranges
(train/grad_shards.py); the all-reduce path is what every parity test without an optimizer runs."""

from __future__ import annotations

import platform
from unittest import mock

import pytest
import torch

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import MoECompileError, OptionError, RuntimeFault
from moe_compile.options import CompileOptions
from moe_compile.train.grad_shards import chunk_range
from moe_compile.train.optimizer import OLMoDDPOptimizer

from .common import build_model, dense_reference, make_batches, rel_err
from .harness import run_ranks


def _grad_err(cm, ref: dict[str, torch.Tensor]) -> float:
    grads = cm.full_grads()  # reduce-scattered: all-gathered from the owned ranges
    return max(rel_err(grads[n], ref[n]) for n in ref)


def _owned_err(cm, ref: dict[str, torch.Tensor]) -> float:
    """This rank's owned ranges (what the optimizer reads) against the same slices of the reference, for
    the parameters the compiled model keeps under their own names (the dense ones; the expert ones are
    checked whole through full_grads, and through the optimizer in test_optimizer.py)."""
    params = dict(cm.model.named_parameters())
    worst, checked = 0.0, 0
    for n, want in ref.items():
        if n not in params:
            continue
        checked += 1
        b, _ = cm.ddp._where[id(params[n])]
        lo, hi = chunk_range(want.numel(), b.shards.g, b.shards.q)
        if hi > lo:
            worst = max(worst, rel_err(cm.ddp.owned_grad(params[n]), want.reshape(-1)[lo:hi]))
    assert checked >= 5, f"only {checked} parameters keep their names"
    return worst


def _structure(cm) -> dict:
    """Where the graph issues its reductions, relative to the gradients it produces."""
    g = cm.program.graphs["backward"]
    nodes = list(g.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    ready = [n for n in nodes if n.target is torch.ops.moe_ddp.bucket_ready.default]
    wait = [n for n in nodes if n.target is torch.ops.moe_ddp.bucket_wait.default]
    grads = [a for n in ready for a in n.args[2]]
    slots = {id(p): k for k, p in enumerate(cm.ddp.slots)}
    return {
        "ready": len(ready),
        "buckets": len(cm.ddp.buckets),
        # each node right after the last of its bucket's gradients
        "right_after": all(n.prev in n.args[2] for n in ready),
        # reductions start before the last gradient is produced
        "first_before_last_grad": bool(ready) and pos[ready[0]] < max(pos[a] for a in grads),
        # graph order of the nodes = the reducer's bucket order
        "bucket_order": [list(n.args[1]) for n in ready] == [[slots[id(p)] for p in b.params]
                                                             for b in cm.ddp.buckets],
        "wait_last": len(wait) == 1 and wait[0].next.op == "output",
        "param_outputs": sum(a is not None for a in g.graph.output_node().args[0]),
    }


def reduction_worker(rank: int, world: int, mode: str, transport: str = "auto") -> dict:
    model = build_model("tiny")
    a, b, c = (make_batches(world, seed=s) for s in (1, 2, 3))
    _, ref_a = dense_reference(model, a)
    _, ref_b = dense_reference(model, b)
    _, ref_c = dense_reference(model, c)
    ref_ab = {n: ref_a[n] + ref_b[n] for n in ref_a}
    cm = moe_compile(model, MeshSpec.parse("ep_mp=1"), grad_reduction=mode, bucket_mb=0.05, grad_transport=transport)
    OLMoDDPOptimizer(cm, lr=0.0, reduce_scatter=True)  # both families over groups of 2 ranks
    out: dict = {"sharded": all(b.shards is not None for b in cm.ddp.buckets),
                 "host_shm": [b.shm_group is not None for b in cm.ddp.buckets]}

    with cm.no_sync():  # accumulation: only the second backward reduces
        cm(a[rank], labels=a[rank]).loss.backward()
    cm(b[rank], labels=b[rank]).loss.backward()
    out["owned_err"] = _owned_err(cm, ref_ab)
    out["accum_err"] = _grad_err(cm, ref_ab)
    try:
        cm.ddp.main_grad(cm.model.norm.weight)
    except MoECompileError as e:
        out["main_grad_refused"] = "reduce-scattered" in str(e) and "norm.weight" in str(e)
    out.update(_structure(cm))
    cm.ddp.zero_grad()

    if mode == "in_graph":  # a backward that raises after the first bucket's all-reduce started
        real, calls = cm.ddp.graph_ready, []

        def faulty(slots, grads):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected fault")
            return real(slots, grads)

        cm.ddp.graph_ready = faulty
        try:
            cm(c[rank], labels=c[rank]).loss.backward()
        except RuntimeError as e:
            out["raised"] = "injected fault" in str(e)
        del cm.ddp.graph_ready
        cm.ddp.zero_grad()
        # a parameter used outside the compiled graph: the reducer refuses (its bucket is the graph's)
        try:
            (cm(c[rank], labels=c[rank]).loss + 0 * cm.model.norm.weight.sum()).backward()
        except RuntimeFault as e:
            out["outside"] = "grad_reduction='hooks'" in str(e)
        cm.ddp.zero_grad()
    cm(c[rank], labels=c[rank]).loss.backward()
    out["next_err"] = _grad_err(cm, ref_c)
    cm.close()
    return out


@pytest.mark.parametrize("mode,transport", [("in_graph", "auto"), ("in_graph", "process_group"),
                                            pytest.param("hooks", "auto", marks=pytest.mark.slow)])
def test_reduction_in_backward_graph(mode, transport):
    """auto: CPU ranks of one x86-64 host reduce through host shared memory (train/shm_reduce.py)."""
    shm = transport == "auto" and platform.machine() in ("x86_64", "AMD64")
    for r in run_ranks(reduction_worker, 2, mode, transport):
        assert r["sharded"] and r["main_grad_refused"], r
        assert r["host_shm"] == [shm] * r["buckets"], r
        assert r["owned_err"] <= 1e-5 and r["accum_err"] <= 1e-5 and r["next_err"] <= 1e-5, r
        if mode == "hooks":  # the explicit fallback: the graph returns every gradient, hooks reduce
            assert r["ready"] == 0 and r["param_outputs"] == 18, r
            continue
        assert r["ready"] == r["buckets"] > 2, r
        assert r["right_after"] and r["first_before_last_grad"] and r["bucket_order"] and r["wait_last"], r
        assert r["param_outputs"] == 0, r  # autograd accumulates none of the reduced gradients
        assert r["raised"] and r["outside"], r


def test_grad_reduction_option():
    with pytest.raises(OptionError, match="grad_reduction"):
        CompileOptions(grad_reduction="overlap")
    with pytest.raises(OptionError, match="grad_transport='nccl'.*process_group"):
        CompileOptions(grad_transport="nccl")


def shm_worker(rank: int, world: int) -> dict:
    """All-reduce and reduce-scatter through host shared memory against torch's own sum of the members'
    tensors, every member's result bit for bit the same; a member that never starts fails the others' wait
    with the ranks named; grad_transport='host_shm' where its flags cannot work is refused."""
    import torch.distributed as dist

    from moe_compile.runtime.symmetric import host
    from moe_compile.train.shm_reduce import HostShmReduction

    out: dict = {}
    gens = [torch.Generator().manual_seed(10 + m) for m in range(world)]
    inputs = [[torch.randn(1000, generator=g) for g in gens] for _ in range(3)]  # 3 rounds, one per member
    red = HostShmReduction(dist.group.WORLD, "dense")
    b = red.bucket(1000, torch.float32)
    sums = []
    for r, xs in enumerate(inputs):
        flat = xs[rank].clone()
        b.start(flat, flat).wait()
        want = xs[0].double() + sum(x.double() for x in xs[1:])
        out[f"err{r}"] = (flat.double() - want).abs().max().item()
        sums.append(flat)
    got = [torch.empty(3000) for _ in range(world)]
    dist.all_gather(got, torch.cat(sums))
    out["same_bits"] = all(torch.equal(got[0], t) for t in got)
    rows = torch.stack([torch.full((5,), 10.0 * m + rank) for m in range(world)])  # row m goes to member m
    rs = red.bucket(rows.numel(), torch.float32)
    mine = torch.empty(5)
    rs.start(rows, mine, (rank * 5, rank * 5 + 5)).wait()
    out["scatter"] = torch.equal(mine, torch.full((5,), 10.0 * rank * world + sum(range(world))))

    host.BARRIER_TIMEOUT_S = 2.0  # member 1 never starts round 4
    if rank == 0:
        try:
            b.start(inputs[0][0].clone(), torch.empty(1000)).wait()
        except RuntimeFault as e:
            out["late"] = str(e)
    dist.barrier()

    with mock.patch("platform.machine", return_value="aarch64"):
        try:
            moe_compile(build_model("tiny"), MeshSpec.parse("ep_mp=1"), grad_transport="host_shm")
        except OptionError as e:
            out["refused"] = str(e)
        cm = moe_compile(build_model("tiny"), MeshSpec.parse("ep_mp=1"))  # auto: the process group there
        out["auto_elsewhere"] = [bk.shm_group is not None for bk in cm.ddp.buckets]
        cm.close()
    return out


def _mapped(prefixes: list[str]) -> int:
    """Bytes of this process's mappings of the named shared-memory segments (/proc/self/maps)."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if any(p in line for p in prefixes):
                lo, hi = line.split()[0].split("-")
                total += int(hi, 16) - int(lo, 16)
    return total


def shm_release_worker(rank: int, world: int) -> dict:
    """Re-bucketing (set_grad_dtype) maps new gradient segments: the old ones must go, and close() must
    drop the rest, while the gradients stay those of the dense model."""
    import gc

    model = build_model("tiny")
    batches = make_batches(world, seed=4)
    _, ref = dense_reference(model, batches)
    cm = moe_compile(model, MeshSpec.parse("ep_mp=1"), bucket_mb=0.05)
    prefixes = [red.heap.prefix + "_" for red in cm.ddp._shm.values()]
    out: dict = {"families": len(prefixes)}
    cm(batches[rank], labels=batches[rank]).loss.backward()
    out["first"] = _mapped(prefixes)
    sizes = []
    for dtype in (torch.float64, None, torch.float64, None):
        cm.ddp.zero_grad()
        cm.ddp.set_grad_dtype(dtype)
        cm(batches[rank], labels=batches[rank]).loss.backward()
        sizes.append(_mapped(prefixes))
    out["sizes"] = sizes
    out["err"] = _grad_err(cm, ref)
    cm.close()
    gc.collect()
    out["closed"] = _mapped(prefixes)
    return out


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the shm flags need x86-64 store order")
def test_host_shm_segments_released():
    for r in run_ranks(shm_release_worker, 2):
        assert r["families"] == 2 and r["first"] > 0, r
        # fp64 buckets take twice the bytes; back at fp32 the mappings are those of the first step again
        assert r["sizes"][1] == r["sizes"][3] == r["first"] < r["sizes"][0] == r["sizes"][2], r
        assert r["err"] <= 1e-5, r
        assert r["closed"] == 0, r


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the shm flags need x86-64 store order")
def test_host_shm_reduction():
    results = run_ranks(shm_worker, 2)
    for r in results:
        assert max(r[f"err{k}"] for k in range(3)) <= 2e-6, r  # fp32 sum of 2 members (|x| < 10)
        assert r["same_bits"] and r["scatter"], r
        assert r["refused"].startswith("grad_transport='host_shm'") and "aarch64" in r["refused"], r
        assert r["auto_elsewhere"] and not any(r["auto_elsewhere"]), r
    late = results[0]["late"]
    assert "dense gradient bucket (1000 elements), round 4: ranks [1]" in late and "did not arrive" in late, late
