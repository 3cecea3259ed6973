"""Codegen: option resolution, and the whole program on generated Triton kernels.

End to end (2 spawned CPU ranks, Triton interpreter, fp32): forward + backward of the reference
model with codegen="triton" equals codegen="torch" over ep_mp=2 (symmetric transport, lease ops
placed around the lowered ops), and equals the dense model over ep_mp=1, dp=2 (dispatch/combine
elided) — loss within 1e-6 relative, every reduced gradient within rel_err ≤ 1e-5. The lowered graphs hold moe_triton:: ops,
``kernels()`` lists every launch per MoE layer, and the debug dump writes the kernel sources.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest

from moe_compile import MeshSpec, moe_compile
from moe_compile.codegen import triton_mode
from moe_compile.errors import OptionError
from moe_compile.ops import op_name, op_namespace
from moe_compile.options import CompileOptions

from .common import build_model, dense_reference, make_batches, rel_err
from .harness import run_ranks

TOL = 1e-5


def test_codegen_option_resolution(monkeypatch):
    monkeypatch.setattr(triton_mode, "_mode", "native")  # whatever this process chose stays untouched
    assert triton_mode.resolve_codegen("torch", "cuda") == "torch"
    assert triton_mode.resolve_codegen("auto", "cpu") == "torch"  # CPU default: torch ops
    assert triton_mode.resolve_codegen("auto", "cuda") == "triton"  # GPU default (triton is a test extra)
    with pytest.raises(OptionError, match="codegen='cuda'"):
        CompileOptions(codegen="cuda")
    # the interpreter is a per-process decision: no silent switch either way
    with pytest.raises(OptionError, match="needs the Triton interpreter"):
        triton_mode.use_triton("cpu")
    monkeypatch.setattr(triton_mode, "_mode", "interpret")
    monkeypatch.setattr(triton_mode, "_user_interpret", False)
    with pytest.raises(OptionError, match="needs native Triton kernels"):
        triton_mode.use_triton("cuda")
    monkeypatch.setattr(triton_mode, "_user_interpret", True)  # TRITON_INTERPRET=1 by the user: both interpret
    assert triton_mode.use_triton("cuda") == "interpret"
    monkeypatch.setattr(triton_mode, "triton_available", lambda: False)
    with pytest.raises(OptionError, match="needs the triton package"):
        triton_mode.resolve_codegen("triton", "cpu")


def _step(cm, batch):
    out = cm(input_ids=batch, labels=batch)
    out.loss.backward()
    return out.loss.item(), cm.full_grads()


def codegen_worker(rank: int, world: int, debug_dir: str) -> dict:
    res = {}
    model = build_model("tiny")
    batches = make_batches(world, 2, 16, seed=5)
    dense_losses, dense_grads = dense_reference(model, batches)
    for mesh in ("ep_mp=2", "ep_mp=1"):
        spec = MeshSpec.parse(mesh).resolve(world)
        ref = None
        if mesh == "ep_mp=2":
            ref = moe_compile(copy.deepcopy(model), spec, codegen="torch")
            loss_ref, grads_ref = _step(ref, batches[rank])
        else:  # (one compile less: the dense model is the reference, as in the parity tests)
            loss_ref, grads_ref = dense_losses[rank], dense_grads
        dbg = os.path.join(debug_dir, mesh) if mesh == "ep_mp=2" else None  # one dir: each rank dumps to rank<r>/
        cm = moe_compile(copy.deepcopy(model), spec, codegen="triton", debug_dir=dbg)
        loss, grads = _step(cm, batches[rank])
        graphs = cm.graphs()
        kernels = cm.kernels()
        res[mesh] = {
            "codegen": cm.program.codegen,
            "transport": cm.program.transport,
            "loss": (loss, loss_ref),
            "grad_err": max(rel_err(grads[n], grads_ref[n]) for n in grads_ref),
            "ops": {k: sorted({f"{op_namespace(n.target)}::{op_name(n.target)}" for n in graphs[k].graph.nodes
                              if n.op == "call_function" and op_name(n.target)}) for k in ("forward", "backward")},
            "kernels": {b: [(k["graph"], k["op"], k["name"], k["grid"]) for k in ks] for b, ks in kernels.items()},
            "torch_kernels": ref.kernels() if ref is not None else None,
            "dumped": sorted(os.listdir(os.path.join(dbg, f"rank{rank}", "kernels"))) if dbg else [],
        }
        if ref is not None:
            ref.close()
        cm.close()
    return res


@pytest.mark.slow
def test_triton_codegen_matches_torch_codegen_on_two_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(codegen_worker, 2, tmp)
    for rank, per_mesh in enumerate(results):
        for mesh, r in per_mesh.items():
            where = (rank, mesh)
            assert r["codegen"] == "triton", where
            loss, loss_ref = r["loss"]
            assert abs(loss - loss_ref) <= 1e-6 * max(1.0, abs(loss_ref)), (where, r["loss"])
            assert r["grad_err"] <= TOL, (where, r["grad_err"])
            fwd, bwd = r["ops"]["forward"], r["ops"]["backward"]
            for op in ("permute", "grouped_ffn", "unpermute"):
                assert f"moe_triton::{op}" in fwd and f"moe::{op}" not in fwd, (where, fwd)
            for op in ("permute_backward", "grouped_ffn_backward", "unpermute_backward"):
                assert f"moe_triton::{op}" in bwd and f"moe::{op}" not in bwd, (where, bwd)
            assert "moe::router" in fwd  # no Triton lowering: keeps its torch kernel
            if mesh == "ep_mp=2":
                assert r["transport"] == "symmetric" and "moe::dispatch" in fwd and "moe::lease_check" in fwd
                assert "grouped_gemm.py" in r["dumped"] and "forward_launches.txt" in r["dumped"], r["dumped"]
            else:
                assert "moe::dispatch" not in fwd  # one-rank EP group: elided
            assert set(r["kernels"]) == {"layers.0.mlp", "layers.1.mlp"}
            if r["torch_kernels"] is not None:
                assert all(not ks for ks in r["torch_kernels"].values())  # torch codegen generates none
            for ks in r["kernels"].values():
                names = {(g, n) for g, _, n, _ in ks}
                assert ("forward", "grouped_mm_kernel") in names and ("backward", "grouped_mm_wgrad_kernel") in names
                assert ("forward", "route_rows_kernel") in names and ("forward", "unpermute_kernel") in names
                assert all(grid is not None and min(grid) >= 1 for *_, grid in ks)  # fixed config: grid known


def test_gpu_benchmark_smoke_run_and_no_gpu_message():
    """benchmarks/gpu_kernels.py: its checks pass under the interpreter (--smoke, tiny shapes), and
    without a GPU the plain command says so and exits 0."""
    import subprocess
    import sys

    import torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    script = os.path.join(root, "benchmarks", "gpu_kernels.py")
    smoke = subprocess.run([sys.executable, script, "--smoke"], cwd=root, env=env, capture_output=True, text=True,
                           timeout=300)
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert "| grouped GEMM up (bf16) |" in smoke.stdout and "MISMATCH" not in smoke.stdout
    assert "| MXFP8 quantise (packed rows) |" in smoke.stdout and "| MXFP8 grouped GEMM up (dot_scaled) |" in smoke.stdout
    if not torch.cuda.is_available():
        plain = subprocess.run([sys.executable, script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert plain.returncode == 0 and "no GPU" in plain.stdout, plain.stdout + plain.stderr


def mx_codegen_worker(rank: int, world: int) -> dict:
    """One process: the MXFP8 expert path on Triton kernels (quantise, SwiGLU+quantise, dot_scaled
    grouped GEMM, under the interpreter) vs the emulated torch path."""
    b = make_batches(1, seed=9)[0]
    out = {}
    for codegen in ("torch", "triton"):
        cm = moe_compile(build_model("tiny", lb_coef=0.0, z_coef=0.0), mxfp8="experts", codegen=codegen)
        out[codegen] = _step(cm, b)
        if codegen == "triton":
            ops = {op_name(n.target) for n in cm.graphs()["forward"].graph.nodes
                   if n.op == "call_function" and op_namespace(n.target) == "moe_triton"}
            out["ops"] = ops
            out["kernels"] = sorted({k["name"] for per in cm.kernels().values() for k in per})
            out["quantize_activations"] = {k["specialisation"]["activation"] for per in cm.kernels().values()
                                           for k in per if k["name"] == "_quantize_kernel"}
    (lt, gt), (lx, gx) = out["torch"], out["triton"]
    return {"loss": abs(lt - lx) / abs(lt), "grad": max(rel_err(gx[k], gt[k]) for k in gt), "ops": out["ops"],
            "kernels": out["kernels"],
            "quantize_activations": out["quantize_activations"]}


@pytest.mark.slow
def test_mxfp8_experts_on_triton_kernels():
    from moe_compile.runtime.launcher import spawn_ranks

    r = spawn_ranks(mx_codegen_worker, 1)[0]
    assert {"quantize_mx", "grouped_ffn_mx"} <= r["ops"], r
    assert {"_quantize_kernel", "_grouped_gemm_kernel"} <= set(r["kernels"]), r
    assert {"none", "silu"} <= r["quantize_activations"], r  # dispatch rows plain, the activation fused
    # The same MXFP8 values meet the same products; silu/exp in the fused kernel can differ from torch's
    # by an ulp, which can move an activation across one E4M3 rounding step — hence a loose bound.
    assert r["loss"] <= 1e-3 and r["grad"] <= 5e-2, r
