"""MXFP8 for dense linears (part of mxfp8_casts): matmuls whose operand is a selected weight.

A linear y = x·Wᵀ reaches the joint graph as ``mm(x, t(W))`` (forward) and ``mm(g, t(t(W)))``
(input gradient); its weight gradient ``mm(t(g), x)`` has no weight operand and stays
high-precision. Following the operand back through transposes/views to the weight placeholder gives
the orientation: an odd number of transposes is the forward GEMM (cache "fwd", W along ``in``), an
even number the input-gradient GEMM (cache "t", Wᵀ along ``out``). Each becomes
``mx_linear(a, weight_cache(W))``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .base import PassContext

aten = torch.ops.aten
_VIEWS = {aten.t.default: 1, aten.view.default: 0, aten._unsafe_view.default: 0, aten.alias.default: 0}


def weight_source(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(placeholder, transposes) if ``node`` is a chain of views/transposes of a placeholder."""
    flips = 0
    while node.op == "call_function" and node.target in _VIEWS:
        flips += _VIEWS[node.target]
        if node.target is not aten.t.default and tuple(node.meta["val"].shape) != tuple(node.args[0].meta["val"].shape):
            return None  # a reshaping view is not the weight matrix
        node = node.args[0]
    return (node, flips) if node.op == "placeholder" else None


def quantize_dense_linears(gm: fx.GraphModule, ctx: PassContext, shared_only: bool) -> int:
    prog = ctx.program
    names = ctx.input_names  # placeholder index → parameter name (None for data inputs)
    stores = prog.dense_weight_stores  # parameter name → FP8WeightStore, the eligible weights
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    name_of = {p: names[i] for i, p in enumerate(placeholders) if i < len(names) and names[i] in stores}
    mode = prog.options.mxfp8_scale_mode
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.mm.default:
            continue
        src = weight_source(n.args[1])
        if src is None or src[0] not in name_of:
            continue
        w, flips = src
        pname = name_of[w]
        with g.inserting_before(n):
            cache = g.call_function(torch.ops.moe.weight_cache.default,
                                    (w, prog.ctx_id, pname, "w", "fwd" if flips % 2 else "t"))
            mm = g.call_function(torch.ops.moe.mx_linear.default,
                                 (n.args[0], cache, mode, n.meta["val"].dtype, pname))
        n.replace_all_uses_with(mm)
        g.erase_node(n)
        done += 1
    return done
