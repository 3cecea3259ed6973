"""GPU benchmark of the generated Triton kernels, one run: build, check against torch, time.

At OLMoE-like shapes (d=2048, h_e=1024, N=64 experts, K=8, a few thousand tokens; one rank holding
every expert, so the receive buffer is the permuted input), bf16 unless stated:

* grouped GEMMs: TFLOP/s of the Triton kernel vs torch's grouped mm on the same operands;
* MXFP8 grouped GEMM (``tl.dot_scaled`` on packed qdata–scale rows): TFLOP/s vs the bf16 grouped mm;
* permute / unpermute-combine / SwiGLU / MXFP8 quantise: GB/s vs a device-to-device copy of the same bytes (the
  bandwidth ceiling), and the torch op's time for reference.

    python benchmarks/gpu_kernels.py [--tokens 4096] [--json out.json]
    python benchmarks/gpu_kernels.py --smoke     # tiny shapes under the Triton interpreter (CPU):
                                                 # checks only, timings meaningless

Without a GPU (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def torch_grouped_mm() -> tuple[str, Callable]:
    """torch's grouped GEMM of this version (feature-detected), as fn(a, b, offs_int32)."""
    fn = getattr(F, "grouped_mm", None)
    if fn is not None:
        return "F.grouped_mm", lambda a, b, offs: fn(a, b, offs=offs)
    fn = getattr(torch, "_grouped_mm", None)
    if fn is not None:
        return "torch._grouped_mm", lambda a, b, offs: fn(a, b, offs=offs)
    return "per-expert mm loop", None


LAST_PATH: list[str] = [""]  # which torch path torch_gmm took last (its label in the table)


def torch_gmm(a, b, counts):
    """torch's grouped mm over expert counts (a [M, K] · b [G, K, N], or aᵀ-form [K, M] · [M, N])."""
    name, fn = torch_grouped_mm()
    offs = torch.cumsum(counts, 0).to(torch.int32)
    if fn is not None:
        try:
            out = fn(a, b, offs)
            LAST_PATH[0] = name
            return out
        except (RuntimeError, NotImplementedError):  # e.g. no fp32 kernel on this device / version
            pass
    LAST_PATH[0] = "per-expert mm loop"
    sizes = counts.tolist()
    if b.dim() == 3:
        return torch.cat([ai @ b[g] for g, ai in enumerate(a.split(sizes, 0))])
    return torch.stack([ai @ bi for ai, bi in zip(a.split(sizes, 1), b.split(sizes, 0))])


def timer(device: str) -> Callable[[Callable], float]:
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=50))

    def wall(fn):  # interpreter smoke run: one call, wall clock (not a measurement)
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return wall


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.float().abs().max().item()
    return (a.float() - b.float()).abs().max().item() / (scale or 1.0)


