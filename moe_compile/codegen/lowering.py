"""Lowering: choose the kernel for every MoE node of the forward and backward graphs.

    elide_local_transport   EP-MP group of one rank, dropless (capacity = T·K): dispatch and combine
                            (and their mirrors) move no rows, so they lower to their inputs — the
                            receive buffer *is* the permuted input — and the dispatch layout comes
                            from ``moe::local_layout``
    place_lease_ops         symmetric transport: activate / check / release the lease plan
    lower_to_triton         codegen="triton": each moe:: node with an entry in the lowering table
                            (lowering_table.py) becomes its moe_triton:: twin (same schema); the
                            launches it makes are recorded per MoE layer for CompiledMoE.kernels()

Torch codegen (the CPU default) keeps each moe:: op on its torch kernel. The IR graphs keep the
nodes; only the executable graphs change.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..leases import LEASE_FAMILY
from ..ops import op_name, op_namespace
from ..passes.base import PassContext, op_arg
from ..runtime import get_context
from ..runtime.lease_runtime import BACKWARD, FORWARD


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
        elif name in ("combine", "dispatch_backward", "combine_backward") and _local_dropless(
                n, ctx, "capacity" if name == "combine_backward" else "num_rows", n.args[0]):
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
            done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


def place_lease_ops(gm: fx.GraphModule, ctx: PassContext, kind: str = "forward") -> int:
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
    inputs = [n for n in g.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    if kind == "backward":  # the saved payloads tell the runtime which forward this backward belongs to
        leased = {(p.shape, p.dtype) for p in plan.payloads if p.family == LEASE_FAMILY}
        saved = [n for n in inputs if (tuple(n.meta["val"].shape), str(n.meta["val"].dtype)) in leased] or inputs
    else:
        saved = inputs[:1]
    with g.inserting_before(first):
        g.call_function(torch.ops.moe.lease_activate.default,
                        (prog.ctx_id, plan_id, BACKWARD if kind == "backward" else FORWARD, saved))
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


def lower_to_triton(gm: fx.GraphModule, ctx: PassContext) -> list[tuple[str, str, list]]:
    """Swap each moe:: node that has a Triton lowering for its moe_triton:: twin; returns
    (block, op, launch plans) per swapped node."""
    from contextlib import nullcontext

    from .lowering_table import triton_lowerings

    table = triton_lowerings()
    records = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or op_namespace(n.target) != "moe" or op_name(n.target) not in table:
            continue
        entry = table[op_name(n.target)]
        args = fx.node.map_aggregate(n.args, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
        kwargs = fx.node.map_aggregate(n.kwargs, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
        with ctx.fake_mode if ctx.fake_mode is not None else nullcontext():
            plans = entry.plan(*args, **kwargs)
        records.append((op_arg(n, "block"), op_name(n.target), plans))
        n.target = entry.target
    gm.recompile()
    return records


def dump_kernels(records: list[tuple[str, str, list]], kind: str, debug_dir: str) -> None:
    """Write each used kernel file's source and the launches of this graph under debug_dir/kernels/."""
    import inspect
    from pathlib import Path

    from .kernel_cache import describe_plan
    from .triton_mode import kernel_module

    out = Path(debug_dir) / "kernels"
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for block, op, plans in records:
        for p in plans:
            d = describe_plan(p, op, kind)
            lines.append(f"{block}  {op}  {d['name']}  grid={d['grid']}  config={d['config']}  {d['specialisation']}")
            src = out / f"{p.spec.family}.py"
            if not src.exists():
                src.write_text(inspect.getsource(kernel_module(p.spec.family)))
    (out / f"{kind}_launches.txt").write_text("\n".join(lines) + "\n")


def lower(gm: fx.GraphModule, ctx: PassContext, kind: str) -> fx.GraphModule:
    prog = ctx.program
    gm.meta["moe_codegen"] = prog.codegen
    gm.meta["moe_elided_transport"] = elide_local_transport(gm, ctx)
    gm.meta["moe_lease_ops"] = place_lease_ops(gm, ctx, kind)
    if prog.codegen == "triton":
        records = lower_to_triton(gm, ctx)
        prog.kernel_plans[kind] = records
        if prog.options.debug_dir:
            dump_kernels(records, kind, str(prog.debug_path()))
    return gm
