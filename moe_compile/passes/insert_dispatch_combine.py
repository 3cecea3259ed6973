"""insert_dispatch_combine — replace each logical routed-experts node by explicit token movement.

Terms: T tokens on this rank, K = top_k, R = T·K routed rows, capacity = receive-buffer rows. With a
capacity factor: the exact ceiling ⌈capacity_factor·R⌉ of the decimal factor, with the rank-level
deterministic tail drop (:func:`moe_compile.runtime.route_plan.capacity_rows`). Dropless: memory follows
the load, not the mesh (:mod:`moe_compile.runtime.dropless`):

    capacity  C = ⌈min(ep_mp, f)·R⌉, f = the program's receive factor (starts at the headroom h = 1.5);
              on the all_to_all transport each rank sends its C with its counts, so ranks with other C
              (batches of different shapes, a graph compiled before C grew) agree on every drop
    dispatch  every rank all-gathers the counts, so every rank knows the rows each rank would receive;
              need = their max (a tensor), overflow |= need > C                 (no host sync)
    forward   ends → one host read of overflow (the same on every rank of the group): if set, f grows
              to the smallest doubling that holds need/R (≤ ep_mp, where nothing can overflow), this
              pass runs again with the new C (a recorded, warned recompile) and the forward reruns
              from the same inputs and RNG state; the overflowing attempt is discarded, never returned

so no returned forward ever dropped a token, shapes stay static (C is a compile-time number), and the
buffer is the high-water h·2^k·R of observed loads instead of ep_mp·R (the bound, ``capacity_rows(R,
ep, None)``, which the capacity reaches only under a load that needs it). Recompiles are at most
⌈log2(ep_mp/h)⌉ per run; the ledger's C and ``M_recv_rho`` give the rows and bytes per load imbalance ρ.

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
from ..runtime.dropless import dropless_state
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
        block = a["block"]
        if prog.options.capacity_factor is None:  # dropless: the load-following capacity (module docstring)
            cap = dropless_state(prog.ctx_id, prog.ep_size, prog.options.dropless_headroom).capacity(block, rows)
        else:
            cap = capacity_rows(rows, prog.ep_size, prog.options.capacity_factor)
        ctx.dispatch[block] = DispatchSpec(t, k, cap, prog.options.capacity_factor is None, prog.ep_size,
                                           prog.ep_group_name)
        new: list[fx.Node] = []
        call, items = _builders(g, new)

        with g.inserting_before(node):
            xs, order, counts = items(call(moe.permute.default, (a["x"], a["idx"], a["num_experts"], block)), 3)
            recv, rcounts, layout = items(
                call(moe.dispatch.default, (xs, counts, a["ctx"], block, cap, prog.ep_size, True)), 3
            )
            biases = (op_arg(node, "b_in"), op_arg(node, "b_out"))  # expert biases, sharded with their experts
            out = items(call(moe.grouped_ffn.default,
                             (recv, rcounts, a["w_in"], a["w_out"], a["activation"], a["gated"], block)
                             + (biases if biases[0] is not None else ())), 1)[0]
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
