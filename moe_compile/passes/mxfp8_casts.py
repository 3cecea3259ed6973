"""mxfp8_casts — run the selected linears in MXFP8, with explicit cast nodes (on the joint graph).

Terms: an *MXFP8 runtime payload* is activation or communication data as a qdata–scale pair (packed
uint8 rows [rows, K + K/32], see moe_compile.mxfp8); an *MXFP8 compute-weight cache* is a weight's
orientation-specific qdata–scale form kept by its FP8WeightStore.

Per selected MoE block (routed experts; mxfp8="experts" | "experts+shared" | "all")::

  forward   recv = dispatch(xs)                   →  xq = quantize_mx(xs); recv = dispatch(xq)
            out, pre = grouped_ffn(recv, W)       →  out, pre = grouped_ffn_mx(recv, cache_fwd(W))
  backward  g_out = combine_backward(g_back)      →  gq = quantize_mx(g_back); g_out = combine_backward(gq)
            grouped_ffn_backward(g_out, recv, W)  →  grouped_ffn_backward_mx(g_out, recv, cache_t(W), W)

So the dispatched payload and the gradient sent back through combine's mirror travel as MXFP8
(about half the bytes of BF16); input gradients (dispatch_backward) stay BF16; weight gradients use
high-precision operands with fp32 accumulation. Dense linears (the shared expert under
"experts+shared", every dense linear under "all"): forward and input-gradient matmuls whose operand
is the weight become ``mx_linear`` with the weight's cache; weight-gradient matmuls stay high-precision.

Runs after autograd, so the backward casts are explicit nodes too; requires PARTITIONED, ensures
QUANTIZED (nothing changes when mxfp8 is off).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..ir import Stage
from .base import PassContext, moe_nodes, moe_pass, op_arg, tag_moe_nodes

moe = torch.ops.moe


def _by_block(gm: fx.GraphModule, name: str) -> dict[str, fx.Node]:
    return {op_arg(n, "block"): n for n in moe_nodes(gm, name)}


def quantize_experts(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Rewrite every block's expert path to MXFP8; returns how many blocks were rewritten."""
    mode = ctx.program.options.mxfp8_scale_mode
    g = gm.graph
    ffn, ffn_b, comb_b = _by_block(gm, "grouped_ffn"), _by_block(gm, "grouped_ffn_backward"), _by_block(
        gm, "combine_backward")
    done = 0
    for d in moe_nodes(gm, "dispatch"):
        block = op_arg(d, "block")
        f = ffn.get(block)
        if f is None:
            continue
        cid = op_arg(d, "ctx")
        with g.inserting_before(d):
            d.update_arg(0, g.call_function(moe.quantize_mx.default, (op_arg(d, "xs"), mode, block)))
        w_in, w_out = op_arg(f, "w_in"), op_arg(f, "w_out")
        act, gated = op_arg(f, "activation"), op_arg(f, "gated")
        dtype = f.meta["val"][0].dtype
        with g.inserting_before(f):
            wi = g.call_function(moe.weight_cache.default, (w_in, cid, block, "w_in", "fwd"))
            wo = g.call_function(moe.weight_cache.default, (w_out, cid, block, "w_out", "fwd"))
            f2 = g.call_function(moe.grouped_ffn_mx.default, (op_arg(f, "recv"), op_arg(f, "counts"), wi, wo, act,
                                                               gated, block, mode, dtype))
        f.replace_all_uses_with(f2)
        g.erase_node(f)
        cb = comb_b.get(block)
        if cb is not None:
            with g.inserting_before(cb):
                cb.update_arg(0, g.call_function(moe.quantize_mx.default, (cb.args[0], mode, block)))
        fb = ffn_b.get(block)
        if fb is not None:
            with g.inserting_before(fb):
                wit = g.call_function(moe.weight_cache.default, (w_in, cid, block, "w_in", "t"))
                wot = g.call_function(moe.weight_cache.default, (w_out, cid, block, "w_out", "t"))
                fb2 = g.call_function(moe.grouped_ffn_backward_mx.default, (
                    op_arg(fb, "grad_out"), op_arg(fb, "recv"), op_arg(fb, "pre"), op_arg(fb, "counts"), wit, wot,
                    w_in, w_out, act, gated, block, mode))
            fb.replace_all_uses_with(fb2)
            g.erase_node(fb)
        done += 1
    return done


def refresh_vals(gm: fx.GraphModule) -> None:
    """Recompute every node's fake value (rewritten inputs change dtypes and shapes downstream)."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in ph]
    fake_mode = next(v.fake_mode for v in vals if hasattr(v, "fake_mode"))
    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*vals)


def apply_mxfp8(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    sel = ctx.program.options.mxfp8
    if not sel:
        return gm
    n = quantize_experts(gm, ctx)
    if sel in ("experts+shared", "all"):
        from .mxfp8_dense import quantize_dense_linears

        n += quantize_dense_linears(gm, ctx)
    if n:
        gm.graph.lint()
        gm.recompile()
        refresh_vals(gm)
        tag_moe_nodes(gm, ctx)
    gm.meta["mxfp8_rewrites"] = n
    return gm


@moe_pass(requires=Stage.PARTITIONED, ensures=Stage.QUANTIZED, graph="joint")
def mxfp8_casts(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return apply_mxfp8(gm, ctx)

