"""Lowering: choose the kernel for every MoE node of the forward and backward graphs.

Torch codegen (the CPU default) keeps each moe:: op on its torch kernel, with one rewrite: in an
EP-MP group of one rank with a dropless capacity (capacity = T·K), dispatch and combine (and their
mirrors) move no rows, so they lower to their inputs — the receive buffer *is* the permuted input —
and the dispatch layout comes from ``moe::local_layout``. The IR graphs keep the nodes; only the
executable graph loses the copies.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..errors import OptionError
from ..ops import op_name
from ..passes.base import PassContext, op_arg
from ..runtime import get_context


def resolve_codegen(requested: str) -> str:
    if requested in ("auto", "torch"):
        return "torch"
    raise OptionError(f"codegen={requested!r} is not available")


def _local_dropless(n: fx.Node, ctx: PassContext, cap_arg: str, rows_of: fx.Node) -> bool:
    return ctx.program.ep_size == 1 and op_arg(n, cap_arg) == rows_of.meta["val"].shape[0]


def elide_local_transport(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Rewrite transport nodes of one-rank EP groups to no-ops; returns how many were rewritten."""
    g = gm.graph
    done = 0
    for n in list(g.nodes):
        name = op_name(n.target) if n.op == "call_function" else None
        if name == "dispatch" and _local_dropless(n, ctx, "capacity", op_arg(n, "xs")):
            xs, counts = op_arg(n, "xs"), op_arg(n, "counts")
            with g.inserting_before(n):
                layout = g.call_function(torch.ops.moe.local_layout.default, (counts, op_arg(n, "ctx"), op_arg(n, "block")))
            layout.meta.update(n.meta)
            layout.meta["val"] = n.meta["val"][2]
            for u in list(n.users):
                assert u.target is operator.getitem
                u.replace_all_uses_with((xs, counts, layout)[u.args[1]])
                g.erase_node(u)
            g.erase_node(n)
            done += 1
        elif name in ("combine", "dispatch_backward", "combine_backward"):
            src = n.args[0]
            rows = op_arg(n, "capacity") if name == "combine_backward" else op_arg(n, "num_rows")
            if ctx.program.ep_size == 1 and rows == src.meta["val"].shape[0]:
                n.replace_all_uses_with(src)
                g.erase_node(n)
                done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


def place_lease_ops(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Activate the graph's lease plan first, check every symmetric payload before each reader, and
    release it after its last reader (payloads living within one op are handled by that op)."""
    plan = ctx.lease_plan
    if plan is None or not plan.payloads:
        return 0
    prog = ctx.program
    leases = get_context(prog.ctx_id).leases
    plan_id = leases.install(plan)
    g = gm.graph
    by_op: dict[tuple[str, str], list[fx.Node]] = {}
    for n in g.nodes:
        if n.op == "call_function" and op_name(n.target) and not op_name(n.target).startswith("lease_"):
            by_op.setdefault((op_name(n.target), op_arg(n, "block")), []).append(n)
    def tensor_input(n: fx.Node) -> fx.Node:
        return next(a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor))

    first = next(n for n in g.nodes if n.op != "placeholder")
    like = next(n for n in g.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
    with g.inserting_before(first):
        g.call_function(torch.ops.moe.lease_activate.default, (prog.ctx_id, plan_id, like))
    placed = 1
    for p in plan.payloads:
        for reader in set(p.readers):
            for n in by_op.get(reader, []):
                with g.inserting_before(n):
                    g.call_function(torch.ops.moe.lease_check.default, (prog.ctx_id, p.name, tensor_input(n)))
                placed += 1
        if p.released_by is not None:
            for n in by_op.get(p.released_by, []):
                with g.inserting_after(n):
                    g.call_function(torch.ops.moe.lease_release.default, (prog.ctx_id, p.name, tensor_input(n)))
                placed += 1
    g.lint()
    gm.recompile()
    return placed


def lower(gm: fx.GraphModule, ctx: PassContext, kind: str) -> fx.GraphModule:
    resolve_codegen(ctx.program.options.codegen)
    gm.meta["moe_codegen"] = "torch"
    gm.meta["moe_elided_transport"] = elide_local_transport(gm, ctx)
    gm.meta["moe_lease_ops"] = place_lease_ops(gm, ctx)
    return gm
