"""MXFP8 for dense linears (part of mxfp8_casts): matmuls whose operand is a selected weight.

A linear y = x·Wᵀ reaches the joint graph as ``mm(x, t(W))`` (forward) and ``mm(g, t(t(W)))``
(input gradient); its weight gradient ``mm(t(g), x)`` has no weight operand and stays
high-precision. Following the operand back through transposes/views to the weight placeholder gives
the orientation: an odd number of transposes is the forward GEMM (cache "fwd", W along ``in``), an
even number the input-gradient GEMM (cache "t", Wᵀ along ``out``). Each becomes
``mx_linear(a, weight_cache(W))``; a biased linear's ``addmm(b, x, t(W))`` becomes
``mx_linear(x, weight_cache(W)) + b``. A selected weight read any other way is an error: once its
anchor is released the parameter holds no values, so every read must go through its caches.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import OptionError
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


def quantize_dense_linears(gm: fx.GraphModule, ctx: PassContext) -> int:
    prog = ctx.program
    names = ctx.input_names  # placeholder index → parameter name (None for data inputs)
    stores = prog.dense_weight_stores  # parameter name → FP8WeightStore, the eligible weights
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    name_of = {p: names[i] for i, p in enumerate(placeholders) if i < len(names) and names[i] in stores}
    mode = prog.options.mxfp8_scale_mode
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        biased = n.op == "call_function" and n.target is aten.addmm.default and not n.kwargs  # beta = alpha = 1
        if n.op != "call_function" or not (n.target is aten.mm.default or biased):
            continue
        x, w_view = n.args[1:3] if biased else n.args[:2]
        src = weight_source(w_view)
        if src is None or src[0] not in name_of:
            continue
        w, flips = src
        pname = name_of[w]
        with g.inserting_before(n):
            cache = g.call_function(torch.ops.moe.weight_cache.default,
                                    (w, prog.ctx_id, pname, "w", "fwd" if flips % 2 else "t"))
            out = g.call_function(torch.ops.moe.mx_linear.default, (x, cache, mode, n.meta["val"].dtype, pname))
            if biased:
                out = g.call_function(aten.add.Tensor, (out, n.args[0]))
        n.replace_all_uses_with(out)
        g.erase_node(n)
        done += 1
    for w, pname in name_of.items():
        _check_reads_through_caches(w, pname, prog.options.mxfp8)
    return done


def _check_reads_through_caches(node: fx.Node, pname: str, selection: str) -> None:
    """Every live read of a selected weight is a weight_cache (views without users are dead)."""
    for u in node.users:
        if u.op == "call_function" and u.target is torch.ops.moe.weight_cache.default:
            continue
        if u.op == "call_function" and u.target in _VIEWS:
            _check_reads_through_caches(u, pname, selection)
            continue
        raise OptionError(f"mxfp8={selection!r}: dense weight {pname} is read by {u.format_node()} besides its "
                          "linear's matmuls; MXFP8 caches replace only those reads (choose a narrower mxfp8 "
                          "selection, or keep this weight out of nn.Linear)")
