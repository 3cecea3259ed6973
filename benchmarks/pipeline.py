"""Pipeline schedules on 4 CPU ranks (pp=2 × ep_mp=2), one run, ratios on the same machine.

For GPipe, 1F1B and Interleaved1F1B (the tiny LM, 4 layers, m microbatches per step):

* step time of ``cm.train_step`` (median over steps after the first), as a ratio to 1F1B's;
* peak saved-activation bytes per stage: every tensor autograd saves during the step is counted
  from its pack until it is freed (saved_tensors_hooks), the most live at once per rank;
* symmetric bytes of the lease pools with the schedule-aware plan (H_s instances per stage) vs a
  schedule-blind plan with one instance per microbatch in flight (H = m).

    python benchmarks/pipeline.py [--steps N] [--microbatches M] [--smoke] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class SavedBytes:
    """Live bytes of the tensors autograd holds for backward, and their peak."""

    def __init__(self, exclude: torch.nn.Module | None = None) -> None:
        self.live = 0
        self.peak = 0
        # weights autograd saves for their GEMMs' backward are persistent state, not activations
        self.skip = {p.untyped_storage().data_ptr() for p in exclude.parameters()} if exclude is not None else set()

    def pack(self, t: torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor) or t.device.type == "meta":  # tracing (the first step compiles)
            return t
        if t.untyped_storage().data_ptr() in self.skip:
            return _Box(t, 0, self)
        n = t.untyped_storage().nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        return _Box(t, n, self)

    def unpack(self, box):
        return box if isinstance(box, torch.Tensor) else box.t


class _Box:
    """What autograd keeps instead of a saved tensor: freed with the graph (or after its backward)."""

    def __init__(self, t, n, meter) -> None:
        self.t, self.n, self.meter = t, n, meter

    def __del__(self) -> None:
        self.meter.live -= self.n


def rank_main(rank: int, world: int, schedule: str, steps: int, m: int, layers: int, seq: int) -> dict:
    import dataclasses

    from moe_compile import MeshSpec, moe_compile
    from moe_compile.models import TinyMoEConfig, TinyMoELM

    torch.manual_seed(0)
    model = TinyMoELM(TinyMoEConfig(n_layers=layers, d_model=128, expert_hidden=128, max_seq_len=seq))
    spec = MeshSpec.parse("pp=2,ep_mp=2").resolve(world)
    cm = moe_compile(model, spec, microbatches=m, schedule=schedule)
    g = torch.Generator().manual_seed(1 + spec.dense_coords(rank)[1])
    batch = torch.randint(3, 256, (2 * m, seq), generator=g)
    meter = SavedBytes(cm.model)
    times = []
    for _ in range(steps):
        meter.peak = meter.live
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            cm.train_step(input_ids=batch, labels=batch)
        times.append(time.perf_counter() - t0)
        cm.model.zero_grad(set_to_none=True)
        if cm.ddp is not None:
            cm.ddp.zero_grad()
    plan = cm.lease_plan()
    aware = plan.symmetric_bytes if plan is not None else 0
    blind = dataclasses.replace(plan, in_flight={s: m for s in plan.in_flight}).symmetric_bytes if plan else 0
    out = {"rank": rank, "stages": cm.pipeline.local, "step_s": statistics.median(times[1:] or times),
           "peak_saved_bytes": meter.peak, "lease_bytes": aware, "lease_bytes_one_per_microbatch": blind,
           "in_flight": dict(plan.in_flight) if plan else {}}
    cm.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="2 steps, short sequences (a test runs this)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.seq_len = 2, 16
    sys.path.insert(0, str(ROOT))
    from moe_compile.runtime.launcher import spawn_ranks

    results = {}
    for name in SCHEDULES:
        ranks = spawn_ranks(rank_main, 4, name, args.steps, args.microbatches, args.layers, args.seq_len,
                            timeout=1200, env={"OMP_NUM_THREADS": "1"})
        by_stage = {}
        for r in ranks:
            for s in r["stages"]:
                by_stage.setdefault(s, r)
        results[name] = {
            "step_s": max(r["step_s"] for r in ranks),
            "peak_saved_bytes_per_rank": {r["rank"]: r["peak_saved_bytes"] for r in ranks},
            "lease_bytes_per_rank": {r["rank"]: r["lease_bytes"] for r in ranks},
            "lease_bytes_one_per_microbatch_per_rank": {r["rank"]: r["lease_bytes_one_per_microbatch"] for r in ranks},
            "in_flight": {s: r["in_flight"].get(s) for s, r in sorted(by_stage.items())},
        }
    base = results["1f1b"]
    report = {"config": vars(args), "schedules": results, "ratios": {}}
    for name, r in results.items():
        report["ratios"][name] = {
            "step_time_vs_1f1b": r["step_s"] / base["step_s"],
            "peak_saved_rank0_vs_1f1b": r["peak_saved_bytes_per_rank"][0] / max(1, base["peak_saved_bytes_per_rank"][0]),
            "lease_bytes_rank0_aware_vs_one_per_microbatch":
                r["lease_bytes_per_rank"][0] / max(1, r["lease_bytes_one_per_microbatch_per_rank"][0]),
        }
    return emit(report, args.json)


def emit(report: dict, path: str | None) -> int:
    """Print the report (JSON) and write it to ``path`` if given."""
    text = json.dumps(report, indent=1)
    print(text)
    if path:
        Path(path).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
