"""Context parallelism on CPU ranks, one run, ratios on the same machine.

The tiny LM (router aux losses off) on a fixed global batch (2 sequences of --seq-len tokens), for
cp ∈ {1, 2, 4} (cp ranks, ep_mp = 1, so only the sequence is split):

* peak saved-activation bytes per rank during one forward+backward (every tensor autograd saves,
  counted from its pack until freed), as a ratio to cp = 1 (target ≈ 1/cp: each rank keeps S/cp
  tokens; the all-gathered K/V that attention saves are the part that does not shrink);
* step time (median after the first step), as a ratio to cp = 1.

    python benchmarks/context_parallel.py [--seq-len S] [--steps N] [--smoke] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from pipeline import SavedBytes, emit  # noqa: E402  (the saved-tensor meter, the report)


def rank_main(rank: int, world: int, seq: int, steps: int, layers: int) -> dict:
    from moe_compile import MeshSpec, moe_compile
    from moe_compile.models import TinyMoEConfig, TinyMoELM

    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig(n_layers=layers, d_model=128, expert_hidden=128, max_seq_len=seq,
                                    lb_coef=0.0, z_coef=0.0))
    cm = moe_compile(model, MeshSpec(cp=world, dp=1) if world > 1 else None)
    batch = torch.randint(3, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    meter = SavedBytes(cm.model)
    times, peaks = [], []
    for _ in range(steps):
        meter.peak = meter.live
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            loss = cm(input_ids=batch, labels=batch).loss
        loss.backward()
        times.append(time.perf_counter() - t0)
        peaks.append(meter.peak)
        cm.model.zero_grad(set_to_none=True)
        if cm.ddp is not None:
            cm.ddp.zero_grad()
    cm.close()
    return {"step_s": statistics.median(times[1:] or times), "peak_saved_bytes": max(peaks), "loss": loss.item()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.seq_len, args.steps = 64, 3
    from moe_compile.runtime.launcher import spawn_ranks

    runs = {}
    for cp in (1, 2, 4):
        ranks = spawn_ranks(rank_main, cp, args.seq_len, args.steps, args.layers, timeout=1200,
                            env={"OMP_NUM_THREADS": "1"})
        runs[cp] = {"step_s": max(r["step_s"] for r in ranks), "peak_saved_bytes": max(r["peak_saved_bytes"] for r in ranks),
                    "loss": ranks[0]["loss"]}
    base = runs[1]
    report = {"config": vars(args), "runs": runs,
              "ratios": {cp: {"peak_saved_vs_cp1": r["peak_saved_bytes"] / base["peak_saved_bytes"],
                              "step_time_vs_cp1": r["step_s"] / base["step_s"]} for cp, r in runs.items()}}
    return emit(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
