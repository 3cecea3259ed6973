"""One-rank training step (fwd + bwd + SGD) of an OLMoE-like model, one run, ratios on this machine:

    hf_eager          transformers OlmoeForCausalLM as it is (its default experts implementation)
    torch_compile     torch.compile(model): inductor on the plain model (the single-device reference)
    moe_none          moe_compile(model, dense_fusion="none")
    moe_inductor      moe_compile(model, dense_fusion="inductor")
    gemm_floor        Σ self CPU time of aten::mm/addmm/_grouped_mm in a profiled moe_none step (not bmm: see
                      GEMM_OPS)
    gemm_attn_floor   gemm_floor + the SDPA kernels' self time (forward and backward): attention's matrix
                      products run inside them (with their softmax), so this bounds a floor that counts them

Model: 4 layers, d=256, 16 experts, top-8 (as OLMoE), h_e=32, vocab 256; batch 4×256 tokens, fp32.
Each path runs in its own process (compiles there, then waits); the parent asks them for timed steps
round-robin, so machine drift hits every path alike; figures are medians over rounds.

    python benchmarks/one_rank_step.py [--rounds 7] [--steps 2] [--threads 1] [--device cpu] [--json out.json]
                                       [--keep-freed-memory]

Each path also reports its minor page faults per step: glibc returns freed blocks of several MB to the
OS, so the next step's [T·K, d] buffers are faulted in (and zeroed by the kernel) again.
``--keep-freed-memory`` runs the workers with glibc's MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_
raised so freed memory stays in the process: the same programs, without that cost (a process-wide
allocator setting, so it is the user's to make, not moe_compile's).

``--device cuda`` runs every path on the GPU (benchmarks/gpu_check.py's dense_fusion part: the measurement
that chooses dense_fusion="auto" on CUDA); the floors then sum the GEMM and attention ops' device time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PATHS = ("hf_eager", "torch_compile", "moe_none", "moe_inductor")
# aten::bmm is not counted: in these steps its only caller is moe::unpermute_backward's router-weight
# gradient, [T·K, 1, d]·[T·K, d, 1] row dot products (a reduction written as a bmm, 7 ms of a default-size
# step); attention's products run inside the SDPA kernels (ATTENTION_OPS), the expert GEMMs as mm calls
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::_grouped_mm")
ATTENTION_OPS = tuple(f"aten::_scaled_dot_product_{k}{b}" for k in ("flash_attention_for_cpu", "flash_attention",
                                                                     "efficient_attention", "cudnn_attention")
                      for b in ("", "_backward"))
# on CUDA the attention kernels' device time sits on the ops that launch them (the sdpa ops' self time is ~0)
ATTENTION_OPS += tuple(f"aten::_{k}_attention_{d}" for k in ("flash", "efficient") for d in ("forward", "backward"))


def is_gemm(key: str, device: str) -> bool:
    """A GEMM op; on CUDA also moe_compile's Triton grouped-GEMM kernels (no aten op launches them)."""
    return key in GEMM_OPS or (device == "cuda" and "grouped_mm" in key and key.endswith("_kernel"))


