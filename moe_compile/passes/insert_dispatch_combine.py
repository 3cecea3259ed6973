"""insert_dispatch_combine — replace each logical routed-experts node by explicit token movement.

Terms: T tokens on this rank, K = top_k, R = T·K routed rows, capacity = receive-buffer rows
(ep_mp·R when dropless: no request can exceed it; otherwise the exact ceiling ⌈capacity_factor·R⌉ of the
decimal factor, with the rank-level deterministic tail drop — both in :mod:`moe_compile.runtime.route_plan`,
whose ``capacity_rows`` the ledger's figure C agrees with).

    y = routed_experts(x, idx, w, W_in, W_out)
  becomes
    xs, order, counts   = permute(x, idx)                      # rows in expert order
    recv, rcounts, lay  = dispatch(xs, counts, capacity)       # to the ranks storing the experts
    out, pre            = grouped_ffn(recv, rcounts, W_in, W_out)   # local experts, valid prefix
    back                = combine(out, lay)                    # rows return to their source
    y                   = unpermute(back, order, w)            # router-weighted sum per token

Backward mirrors come from each op's autograd formula (dispatch ↔ combine direction swap).
Requires DENSE, ensures PARTITIONED; shapes stay static.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ir import DispatchSpec, Stage
from ..runtime.route_plan import capacity_rows
from .base import PassContext, moe_nodes, moe_pass, op_arg, propagate_fake, tag_moe_nodes, val_shape

moe = torch.ops.moe


def _builders(g: fx.Graph, new: list[fx.Node]):
    """call(target, args) and items(node, n) that insert nodes and remember them in ``new``."""

    def call(target, args):
        n = g.call_function(target, args)
        new.append(n)
        return n

    def items(n, count):
        return [call(operator.getitem, (n, i)) for i in range(count)]

    return call, items


@moe_pass(requires=Stage.DENSE, ensures=Stage.PARTITIONED)
def insert_dispatch_combine(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    g = gm.graph
    prog = ctx.program
    for node in moe_nodes(gm, "routed_experts"):
        a = {k: op_arg(node, k) for k in ("x", "idx", "weights", "w_in", "w_out", "activation", "gated",
                                           "num_experts", "ctx", "block")}
        t, k = val_shape(a["idx"])
        rows = t * k
        cap = capacity_rows(rows, prog.ep_size, prog.options.capacity_factor)
        block = a["block"]
        ctx.dispatch[block] = DispatchSpec(t, k, cap, prog.options.capacity_factor is None, prog.ep_size,
                                           prog.ep_group_name)
        new: list[fx.Node] = []
        call, items = _builders(g, new)

        with g.inserting_before(node):
            xs, order, counts = items(call(moe.permute.default, (a["x"], a["idx"], a["num_experts"], block)), 3)
            recv, rcounts, layout = items(
                call(moe.dispatch.default, (xs, counts, a["ctx"], block, cap, prog.ep_size)), 3
            )
            out = items(call(moe.grouped_ffn.default,
                             (recv, rcounts, a["w_in"], a["w_out"], a["activation"], a["gated"], block)), 1)[0]
            back = call(moe.combine.default, (out, layout, a["ctx"], block, rows))
            y = call(moe.unpermute.default, (back, order, a["weights"], block))
        for n in new:
            n.meta["stack_trace"] = node.meta.get("stack_trace")
        propagate_fake(new)
        node.replace_all_uses_with(y)
        g.erase_node(node)
    g.lint()
    gm.recompile()
    tag_moe_nodes(gm, ctx)
    return gm
