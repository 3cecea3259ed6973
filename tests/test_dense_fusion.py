"""Dense fusion (dense_fusion="inductor"): the dense segments of the lowered graphs run as inductor
kernels, the moe:: / lease / transport ops stay opaque nodes in their order, and loss and gradients
match the dense model (fp32, 1e-5) on two EP ranks (symmetric transport: lease ops; one test, since a cold
inductor compile costs minutes on 2 cores)."""

from __future__ import annotations

import operator

import pytest
import torch

from moe_compile import moe_compile
from moe_compile.codegen.dense_fusion import cpp_compiler, resolve_dense_fusion, split_segments
from moe_compile.errors import OptionError
from moe_compile.ops import op_namespace

from .common import build_model, dense_reference, make_batches, rel_err
from .harness import run_ranks

TOL = 1e-5
SMALL = dict(n_layers=1, d_model=32, expert_hidden=32)  # one layer: the fewest segments to compile
needs_cxx = pytest.mark.skipif(cpp_compiler() is None, reason="inductor on CPU needs a C++ compiler")


def opaque_order(gm: torch.fx.GraphModule) -> list[str]:
    """Targets of the non-aten call nodes, in graph order (what must run eagerly, in this order)."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
            and getattr(n.target, "namespace", None) not in ("aten", "prims")]


def fusion_worker(rank: int, world: int, mesh: str | None) -> dict:
    from moe_compile import MeshSpec

    model = build_model("tiny", **SMALL)
    batches = make_batches(world, 2, 16, seed=3)
    ref_losses, ref_grads = dense_reference(model, batches)
    kw = {} if mesh is None else {"mesh": MeshSpec.parse(mesh).resolve(world)}
    cm = moe_compile(model, dense_fusion="inductor", **kw)
    with torch._inductor.config.patch(compile_threads=1):  # no compile-worker pool to start on 2 cores
        res = cm(input_ids=batches[rank], labels=batches[rank])
        res.loss.backward()
    grads = cm.full_grads()
    out = {"loss": res.loss.item(), "ref_loss": ref_losses[rank],
           "grad_err": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads), "graphs": {}}
    for kind in ("forward", "backward"):
        gm = cm.program.graphs[kind]
        info = gm.meta["moe_dense_fusion"]
        inside = [n for seg in split_segments(gm) for n in seg]
        out["graphs"][kind] = {
            "segments": info["segments"],
            "pure_segments": all(n.target is operator.getitem or n.target.namespace in ("aten", "prims") for n in inside)
            and not any(op_namespace(n.target) for n in inside),
            "moe_ops": sorted({str(n.target) for n in gm.graph.nodes if op_namespace(n.target)}),
            "order_kept": opaque_order(gm) == opaque_order(info["executable"]),
            "leases": sum("lease_" in t for t in opaque_order(info["executable"])),
        }
    cm.close()
    return out


def check(r: dict, leases: bool) -> None:
    assert abs(r["loss"] - r["ref_loss"]) <= TOL * max(1.0, abs(r["ref_loss"])), r
    assert r["grad_err"] <= TOL, r
    for kind, g in r["graphs"].items():
        assert g["segments"] > 0 and g["pure_segments"], (kind, g)
        assert g["order_kept"], (kind, g)
        assert any("grouped_ffn" in t for t in g["moe_ops"]), (kind, g)  # the expert compute stays ours
        assert (g["leases"] > 0) == leases, (kind, g)


def test_options_and_auto_default():
    with pytest.raises(OptionError, match="dense_fusion"):
        moe_compile(build_model("tiny", **SMALL), dense_fusion="fast")
    assert resolve_dense_fusion("none", "cpu") == "none"
    assert resolve_dense_fusion("auto", "cpu") in ("none", "inductor")
    from torch._inductor import config

    with config.patch({"cpp.cxx": ("no-such-cxx",)}):  # a machine without a C++ compiler
        assert resolve_dense_fusion("auto", "cpu") == "none"  # auto never needs one
        with pytest.raises(OptionError, match="C\\+\\+ compiler"):
            resolve_dense_fusion("inductor", "cpu")


@needs_cxx
def test_two_ranks_ep2_matches_dense_model():
    for r in run_ranks(fusion_worker, 2, "ep_mp=2"):
        check(r, leases=True)
