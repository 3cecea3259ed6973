"""Training overheads as ratios to a training step, one run on this machine:

    gradient reduction  (fwd+bwd with the multi-group all-reduces) − (fwd+bwd under no_sync)
    optimizer step      OLMoDDPOptimizer.step(): intake, global norm, AdamW on FP32 main shards, copy-back
    checkpoint save     save_checkpoint(): DCP write of model + FP32 main + moments, manifest, atomic commit
    checkpoint load     load_checkpoint() under the same mesh

each divided by the step (fwd+bwd with reduction + optimizer step). Timed regions start after a barrier;
a sample is the slowest rank's time; the figure is the median over samples, the variants interleaved.

Gradient reduction is measured for each ``--reduction`` variant MODE[/OP] (MODE: grad_reduction=
in_graph, bucket reductions as nodes of the compiled backward, or hooks, autograd hooks, all buckets
start after it returns; OP: reduce_scatter, each bucket reduce-scattered into the ZeRO-1 optimizer's
owned ranges, or all_reduce; without OP the optimizer's default, all_reduce on CPU ranks), each on its own copy
of the model, sampled in turn (order rotated each round) in the same run; the second table's figure is
the median of each round's back-to-back difference, steadier under a varying load than the difference of
medians, and the median time the backward spent in the reducer's final wait (starting what is left,
waiting for every bucket): the part of the reduction that nothing overlapped. Optimizer and checkpoint
figures are the first variant's. The model is the tiny LM (default d=128, 2 layers, 4×64 tokens per
rank); --d-model/--layers/--batch/--seq give it more work per rank.

    python benchmarks/train_overheads.py [--quick] [--json out.json] [--meshes 4:ep_mp=2,...]
                                         [--reduction in_graph,in_graph/reduce_scatter,hooks] [--bucket-mb MB]
                                         [--d-model 128] [--layers 2] [--batch 4] [--seq 64]
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
                   saves: int, variants: tuple[str, ...] = ("in_graph",), bucket_mb: float | None = None,
                   layers: int = 2) -> dict:
    from moe_compile import MeshSpec, moe_compile
    from moe_compile.train.checkpoint import load_checkpoint, save_checkpoint
    from moe_compile.train.data import SyntheticStream
    from moe_compile.train.loop import TrainConfig, build_model
    from moe_compile.train.optimizer import OLMoDDPOptimizer

    cfg = TrainConfig(mesh=mesh, d_model=d_model, batch_size=batch, seq_len=seq, layers=layers)
    extra = {"bucket_mb": bucket_mb} if bucket_mb is not None else {}
    stream = SyntheticStream(256, seq, batch, seed=0)
    x = stream.batch(rank)
    runs = {}
    for v in variants:  # one model per variant, the same weights
        spec, _, transport = v.partition("@")
        mode, _, op = spec.partition("/")
        cm = moe_compile(build_model(cfg), MeshSpec.parse(mesh), capacity_factor=cfg.capacity_factor,
                         grad_reduction=mode, grad_transport=transport or "auto", **extra)
        rs = {"": None, "all_reduce": False, "reduce_scatter": True}[op]
        runs[v] = (cm, OLMoDDPOptimizer(cm, lr=1e-3, max_grad_norm=1.0, reduce_scatter=rs))

    def fwd_bwd(cm):
        cm(input_ids=x, labels=x).loss.backward()

    def fwd_bwd_no_sync(cm):
        with cm.no_sync():
            fwd_bwd(cm)

    waits: dict[str, list[float]] = {v: [] for v in variants}  # time in the reducer's final wait, per backward
    for v, (cm, _) in runs.items():
        def timed_finish(finish=cm.ddp._finish, out=waits[v]):
            t0 = time.perf_counter()
            finish()
            out.append(time.perf_counter() - t0)
        cm.ddp._finish = timed_finish

    for cm, opt in runs.values():  # compile and warm up
        for _ in range(3):
            fwd_bwd(cm)
            opt.step()
            opt.zero_grad()
    s: dict[str, list[float]] = {f"{k}:{v}": [] for v in variants for k in ("fwd_bwd", "fwd_bwd_no_sync", "optimizer")}
    for i in range(rounds):
        for v in variants[i % len(variants):] + variants[: i % len(variants)]:  # rotate: no order bias
            cm, opt = runs[v]
            s[f"fwd_bwd:{v}"].append(_timed(lambda cm=cm: fwd_bwd(cm)))
            s[f"optimizer:{v}"].append(_timed(opt.step))
            opt.zero_grad()
            s[f"fwd_bwd_no_sync:{v}"].append(_timed(lambda cm=cm: fwd_bwd_no_sync(cm)))
            opt.zero_grad()
    cm, opt = runs[variants[0]]
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
    def step_of(v):
        return med[f"fwd_bwd:{v}"] + med[f"optimizer:{v}"]

    def paired(v):  # median of each round's difference: the two samples are taken back to back
        return statistics.median(a - b for a, b in zip(s[f"fwd_bwd:{v}"], s[f"fwd_bwd_no_sync:{v}"]))

    for k in ("fwd_bwd", "fwd_bwd_no_sync", "optimizer"):
        med[k] = med[f"{k}:{variants[0]}"]
    step = step_of(variants[0])
    grad_bytes = sum(b["bytes"] for b in cm.ddp.bucket_summary())
    return {
        "mesh": str(cm.program.mesh), "ranks": world, "tokens_per_rank": batch * seq, "d_model": d_model,
        "params_per_rank": sum(p.numel() for p in cm.parameters()), "bucket_bytes_per_rank": grad_bytes,
        "buckets": len(cm.ddp.buckets), "checkpoint_bytes": size, "seconds": med,
        "ratios": {
            "reduction": (med["fwd_bwd"] - med["fwd_bwd_no_sync"]) / step,
            "optimizer": med["optimizer"] / step,
            "checkpoint_save": med["save"] / step,
            "checkpoint_load": med["load"] / step,
        },
        "reduction": {v: {"ratio": paired(v) / step_of(v), "seconds": paired(v), "step_seconds": step_of(v),
                          "final_wait_seconds": statistics.median(waits[v][3:] or [0.0])}
                      for v in variants},
        "step_seconds": step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--meshes", default="4:ep_mp=2,2:ep_mp=2,2:ep_mp=1", help="RANKS:MESH,... (default: %(default)s)")
    ap.add_argument("--reduction", default="in_graph,in_graph/reduce_scatter,hooks,in_graph@process_group",
                    help="MODE[/OP][@TRANSPORT] variants (MODE: in_graph | hooks; OP: reduce_scatter | all_reduce; "
                    "TRANSPORT: the grad_transport option, auto unless given), the first one is the main table's "
                    "(default: %(default)s)")
    ap.add_argument("--bucket-mb", type=float, default=None, help="gradient bucket size (default: the option's)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=128, help="tiny LM width (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=2, help="tiny LM layers (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: %(default)s)")
    args = ap.parse_args()
    from moe_compile.runtime.launcher import spawn_ranks

    rounds, saves = (5, 2) if args.quick else (20, 5)
    rounds = args.rounds or rounds
    variants = tuple(args.reduction.split(","))
    results = []
    for item in args.meshes.split(","):
        ranks, mesh = item.split(":", 1)
        r = spawn_ranks(overheads_rank, int(ranks), mesh, args.d_model, args.batch, args.seq, rounds, saves, variants,
                        args.bucket_mb, args.layers, env={"OMP_NUM_THREADS": "1"})[0]
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
    print()
    print("| mesh (ranks) | buckets | " + " | ".join(f"reduction, {v}" for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for r in results:
        cells = [f"{x['ratio']:.3f} ({x['seconds'] * 1e3:.1f} of {x['step_seconds'] * 1e3:.0f} ms; "
                 f"final wait {x['final_wait_seconds'] * 1e3:.1f} ms)" for x in r["reduction"].values()]
        print(f"| {r['mesh']} ({r['ranks']}) | {r['buckets']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
