"""Scale benchmark, one run (issue 14 parts a and b): memory and host reads that follow the work, not the mesh.

(a) dropless receive-buffer bytes per rank per MoE layer at ep_mp ∈ {2, 4} on 4 CPU ranks (tiny model),
    uniform and skewed routing (every token to rank 0's experts), measured (the buffer the compiled
    program allocates after its load-following growth) and predicted by the ledger (C_rho at the
    observed imbalance ρ), each as a ratio to today's static ep_mp·T·K buffer;
(b) host reads (device→host syncs on a GPU) per training step on the transport path, per transport;
all of it in one world of rank processes, one measurement after another.

    python benchmarks/scale.py [--ranks 4] [--seq 32] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def recv_worker(rank: int, world: int, ep_mp: int, scenario: str, seq: int) -> dict:
    from moe_compile import MeshSpec, moe_compile
    from moe_compile.ledger import evaluate
    from moe_compile.models import TinyMoEConfig, TinyMoELM
    from moe_compile.runtime.dropless import DROPLESS_HEADROOM, find_dropless_state
    from tests.common import skew_to_first_experts

    torch.manual_seed(0)
    cfg = TinyMoEConfig()
    model = TinyMoELM(cfg)
    if scenario == "skewed":
        skew_to_first_experts(model, cfg.num_experts // ep_mp)
    cm = moe_compile(model, MeshSpec(ep_mp=ep_mp, ep_dp=world // ep_mp))
    ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(rank))
    cm(input_ids=ids, labels=ids).loss.backward()
    st = find_dropless_state(cm.program.ctx_id)
    rows, cap = next(iter(st.blocks.values()))
    row_bytes = cfg.d_model * 4
    rho = st.high_water / rows
    pred = evaluate({"T": rows // cfg.top_k, "K": cfg.top_k, "ep_mp": ep_mp, "h_d": DROPLESS_HEADROOM,
                     "rho": rho, "c_f": 1})["C_rho"]
    cm.close()
    return {"measured": cap * row_bytes, "predicted": int(pred) * row_bytes, "static": ep_mp * rows * row_bytes,
            "rho": rho, "growths": len(st.growths)}


def sync_worker(rank: int, world: int, transport: str, seq: int) -> dict:
    from moe_compile import MeshSpec, moe_compile
    from moe_compile.models import TinyMoEConfig, TinyMoELM
    from moe_compile.runtime.host_syncs import count_host_syncs

    torch.manual_seed(0)
    cfg = TinyMoEConfig()
    cm = moe_compile(TinyMoELM(cfg), MeshSpec(ep_mp=world), transport=transport)
    ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(rank))
    cm(input_ids=ids, labels=ids).loss.backward()  # compiles
    with count_host_syncs() as counts:
        cm(input_ids=ids, labels=ids).loss.backward()
    cm.close()
    # the transport path (tests/test_host_syncs.py); the CPU heap's barrier polls host shared memory (no device)
    path = ("runtime/transport.py", "runtime/symmetric_transport.py", "runtime/route_plan.py", "ops/transport.py",
            "runtime/dropless.py", "codegen/kernels/route_map.py", "runtime/stats.py")
    return {"transport_path": sum(n for (site, _), n in counts.items() if site.startswith(path)),
            "by_site": {f"{s}/{m}": n for (s, m), n in counts.items() if s.startswith(path)},
            "layers": cfg.n_layers}


def jobs_worker(rank: int, world: int, jobs: list[tuple], seq: int) -> list[dict]:
    """Every measurement in one world, one after another (one set of rank processes to start)."""
    return [recv_worker(rank, world, *job[1:], seq) if job[0] == "recv" else sync_worker(rank, world, job[1], seq)
            for job in jobs]


def main() -> None:
    from moe_compile.runtime.launcher import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="2 ranks, ep_mp=2, short sequences")
    a = ap.parse_args()
    world, seq, eps = (2, 8, (2,)) if a.smoke else (a.ranks, a.seq, tuple(e for e in (2, 4) if e <= a.ranks))
    env = {"OMP_NUM_THREADS": "1"}
    recv = [("recv", ep, scenario) for ep in eps for scenario in ("uniform", "skewed")]
    syncs = [("sync", transport) for transport in ("symmetric", "all_to_all")]
    per_rank = spawn_ranks(jobs_worker, world, recv + syncs, seq, env=env)
    results = [[r[j] for r in per_rank] for j in range(len(recv) + len(syncs))]  # job → every rank's result
    print(f"(a) dropless receive-buffer bytes per rank per MoE layer ({world} CPU ranks, tiny model, "
          f"2×{seq} tokens per rank)")
    for (_, ep, scenario), rs in zip(recv, results):
        worst = max(rs, key=lambda r: r["measured"])
        print(f"  ep_mp={ep} {scenario:<8} rho={worst['rho']:.2f} growths={worst['growths']}: measured "
              f"{worst['measured']:,} B, predicted {worst['predicted']:,} B, static ep_mp·T·K {worst['static']:,} B; "
              f"ratio measured / static = {worst['measured'] / worst['static']:.3f}, "
              f"ratio predicted / measured = {worst['predicted'] / worst['measured']:.3f}")
    print(f"(b) host reads per training step on the transport path ({world} ranks, ep_mp={world})")
    for (_, transport), rs in zip(syncs, results[len(recv):]):
        r = rs[0]
        print(f"  {transport:<10} host syncs per step = {r['transport_path']} ({r['layers']} MoE layers): "
              f"{r['by_site']}")


if __name__ == "__main__":
    main()
