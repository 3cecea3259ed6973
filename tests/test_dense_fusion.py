"""Dense fusion (dense_fusion="inductor"): the dense segments of the lowered graphs run as inductor
kernels, the moe:: / lease / transport ops stay opaque nodes in their order (but for the routed-row ops
inlined as aten code), and loss and gradients match the dense model (fp32, 1e-5) on two EP ranks
(symmetric transport: lease ops; one test, since a cold inductor compile costs minutes on 2 cores). The
row-op decompositions are checked against per-row loops and against the ops' own kernels, the expert-FFN
decomposition against per-expert dense autograd and the grouped_ffn kernels."""

from __future__ import annotations

import operator

import pytest
import torch

from moe_compile import moe_compile
from moe_compile.codegen.dense_fusion import cpp_compiler, fuse_dense, resolve_dense_fusion, split_segments
from moe_compile.codegen.ffn_decompositions import FFN_DECOMPOSITIONS
from moe_compile.codegen.row_decompositions import ROW_DECOMPOSITIONS, inline_row_ops
from moe_compile.errors import OptionError
from moe_compile.ops import op_namespace

from .common import build_model, dense_reference, make_batches, rel_err, skew_to_first_experts
from .harness import run_ranks
from .test_parity import model_experts

TOL = 1e-5
SMALL = dict(n_layers=1, d_model=32, expert_hidden=32)  # one layer: the fewest segments to compile
needs_cxx = pytest.mark.skipif(cpp_compiler() is None, reason="inductor on CPU needs a C++ compiler")


INLINED = tuple(f"moe.{name}.default" for name in ROW_DECOMPOSITIONS)
FFN_OPS = tuple(f"moe.{name}.default" for name in FFN_DECOMPOSITIONS)  # inlined at ep_mp = 1 only
FFN_GEMMS = ("moe.expert_mm.default", "moe.expert_mm_weight_grad.default")  # what the inlined FFNs call


