"""Activation memory per checkpointing mode vs HF eager training of the same model (one CPU rank, one run).

For an OLMoE-like transformers model (OlmoeForCausalLM, small config) and each
``activation_checkpointing`` mode (None | selective | moe | full), one training step after a warm-up:

* saved activations: every tensor autograd holds for backward, from its pack until it is freed
  (saved_tensors_hooks; parameters excluded), the most live at once — the activation peak;
* allocator peak: the CPU allocator's running total (torch.profiler memory events) over forward +
  backward, beyond what was allocated before (parameters, .grad buffers): the working-memory peak;
* the ledger's prediction of both (M_saved, M_working: liveness of the partitioned graphs).

Ratios are to HF eager (the uncompiled model, same batch, same weights). Target: selective ≤ 0.6× eager's
saved activations.

    python benchmarks/activation_memory.py [--seq-len S] [--batch B] [--layers L] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = (None, "selective", "moe", "full")


class SavedBytes:
    """Live bytes of the tensors autograd holds for backward (storages counted once), and their peak."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.live, self.peak, self.refs = 0, 0, {}
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights: persistent state

    def pack(self, t: torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor) or t.device.type == "meta":  # tracing (the first step compiles)
            return t
        key = t.untyped_storage().data_ptr()
        if key not in self.skip:
            if self.refs.get(key, 0) == 0:
                self.live += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.live)
            self.refs[key] = self.refs.get(key, 0) + 1
        return _Box(t, key, self)

    def unpack(self, box):
        return box if isinstance(box, torch.Tensor) else box.t


class _Box:
    def __init__(self, t, key, meter) -> None:
        self.t, self.key, self.meter, self.n = t, key, meter, t.untyped_storage().nbytes()

    def __del__(self) -> None:
        m = self.meter
        if self.key in m.refs:
            m.refs[self.key] -= 1
            if m.refs[self.key] == 0:
                del m.refs[self.key]
                m.live -= self.n


def measure(step, model: torch.nn.Module) -> dict:
    """Saved-activation peak and allocator peak of one ``step()`` (forward + backward)."""
    from torch.profiler import ProfilerActivity, profile

    from moe_compile.ledger.memory import allocator_peak

    meter = SavedBytes(model)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            loss = step()
    return {"saved_peak": meter.peak, "allocator_peak": allocator_peak(prof), "loss": loss}


def rank_main(rank: int, world: int, seq: int, batch: int, layers: int) -> dict:
    from moe_compile import MeshSpec, moe_compile
    from moe_compile.models import tiny_hf_model

    base = tiny_hf_model("olmoe", seed=0, vocab=256, num_hidden_layers=layers)
    ids = torch.randint(3, 256, (batch, seq), generator=torch.Generator().manual_seed(1))
    out = {}
    eager = copy.deepcopy(base)

    def eager_step():
        loss = eager(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item()

    eager_step()  # warm-up: .grad buffers exist before the measured step
    out["hf_eager"] = measure(eager_step, eager)
    for mode in MODES:
        cm = moe_compile(copy.deepcopy(base), MeshSpec(), activation_checkpointing=mode)

        def step(cm=cm):
            loss = cm(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.item()

        step()  # compile
        r = measure(step, cm.model)
        led = cm.ledger()
        r.update(predicted_saved=led["M_saved"], predicted_working=led["M_working"],
                 recomputed_ops=led["N_recomputed"])
        out[str(mode)] = r
        cm.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from moe_compile.runtime.launcher import spawn_ranks

    runs = spawn_ranks(rank_main, 1, args.seq_len, args.batch, args.layers, timeout=1200,
                       env={"OMP_NUM_THREADS": "1"})[0]
    eager = runs["hf_eager"]
    report = {"config": vars(args), "runs": runs, "ratios_vs_hf_eager": {
        mode: {"saved_peak": r["saved_peak"] / eager["saved_peak"],
               "allocator_peak": r["allocator_peak"] / eager["allocator_peak"]}
        for mode, r in runs.items() if mode != "hf_eager"}}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    sel = report["ratios_vs_hf_eager"]["selective"]["saved_peak"]
    print(f"selective / HF eager saved activations = {sel:.3f} (target ≤ 0.6)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