def run(tokens: int, d: int, h: int, experts: int, top_k: int, device: str) -> list[dict]:
    from moe_compile.codegen.triton_mode import kernel_module, use_triton
    from moe_compile.mxfp8 import dequantize_packed, packed_width, quantize_packed

    use_triton(device)
    pm, um, gg, sw, mx = (kernel_module(f) for f in ("permute", "unpermute", "grouped_gemm", "swiglu", "mxfp8"))
    bench = timer(device)
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d, device=device, generator=g).to(dt)
    logits = torch.randn(tokens, experts, device=device, generator=g)
    weights, idx = torch.softmax(logits, -1).topk(top_k, dim=-1)
    r = tokens * top_k
    w_in = (torch.randn(experts, 2 * h, d, device=device, generator=g) * d ** -0.5).to(dt)
    w_out = (torch.randn(experts, d, h, device=device, generator=g) * h ** -0.5).to(dt)
    rows: list[dict] = []

    def add(name, shape, ms, unit, work, base_name, base_ms, err, tol):
        """work: bytes (unit GB/s) or flops (unit TFLOP/s) of the kernel; the torch path does the same."""
        scale = 1e6 if unit == "GB/s" else 1e9
        rows.append(dict(kernel=name, shape=shape, ms=ms, unit=unit, rate=work / ms / scale, torch=base_name,
                         torch_ms=base_ms, torch_rate=work / base_ms / scale if base_ms else None, err=err,
                         ok=err <= tol))

    copy_src = torch.empty(r, d, device=device, dtype=dt)
    copy_dst = torch.empty_like(copy_src)
    copy_ms = bench(lambda: copy_dst.copy_(copy_src))
    copy_gbs = 2 * copy_src.numel() * copy_src.element_size() / copy_ms / 1e6  # read + write
    esz = x.element_size()

    # permute: route map (counts, offsets, stable order) + gather into expert order
    xs, order, counts = pm.permute(x, idx, experts)
    ref = torch.ops.moe.permute(x, idx, experts, "bench")
    err = max(float(not torch.equal(a, b)) for a, b in zip((xs, order, counts), ref))
    ms = bench(lambda: pm.permute(x, idx, experts))
    add("route map + permute", f"T={tokens} K={top_k} d={d} N={experts}", ms, "GB/s", 2 * r * d * esz,
        "moe::permute", bench(lambda: torch.ops.moe.permute(x, idx, experts, "bench")), err, 0.0)

    # grouped GEMM, up projection: recv [R, d] · w_inᵀ → pre [R, 2h]
    flop_up = 2 * r * d * 2 * h
    pre = gg.grouped_mm(xs, w_in.transpose(1, 2), counts)
    ref_pre = torch_gmm(xs, w_in.transpose(1, 2), counts)
    ms = bench(lambda: gg.grouped_mm(xs, w_in.transpose(1, 2), counts))
    base = bench(lambda: torch_gmm(xs, w_in.transpose(1, 2), counts))
    add("grouped GEMM up (bf16)", f"R={r} d={d} 2h={2 * h} L={experts}", ms, "TFLOP/s", flop_up,
        LAST_PATH[0], base, rel(pre, ref_pre), 2e-2)
    up_path, up_ms = LAST_PATH[0], base
    xs32, w_in32 = xs.float(), w_in.float()
    err = rel(gg.grouped_mm(xs32, w_in32.transpose(1, 2), counts), torch_gmm(xs32, w_in32.transpose(1, 2), counts))
    ms = bench(lambda: gg.grouped_mm(xs32, w_in32.transpose(1, 2), counts))
    base = bench(lambda: torch_gmm(xs32, w_in32.transpose(1, 2), counts))
    add("grouped GEMM up (fp32)", f"R={r} d={d} 2h={2 * h} L={experts}", ms, "TFLOP/s", flop_up,
        LAST_PATH[0], base, err, 1e-4)

    # SwiGLU over the valid prefix, standalone
    a = sw.swiglu(pre, counts, "silu", True)
    gate, up = pre.chunk(2, dim=-1)
    ms = bench(lambda: sw.swiglu(pre, counts, "silu", True))
    base = bench(lambda: F.silu(gate) * up)
    add("SwiGLU", f"R={r} h={h}", ms, "GB/s", 3 * r * h * esz, "F.silu(g)·u", base, rel(a, F.silu(gate) * up), 2e-2)

    # MXFP8: quantise into packed qdata–scale rows (bit-exact with the torch reference), and the grouped
    # GEMM on packed operands (tl.dot_scaled) against the bf16 grouped mm of the same shape
    q = mx.quantize(xs)
    ms = bench(lambda: mx.quantize(xs))
    add("MXFP8 quantise (packed rows)", f"R={r} d={d}", ms, "GB/s", r * d * esz + r * packed_width(d),
        "mxfp8.quantize_packed", bench(lambda: quantize_packed(xs)), float(not torch.equal(q, quantize_packed(xs))),
        0.0)
    w_in_q = quantize_packed(w_in)
    ref_mx = torch_gmm(dequantize_packed(q, d), dequantize_packed(w_in_q, d).transpose(1, 2), counts).to(dt)
    err = rel(mx.grouped_gemm(q, w_in_q, counts, dt), ref_mx)
    ms = bench(lambda: mx.grouped_gemm(q, w_in_q, counts, dt))
    add("MXFP8 grouped GEMM up (dot_scaled)", f"R={r} d={d} 2h={2 * h} L={experts}", ms, "TFLOP/s", flop_up,
        "bf16 " + up_path, up_ms, err, 2e-2)

    # grouped GEMM, down projection with SwiGLU fused in its prologue vs torch SwiGLU + grouped mm
    flop_down = 2 * r * h * d
    out = gg.grouped_mm(pre, w_out.transpose(1, 2), counts, prologue="gated")
    err = rel(out, torch_gmm(F.silu(gate) * up, w_out.transpose(1, 2), counts))
    ms = bench(lambda: gg.grouped_mm(pre, w_out.transpose(1, 2), counts, prologue="gated"))
    base = bench(lambda: torch_gmm(F.silu(gate) * up, w_out.transpose(1, 2), counts))
    add("SwiGLU ⊕ grouped GEMM down", f"R={r} h={h} d={d}", ms, "TFLOP/s", flop_down,
        "SwiGLU + " + LAST_PATH[0], base, err, 2e-2)
    fused_ms = ms
    ms = bench(lambda: gg.grouped_mm(sw.swiglu(pre, counts, "silu", True), w_out.transpose(1, 2), counts))
    add("  unfused: SwiGLU kernel + GEMM", f"R={r} h={h} d={d}", ms, "TFLOP/s", flop_down,
        "Triton fused (row above)", fused_ms, 0.0, 0.0)

    # backward: grad a with the SwiGLU backward fused in the epilogue; weight gradient (wgrad)
    go = torch.randn(r, d, device=device, generator=g).to(dt)

    def torch_grad_pre():
        ga = torch_gmm(go, w_out, counts)
        return torch.cat([torch.ops.aten.silu_backward(ga * up, gate), ga * F.silu(gate)], 1)

    err = rel(gg.grouped_mm(go, w_out, counts, epilogue="gated_backward", e=pre), torch_grad_pre())
    ms = bench(lambda: gg.grouped_mm(go, w_out, counts, epilogue="gated_backward", e=pre))
    base = bench(torch_grad_pre)
    add("grouped GEMM grad-a ⊕ SwiGLU bwd", f"R={r} d={d} h={h}", ms, "TFLOP/s", flop_down,
        LAST_PATH[0] + " + SwiGLU bwd", base, err, 3e-2)
    err = rel(gg.grouped_mm_wgrad(go, a, counts), torch_gmm(go.t(), a, counts))
    ms = bench(lambda: gg.grouped_mm_wgrad(go, a, counts))
    base = bench(lambda: torch_gmm(go.t(), a, counts))
    add("grouped GEMM wgrad (down)", f"R={r} d={d} h={h} L={experts}", ms, "TFLOP/s", flop_down,
        LAST_PATH[0], base, err, 3e-2)

    # unpermute-combine: router-weighted, deterministic accumulation into token order
    y = um.unpermute(xs, order, weights)
    ms = bench(lambda: um.unpermute(xs, order, weights))
    add("unpermute-combine", f"R={r} T={tokens} d={d}", ms, "GB/s", (r + tokens) * d * esz,
        "moe::unpermute", bench(lambda: torch.ops.moe.unpermute(xs, order, weights, "bench")),
        rel(y, torch.ops.moe.unpermute(xs, order, weights, "bench")), 2e-2)
    rows.append(dict(kernel="device-to-device copy", shape=f"{r}x{d}", ms=copy_ms, unit="GB/s", rate=copy_gbs,
                     torch="", torch_ms=None, torch_rate=None, err=0.0, ok=True))
    for row in rows:
        row["of_ceiling"] = row["rate"] / copy_gbs if row["unit"] == "GB/s" else None
    return rows


