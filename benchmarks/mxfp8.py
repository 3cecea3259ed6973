"""MXFP8 benchmark, one run (2 CPU ranks, ep_mp=2, the demo model):

1. dispatch bytes from the runtime's counters: MXFP8 (packed qdata–scale rows) / BF16 (target ≤ 0.52);
2. a 200-step training comparison of the demo model with --precision mxfp8 vs bf16 (the same FP32-main
   optimizer and data): final loss (mean of the last 20 steps) within 2%.

    python benchmarks/mxfp8.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def bytes_worker(rank: int, world: int) -> dict:
    import torch

    from moe_compile import MeshSpec, moe_compile
    from moe_compile.train.data import SyntheticStream
    from moe_compile.train.loop import TrainConfig, build_model

    out = {}
    batch = SyntheticStream(256, 64, 4, seed=0).batch(rank)
    for precision in ("bf16", "mxfp8"):
        cfg = TrainConfig(precision=precision)
        for transport in ("all_to_all", "symmetric"):
            cm = moe_compile(build_model(cfg), MeshSpec(ep_mp=world), transport=transport,
                             **({"mxfp8": "experts"} if precision == "mxfp8" else {}))
            cm(input_ids=batch, labels=batch).loss.backward()
            s = cm.stats()
            out[(precision, transport)] = {"moved": s["bytes_moved_by_kind"]["ep_mp/dispatch"],
                                           "peer": s["bytes_sent_by_kind"]["ep_mp/dispatch"]}
    tot = {k: torch.tensor([v["moved"], v["peer"]], dtype=torch.float64) for k, v in out.items()}
    for t in tot.values():
        torch.distributed.all_reduce(t)
    return {f"{p}/{tr}": t.tolist() for (p, tr), t in tot.items()}


def main() -> None:
    from moe_compile.runtime.launcher import spawn_ranks
    from moe_compile.train.loop import TrainConfig, train_rank

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    b = spawn_ranks(bytes_worker, 2)[0]
    print("dispatch bytes over the EP-MP group (2 ranks, one step of the demo, 4×64 tokens per rank)")
    for tr in ("all_to_all", "symmetric"):
        bf, mx = b[f"bf16/{tr}"], b[f"mxfp8/{tr}"]
        print(f"  {tr:<11} BF16 {int(bf[0]):>9,} moved ({int(bf[1]):>8,} to peers)   MXFP8 {int(mx[0]):>9,} moved "
              f"({int(mx[1]):>8,} to peers)   ratio {mx[0] / bf[0]:.4f}")
    finals = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("bf16", "mxfp8"):
            path = Path(tmp) / f"{precision}.jsonl"
            cfg = TrainConfig(steps=a.steps, mesh="ep_mp=2", precision=precision, metrics_jsonl=str(path),
                              progress=False, log_every=10**9)
            s = spawn_ranks(train_rank, 2, cfg)[0]
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            last = rows[-20:]
            finals[precision] = (sum(r["loss"] for r in last) / len(last), rows[0]["loss"], s["step_seconds"])
    (bf, bf0, bft), (mx, mx0, mxt) = finals["bf16"], finals["mxfp8"]
    print(f"{a.steps}-step training of the demo model (2 ranks, ep_mp=2; loss = mean of the last 20 steps)")
    print(f"  BF16   loss {bf0:.4f} → {bf:.4f}   step {bft * 1e3:.0f} ms")
    print(f"  MXFP8  loss {mx0:.4f} → {mx:.4f}   step {mxt * 1e3:.0f} ms")
    print(f"  final-loss difference {100 * (mx - bf) / bf:+.2f}% (target within ±2%)")


if __name__ == "__main__":
    main()