def build(path: str, args):
    import torch

    from moe_compile.models.hf import tiny_hf_model

    torch.manual_seed(0)
    model = tiny_hf_model("olmoe", layers=args.layers, d=args.d, experts=args.experts, top_k=args.top_k,
                          hidden=args.h_e).to(args.device)
    impl = getattr(model.config, "_experts_implementation", None)
    if path == "torch_compile":
        model = torch.compile(model)
    elif path.startswith("moe_"):
        from moe_compile import moe_compile

        model = moe_compile(model, dense_fusion=path[len("moe_"):])
    x = torch.randint(3, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, impl


def gemm_seconds(step, steps: int, device: str = "cpu") -> tuple[float, float, list]:
    """Σ self time per step (CPU time, or the device time of their kernels on CUDA) of the GEMM ops and
    of the attention kernels, from the profiler; and the top ops by that self time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()

    def self_us(e) -> float:
        return e.self_device_time_total if device == "cuda" else e.self_cpu_time_total

    ev = sorted(prof.key_averages(), key=lambda e: -self_us(e))
    us = sum(self_us(e) for e in ev if is_gemm(e.key, device))
    attn = sum(self_us(e) for e in ev if e.key in ATTENTION_OPS)
    return us / 1e6 / steps, attn / 1e6 / steps, [(e.key, self_us(e) / 1e6 / steps, e.count // steps) for e in ev[:12]]


def top_ops(tops: list[dict]) -> list:
    """(op, median self seconds per step, calls per step) of the ops in the rounds' top lists."""
    names = {n for t in tops for n in t}
    rows = [(n, statistics.median(t.get(n, (0.0, 0))[0] for t in tops), max(t.get(n, (0, 0))[1] for t in tops))
            for n in names]
    return sorted(rows, key=lambda r: -r[1])[:12]


def worker(path: str, args) -> None:
    """Compile and warm up, then answer the parent's commands: 'step' (seconds per step), 'gemm', 'quit'."""
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    step, impl = build(path, args)
    loss = [step() for _ in range(3)][-1]
    print(json.dumps({"ready": time.perf_counter() - t0, "loss": loss, "experts_impl": impl,
                      "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd == "gemm":
            gemm, attn, top = gemm_seconds(step, args.steps, args.device)
            out = {"gemm": gemm, "attention": attn, "top": top}
        else:
            flt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            out = {"s": (time.perf_counter() - t) / args.steps,
                   "minflt": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt) / args.steps}
        print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed sample")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per path (1: the CPUs are shared)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--h-e", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="workers keep freed memory (glibc malloc thresholds raised): no page faults per step")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args)
    keys = ("steps", "threads", "layers", "d", "experts", "top_k", "h_e", "batch", "seq", "device")
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    env = {"OMP_NUM_THREADS": str(args.threads)}
    if args.keep_freed_memory:  # 4 GiB: above any buffer here, so glibc neither mmaps nor trims them
        env.update(MALLOC_MMAP_THRESHOLD_=str(4 << 30), MALLOC_TRIM_THRESHOLD_=str(4 << 30))
    procs = {}
    ready = {}
    for p in args.paths.split(","):  # one at a time: compiles do not overlap each other or the timing
        procs[p] = subprocess.Popen([sys.executable, __file__, "--worker", p, *forwarded], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        ready[p] = json.loads(procs[p].stdout.readline())
        print(f"{p}: ready after {ready[p]['ready']:.1f} s, loss {ready[p]['loss']:.4f}", flush=True)

    def ask(p: str, cmd: str) -> float:
        procs[p].stdin.write(cmd + "\n")
        procs[p].stdin.flush()
        return json.loads(procs[p].stdout.readline())

    samples: dict[str, list[float]] = {p: [] for p in procs}
    samples["gemm_floor"], samples["gemm_attn_floor"] = [], []
    faults: dict[str, list[float]] = {p: [] for p in procs}
    tops: list[dict] = []  # per profiled round: op → (self seconds per step, calls per step)
    for _ in range(args.rounds):
        for p in procs:
            r = ask(p, "step")
            samples[p].append(r["s"])
            faults[p].append(r["minflt"])
        if "moe_none" in procs:
            prof = ask("moe_none", "gemm")
            samples["gemm_floor"].append(prof["gemm"])
            samples["gemm_attn_floor"].append(prof["gemm"] + prof["attention"])
            tops.append({name: (sec, calls) for name, sec, calls in prof["top"]})
    for p in procs:
        procs[p].stdin.write("quit\n")
        procs[p].stdin.close()
        procs[p].wait()
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    res = {"config": {k: getattr(args, k) for k in ("layers", "d", "experts", "top_k", "h_e", "batch", "seq",
                                                     "threads", "rounds", "steps", "device")},
           "experts_impl": ready.get("hf_eager", {}).get("experts_impl"),
           "compile_seconds": {p: r["ready"] for p, r in ready.items()},
           "keep_freed_memory": args.keep_freed_memory,
           "step_seconds": med, "samples": samples,
           "minor_faults_per_step": {p: statistics.median(v) for p, v in faults.items()},
           "moe_none_top_self_cpu": top_ops(tops)}
    ratios = {}
    for p in ("torch_compile", "moe_none", "moe_inductor"):
        if p in med and "hf_eager" in med:
            ratios[f"{p}/hf_eager"] = med[p] / med["hf_eager"]
    for floor in ("gemm_floor", "gemm_attn_floor"):
        for p in ("moe_none", "moe_inductor", "torch_compile"):
            if p in med and floor in med:
                ratios[f"{p}/{floor}"] = med[p] / med[floor]
    res["ratios"] = ratios
    lo = {k: min(v) for k, v in samples.items() if v}  # the least disturbed sample (a shared machine)
    res["ratios_of_min"] = {k: lo[k.split("/")[0]] / lo[k.split("/")[1]] for k in ratios}
    for k, v in med.items():
        flt = f", {res['minor_faults_per_step'][k]:7.0f} page faults/step" if k in faults else ""
        print(f"{k:>14}: {1000 * v:8.1f} ms median, {1000 * min(samples[k]):8.1f} ms min{flt}")
    for k, v in ratios.items():
        print(f"{k:>26}: {v:.3f} of medians, {res['ratios_of_min'][k]:.3f} of minima")
    if res["moe_none_top_self_cpu"]:
        print(f"moe_none, top self {'CUDA' if args.device == 'cuda' else 'CPU'} time per step (median over profiled rounds):")
        for name, sec, calls in res["moe_none_top_self_cpu"]:
            print(f"  {name:<48} {1000 * sec:8.1f} ms  {calls:5d} calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