def print_table(rows: list[dict], device: str) -> None:
    print(f"| kernel ({device}) | shape | Triton ms | Triton rate | torch path | torch ms | torch rate "
          "| vs torch | of copy GB/s | check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['rate'] / r['torch_rate']:.2f}" if r["torch_rate"] else ""
        t_ms = f"{r['torch_ms']:.3f}" if r["torch_ms"] is not None else ""
        t_rate = f"{r['torch_rate']:.1f}" if r["torch_rate"] is not None else ""
        ceil = f"{r['of_ceiling']:.2f}" if r["of_ceiling"] is not None else ""
        check = "ok" if r["ok"] else f"MISMATCH {r['err']:.2g}"
        print(f"| {r['kernel']} | {r['shape']} | {r['ms']:.3f} | {r['rate']:.1f} {r['unit']} | {r['torch']} | {t_ms} "
              f"| {t_rate} | {ratio} | {ceil} | {check} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes under the Triton interpreter (CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        device, shape = "cpu", dict(tokens=48, d=64, h=64, experts=8, top_k=2)
    elif not torch.cuda.is_available():
        print("gpu_kernels: no GPU here (torch.cuda.is_available() is False); the Triton kernel benchmark "
              "needs one. Nothing was measured. (--smoke checks the kernels under the interpreter.)")
        return 0
    else:
        device, shape = "cuda", dict(tokens=args.tokens, d=2048, h=1024, experts=64, top_k=8)
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'Triton interpreter (timings not meaningful)'}")
    import moe_compile  # noqa: F401  (registers the moe:: reference ops)

    rows = run(device=device, **shape)
    print_table(rows, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
