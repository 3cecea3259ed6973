"""Transport benchmark, one run: dispatch + combine of the symmetric (host shared memory, one-sided
PUT/GET) transport vs gloo all_to_all on 4 CPU ranks, and symmetric bytes with vs without lease
sharing for the demo model.

    python benchmarks/transport.py [--ranks 4] [--tokens 2048] [--d 512] [--iters 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _plan(ep: int, nl: int, cap: int, rows: int, d: int):
    from moe_compile.leases import LeasePlan, Payload

    recv = Payload("bench/dispatch.recv", "bench", "lease", (cap, d), "torch.float32", cap * d * 4, 0, 3, True, 0,
                   released_by=("grouped_ffn_backward", "bench"))
    src = Payload("bench/combine.src", "bench", "transient", (cap, d), "torch.float32", cap * d * 4, 1, 2, False, 0)
    counts = Payload("bench/counts", "bench", "counts", (ep, ep, nl), "torch.int64", ep * ep * nl * 8, 0, 1, False, 0)
    return LeasePlan((counts, recv, src), 4, True, {}, {(0, "lease"): recv.nbytes, (0, "transient"): src.nbytes,
                                                       (0, "counts"): counts.nbytes})


def transport_worker(rank: int, world: int, tokens: int, d: int, experts: int, top_k: int, iters: int) -> dict:
    import torch.distributed as dist

    from moe_compile.runtime import AllToAllTransport, RuntimeContext, RuntimeStats, register_context
    from moe_compile.runtime.lease_runtime import LeaseRuntime
    from moe_compile.runtime.symmetric import make_heap
    from moe_compile.runtime.symmetric_transport import SymmetricTransport

    group = dist.group.WORLD
    rows, nl = tokens * top_k, experts // world
    cap = world * rows
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, experts, (tokens, top_k), generator=g)
    x = torch.randn(tokens, d, generator=g)
    xs, _order, counts = torch.ops.moe.permute(x, idx, experts, "bench")
    out = {}
    for kind in ("all_to_all", "symmetric"):
        stats = RuntimeStats()
        if kind == "symmetric":
            leases = LeaseRuntime(make_heap(group, "cpu"), group)
            ctx = register_context(RuntimeContext(SymmetricTransport(leases.heap, leases, stats), stats, leases=leases))
            leases.activate(leases.install(_plan(world, nl, cap, rows, d)))
        else:
            ctx = register_context(RuntimeContext(AllToAllTransport(group, stats), stats))
        samples = []
        for i in range(iters + 3):
            dist.barrier()
            t0 = time.perf_counter()
            recv, _rc, layout = torch.ops.moe.dispatch(xs, counts, ctx, "bench", cap, world)
            back = torch.ops.moe.combine(recv, layout, ctx, "bench", rows)
            if kind == "symmetric":
                torch.ops.moe.lease_release(ctx, "bench/dispatch.recv", back)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a transfer is done when its slowest rank is
            if i >= 3:
                samples.append(dt.item())
        assert torch.equal(back, xs), "dispatch→combine must return every row unchanged"
        out[kind] = statistics.median(samples)
    return out


def sharing_worker(rank: int, world: int) -> dict:
    from moe_compile import MeshSpec, moe_compile
    from moe_compile.models import TinyMoEConfig, TinyMoELM

    res = {}
    for sharing in (True, False):
        torch.manual_seed(0)
        cm = moe_compile(TinyMoELM(TinyMoEConfig(n_layers=4)), MeshSpec(ep_mp=world), transport="symmetric",
                         lease_sharing=sharing)
        ids = torch.randint(0, 256, (4, 64))
        cm(input_ids=ids, labels=ids).loss.backward()
        plan = cm.lease_plan()
        res[sharing] = {"bytes": cm.lease_runtime().symmetric_bytes, "high_water": dict(plan.high_water),
                        "payloads": len(plan.payloads)}
    return res


def main() -> None:
    from moe_compile.runtime.launcher import spawn_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    t = spawn_ranks(transport_worker, a.ranks, a.tokens, a.d, a.experts, a.top_k, a.iters)[0]
    s = spawn_ranks(sharing_worker, a.ranks)[0]
    mb = a.tokens * a.top_k * a.d * 4 / 2**20
    print(f"dispatch + combine, {a.ranks} CPU ranks, {a.tokens} tokens × top-{a.top_k} × d={a.d} fp32 "
          f"({mb:.1f} MiB of rows per rank each way)")
    print(f"  gloo all_to_all     {t['all_to_all'] * 1e3:8.2f} ms")
    print(f"  symmetric (shm)     {t['symmetric'] * 1e3:8.2f} ms   ratio symmetric / all_to_all = "
          f"{t['symmetric'] / t['all_to_all']:.2f}")
    print(f"symmetric memory of the demo model (4 MoE layers, {a.ranks} ranks):")
    print(f"  with sharing        {s[True]['bytes']:>10,} bytes   high-water {s[True]['high_water']}")
    print(f"  without sharing     {s[False]['bytes']:>10,} bytes   ({s[False]['payloads']} fixed per-block caches)")
    print(f"  ratio with / without = {s[True]['bytes'] / s[False]['bytes']:.2f}")


if __name__ == "__main__":
    main()
