"""Training overheads as ratios to a training step, one run on this machine:

    gradient reduction  (fwd+bwd with the multi-group all-reduces) − (fwd+bwd under no_sync)
    optimizer step      OLMoDDPOptimizer.step(): intake, global norm, AdamW on FP32 main shards, copy-back
    checkpoint save     save_checkpoint(): DCP write of model + FP32 main + moments, manifest, atomic commit
    checkpoint load     load_checkpoint() under the same mesh

each divided by the step (fwd+bwd with reduction + optimizer step). Timed regions start after a barrier;
a sample is the slowest rank's time; the figure is the median over samples, the variants interleaved.

    python benchmarks/train_overheads.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def overheads_rank(rank: int, world: int, mesh: str, d_model: int, batch: int, seq: int, rounds: int,
                   saves: int) -> dict:
    from moe_compile.train.checkpoint import load_checkpoint, save_checkpoint
    from moe_compile.train.data import SyntheticStream
    from moe_compile.train.loop import TrainConfig, build_model, compile_for
    from moe_compile.train.optimizer import OLMoDDPOptimizer

    cfg = TrainConfig(mesh=mesh, d_model=d_model, batch_size=batch, seq_len=seq)
    cm = compile_for(cfg, build_model(cfg))
    opt = OLMoDDPOptimizer(cm, lr=1e-3, max_grad_norm=1.0)
    stream = SyntheticStream(256, seq, batch, seed=0)
    x = stream.batch(rank)

    def fwd_bwd():
        cm(input_ids=x, labels=x).loss.backward()

    def fwd_bwd_no_sync():
        with cm.no_sync():
            fwd_bwd()

    for _ in range(3):  # compile and warm up
        fwd_bwd()
        opt.step()
        opt.zero_grad()
    s: dict[str, list[float]] = {"fwd_bwd": [], "fwd_bwd_no_sync": [], "optimizer": []}
    for _ in range(rounds):
        s["fwd_bwd"].append(_timed(fwd_bwd))
        s["optimizer"].append(_timed(opt.step))
        opt.zero_grad()
        s["fwd_bwd_no_sync"].append(_timed(fwd_bwd_no_sync))
        opt.zero_grad()
    root = tempfile.mkdtemp(prefix="moe_ckpt_bench_") if rank == 0 else ""
    obj = [root]
    dist.broadcast_object_list(obj)
    root = obj[0]
    s["save"], s["load"] = [], []
    for i in range(saves):
        s["save"].append(_timed(lambda i=i: save_checkpoint(root, cm, opt, step=i + 1, data_position=0, keep_last=1)))
        s["load"].append(_timed(lambda: load_checkpoint(root, cm, opt)))
    med = {k: statistics.median(v) for k, v in s.items()}
    if rank != 0:
        return {}
    import pathlib
    import shutil

    size = sum(p.stat().st_size for p in pathlib.Path(root).rglob("*") if p.is_file())
    shutil.rmtree(root, ignore_errors=True)
    step = med["fwd_bwd"] + med["optimizer"]
    grad_bytes = sum(b["bytes"] for b in cm.ddp.bucket_summary())
    return {
        "mesh": str(cm.program.mesh), "ranks": world, "tokens_per_rank": batch * seq, "d_model": d_model,
        "params_per_rank": sum(p.numel() for p in cm.parameters()), "bucket_bytes_per_rank": grad_bytes,
        "checkpoint_bytes": size, "seconds": med,
        "ratios": {
            "reduction": (med["fwd_bwd"] - med["fwd_bwd_no_sync"]) / step,
            "optimizer": med["optimizer"] / step,
            "checkpoint_save": med["save"] / step,
            "checkpoint_load": med["load"] / step,
        },
        "step_seconds": step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from moe_compile.runtime.launcher import spawn_ranks

    rounds, saves = (5, 2) if args.quick else (20, 5)
    results = []
    for ranks, mesh in ((4, "ep_mp=2"), (2, "ep_mp=2"), (2, "ep_mp=1")):
        r = spawn_ranks(overheads_rank, ranks, mesh, 128, 4, 64, rounds, saves, env={"OMP_NUM_THREADS": "1"})[0]
        results.append(r)
    print("| mesh (ranks) | step | reduction | optimizer step | checkpoint save | checkpoint load | checkpoint size |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        sec, rat = r["seconds"], r["ratios"]
        print(f"| {r['mesh']} ({r['ranks']}) | {r['step_seconds'] * 1e3:.0f} ms | "
              f"{rat['reduction']:.2f} ({(sec['fwd_bwd'] - sec['fwd_bwd_no_sync']) * 1e3:.1f} ms) | "
              f"{rat['optimizer']:.2f} ({sec['optimizer'] * 1e3:.1f} ms) | "
              f"{rat['checkpoint_save']:.2f} ({sec['save'] * 1e3:.0f} ms) | "
              f"{rat['checkpoint_load']:.2f} ({sec['load'] * 1e3:.0f} ms) | {r['checkpoint_bytes'] / 2**20:.1f} MiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