def opaque_order(gm: torch.fx.GraphModule, skip: tuple[str, ...] = ()) -> list[str]:
    """Targets of the non-aten call nodes, in graph order (what must run eagerly, in this order)."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
            and getattr(n.target, "namespace", None) not in ("aten", "prims") and str(n.target) not in skip]


def fusion_worker(rank: int, world: int, mesh: str | None, skewed: bool = False) -> dict:
    from moe_compile import MeshSpec

    model = build_model("tiny", **SMALL)
    if skewed:  # every token to rank 0's experts: the dropless buffer overflows, the program is rebuilt
        skew_to_first_experts(model, model_experts(model) // 2)
    batches = make_batches(world, 2, 16, seed=3)
    ref_losses, ref_grads = dense_reference(model, batches)
    kw = {} if mesh is None else {"mesh": MeshSpec.parse(mesh).resolve(world)}
    cm = moe_compile(model, dense_fusion="inductor", **kw)
    with torch._inductor.config.patch(compile_threads=1):  # no compile-worker pool to start on 2 cores
        res = cm(input_ids=batches[rank], labels=batches[rank])
        res.loss.backward()
    grads = cm.full_grads()
    out = {"loss": res.loss.item(), "ref_loss": ref_losses[rank], "compiles": cm.program.compiles,
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
            "order_kept": opaque_order(gm, skip=INLINED + FFN_OPS)
            == opaque_order(info["executable"], skip=FFN_GEMMS + FFN_OPS),
            "ffn_gemms": sum(t in FFN_GEMMS for t in opaque_order(info["executable"])),
            "row_ops_left": [t for t in opaque_order(info["executable"]) if t in INLINED],
            "inlined": info["inlined_row_ops"],
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
        assert g["inlined"] > 0 and not g["row_ops_left"], (kind, g)  # unpermute (and mirrors) fused
        assert any("grouped_ffn" in t for t in g["moe_ops"]), (kind, g)  # the lowered graph keeps the op,
        assert g["ffn_gemms"] == 0, (kind, g)  # under EP the FFN stays one op (see dense_fusion.py)
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
        with pytest.raises(OptionError, match="none of \\['no-such-cxx'\\] is on PATH"):  # at compile time
            moe_compile(build_model("tiny", **SMALL), dense_fusion="inductor")


@needs_cxx
def test_two_ranks_ep2_matches_dense_model():
    for r in run_ranks(fusion_worker, 2, "ep_mp=2"):
        check(r, leases=True)
        assert r["compiles"] == 1, r


@needs_cxx
def test_dropless_rebuild_compiles_dense_segments_again():
    """The rebuild after a dropless overflow lowers outside dynamo (no ShapeEnv in its fake values):
    its dense segments still compile, and the rerun matches the dense model."""
    for r in run_ranks(fusion_worker, 2, "ep_mp=2", True):
        check(r, leases=True)
        assert r["compiles"] == 2, r


@needs_cxx
def test_torch_2_11_api_without_recompile_limit_or_fake_mode(monkeypatch):
    """torch 2.11 (the CUDA machine's build; pyproject allows it) has no ``recompile_limit`` argument to
    torch.compile and no ``fake_mode`` to standalone_compile: both were TypeErrors on the first GPU run.
    With both hidden as in 2.11, one rank with dense_fusion="inductor" still matches the dense model."""
    compile_, standalone = torch.compile, torch._inductor.standalone_compile

    def compile_211(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                    disable=False):
        return compile_(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options,
                        disable=disable)

    def standalone_211(gm, example_inputs, *, dynamic_shapes="from_graph", options=None, aot=False):
        return standalone(gm, example_inputs, dynamic_shapes=dynamic_shapes, options=options, aot=aot)

    monkeypatch.setattr(torch, "compile", compile_211)
    monkeypatch.setattr(torch._inductor, "standalone_compile", standalone_211)
    model = build_model("tiny", **SMALL)
    batch = make_batches(1, 2, 16, seed=3)
    ref_losses, ref_grads = dense_reference(model, batch)
    with torch._dynamo.config.patch(recompile_limit=8), torch._inductor.config.patch(compile_threads=1):
        cm = moe_compile(model, dense_fusion="inductor")
        assert torch._dynamo.config.recompile_limit == 64  # the process-wide limit, raised for this entry
        loss = cm(input_ids=batch[0], labels=batch[0]).loss
        loss.backward()
    grads = cm.full_grads()
    assert cm.program.graphs["forward"].meta["moe_dense_fusion"]["segments"] > 0
    for kind, gemms in (("forward", 2), ("backward", 4)):  # one rank: the FFN's GEMMs around its inlined activation
        executable = opaque_order(cm.program.graphs[kind].meta["moe_dense_fusion"]["executable"])
        assert sum(t in FFN_GEMMS for t in executable) == gemms and not any("grouped_ffn" in t for t in executable)
    assert abs(loss.item() - ref_losses[0]) <= TOL * abs(ref_losses[0])
    assert max(rel_err(grads[n], ref_grads[n]) for n in ref_grads) <= TOL
    cm.close()


def _routed(t: int, k: int, n: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    xs, order, _ = torch.ops.moe.permute(x, idx, n, "b")
    return x, xs, order, w, torch.randn(t, d, generator=g).to(dtype)


def _row_ops(xs, order, w, gy, t, k):
    y = torch.ops.moe.unpermute(xs, order, w, "b")
    g_back, g_w = torch.ops.moe.unpermute_backward(gy, xs, order, w, "b")
    return y, g_back, g_w, torch.ops.moe.permute_backward(xs, order, t, k, "b")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_row_op_inlining_matches_loops_and_kernels(dtype, tol):
    """inline_row_ops on a traced graph of the three row ops: no moe:: node is left, and its outputs
    match a per-row loop over (t, k) (independent of both forms) and the ops' own kernels."""
    from torch.fx.experimental.proxy_tensor import make_fx

    t, k, n, d = 13, 3, 6, 8
    x, xs, order, w, gy = _routed(t, k, n, d, dtype)
    gm = make_fx(lambda *a: _row_ops(*a, t, k), tracing_mode="fake")(xs, order, w, gy)
    inlined, count = inline_row_ops(gm)
    assert count == 3 and not any(getattr(n.target, "namespace", None) == "moe" for n in inlined.graph.nodes)
    got = inlined(xs, order, w, gy)
    kernels = _row_ops(xs, order, w, gy, t, k)
    row = {(int(order[r]) // k, int(order[r]) % k): r for r in range(t * k)}  # (token, slot) → routed row
    xf, gf = xs.float(), gy.float()
    ref_y = torch.stack([sum(w[i, j] * xf[row[i, j]] for j in range(k)) for i in range(t)])
    ref_gb = torch.stack([gf[int(order[r]) // k] * w.reshape(-1)[order[r]] for r in range(t * k)])
    ref_gw = torch.tensor([[float(gf[i] @ xf[row[i, j]]) for j in range(k)] for i in range(t)])
    ref_gx = torch.stack([sum(xf[row[i, j]] for j in range(k)) for i in range(t)])
    for name, ref, a, b in zip(("y", "g_back", "g_w", "g_x"), (ref_y, ref_gb, ref_gw, ref_gx), got, kernels):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a.float(), ref) <= tol, name
        assert rel_err(b.float(), ref) <= tol, name
    assert torch.allclose(ref_gx, k * x.float(), atol=tol * k)  # each token's K rows are copies of it


def _expert_reference(x, counts, w_in, w_out, g_out, act):
    """out, and the gradients of ⟨out, g_out⟩ w.r.t. x, w_in, w_out, by dense autograd, expert by expert
    over the valid rows (torch.nn.functional ops: independent of both FFN forms)."""
    x, w_in, w_out = (t.detach().clone().requires_grad_() for t in (x, w_in, w_out))
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        pre = x[start:start + c] @ w_in[e].t()
        outs.append(act(pre) @ w_out[e].t())
        start += c
    out = torch.cat(outs)
    (out * g_out[:start]).sum().backward()
    return out.detach(), x.grad[:start], w_in.grad, w_out.grad


_ACTS = {
    "silu": (True, lambda p: torch.nn.functional.silu(p.chunk(2, -1)[0]) * p.chunk(2, -1)[1]),
    "relu2": (False, lambda p: torch.relu(p) ** 2),
    "clamped_swiglu(alpha=1.702,limit=7.0,up_offset=1.0)": (
        True, lambda p: (p.chunk(2, -1)[1].clamp(-7, 7) + 1) * p.chunk(2, -1)[0].clamp(max=7)
        * torch.sigmoid(1.702 * p.chunk(2, -1)[0].clamp(max=7))),
}


@pytest.mark.parametrize("activation", list(_ACTS))
def test_expert_ffn_inlining_matches_dense_autograd_and_kernels(activation):
    """inline_row_ops on a traced grouped_ffn + grouped_ffn_backward: no grouped_ffn node is left (its
    GEMMs become expert_mm ops, its activation aten nodes), and over the valid prefix of a capacity-sized
    buffer (an expert with no rows, unspecified rows past the prefix) the outputs and gradients match
    per-expert dense autograd and the ops' own kernels."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gated, act = _ACTS[activation]
    g = torch.Generator().manual_seed(0)
    cap, d, h, counts = 24, 8, 6, torch.tensor([5, 0, 9, 3])
    f = 2 * h if gated else h
    x = torch.randn(cap, d, generator=g)
    x[counts.sum():] = float("nan")  # rows past the valid prefix: nothing may read them
    w_in, w_out = torch.randn(4, f, d, generator=g) / 3, torch.randn(4, d, h, generator=g) / 3
    g_out = torch.randn(cap, d, generator=g)
    g_out[counts.sum():] = float("nan")  # the gradient of rows nothing computed: never read either

    def ffn(x, counts, w_in, w_out, g_out):
        out, pre = torch.ops.moe.grouped_ffn(x, counts, w_in, w_out, activation, gated, "b")
        return (out, *torch.ops.moe.grouped_ffn_backward(g_out, x, pre, counts, w_in, w_out, activation, gated, "b"))

    gm = make_fx(ffn, tracing_mode="fake")(x, counts, w_in, w_out, g_out)
    inlined, count = inline_row_ops(gm)
    targets = {str(n.target) for n in inlined.graph.nodes if n.op == "call_function"}
    assert count == 2 and not targets & set(FFN_OPS) and set(FFN_GEMMS) <= targets
    valid = int(counts.sum())
    ref = _expert_reference(x, counts, w_in, w_out, g_out, act)
    for form in (inlined(x, counts, w_in, w_out, g_out), ffn(x, counts, w_in, w_out, g_out)):
        got = (form[0][:valid], form[1][:valid], form[2], form[3])
        for name, a, b in zip(("out", "g_x", "g_w_in", "g_w_out"), got, ref):
            assert a.shape == b.shape and rel_err(a, b) <= 1e-6, (name, rel_err(a, b))


def test_a_view_of_a_cat_with_an_empty_tensor_compiles():
    """MiMo-V2-Flash's rotary concatenates each key with an empty pass-through part. aten.cat returns a
    contiguous result, so the traced graph views it; inductor's decomposition of that cat clones the key
    with its transposed strides, and the view failed to compile (BackendCompilerFailed in every
    dense_fusion="inductor" program of the family). The fused graph computes what the traced one does."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        k = (x @ w).view(2, 16, 4, 8).transpose(1, 2)  # [B, H, S, D], not contiguous
        k = torch.cat([k * 2.0, torch.empty(0)], dim=-1)
        return (k.view(8, 16, 8) * 3.0).sum(-1)

    x, w = torch.randn(2, 16, 32), torch.randn(32, 32)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    assert any(n.target is torch.ops.aten.view.default and n.args[0].target is torch.ops.aten.cat.default
               for n in gm.graph.nodes)
    fused, summary = fuse_dense(gm)
    assert summary["segments"] >= 1
    got = fused(x, w)
    ref = (x @ w).view(2, 16, 4, 8).transpose(1, 2).reshape(8, 16, 8).mul(6.0).sum(-1)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
