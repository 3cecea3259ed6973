"""Gradient reductions as boxes beside the graph: MultiGroupDistributedDataParallel reduces flat
buckets, started by moe_ddp::bucket_ready nodes of the backward (grad_reduction="in_graph") or by
hooks after it returned. To show them, map each bucket's parameters to the nodes that produce their
gradients.

    captured placeholder i  ↔  primal i of the joint graph  ↔  gradient output i of backward
                                                              (or an argument of a bucket_ready node)
    placeholder i's example tensor is the parameter itself (dynamo's graph argument)
"""

from __future__ import annotations

import torch.fx as fx

from ..ledger import format_value
from .graph import Reduction


def param_names_by_input(cm) -> list[str | None]:
    """For each captured-graph input, the name of the parameter it is (None for data inputs)."""
    captured = cm.program.graphs.get("captured")
    if captured is None:
        return []
    by_id = {id(p): name for name, p in cm.model.named_parameters()}
    out: list[str | None] = []
    for n in captured.graph.nodes:
        if n.op != "placeholder":
            continue
        ga = n.meta.get("grapharg")
        try:
            ex = ga.example if ga is not None else None
        except Exception:  # noqa: BLE001 - a dead weak reference: not a live parameter
            ex = None
        out.append(by_id.get(id(ex)))
    return out


def grad_producers(cm, gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Parameter name → node of ``gm`` (backward or joint graph) that produces its gradient."""
    names = param_names_by_input(cm)
    outs = list(gm.graph.output_node().args[0])
    grads = outs[len(outs) - len(names):] if len(outs) >= len(names) else []
    out = {name: g for name, g in zip(names, grads) if name is not None and isinstance(g, fx.Node)}
    if cm.ddp is not None:  # gradients the graph reduces itself: the bucket_ready nodes' arguments
        by_id = {id(p): name for name, p in cm.model.named_parameters()}
        slot_names = {k: by_id[id(p)] for k, p in enumerate(cm.ddp.slots) if id(p) in by_id}
        for n in gm.graph.nodes:
            if n.op == "call_function" and str(n.target).startswith("moe_ddp.bucket_ready"):
                out.update({slot_names[k]: g for k, g in zip(n.args[1], n.args[2]) if k in slot_names})
    return out


def bucket_reductions(cm, gm: fx.GraphModule, max_buckets: int = 6) -> list[Reduction]:
    """One Reduction per gradient bucket of ``cm.ddp`` (empty when the program has no reducer); with
    more than ``max_buckets`` buckets, one per family."""
    if cm.ddp is None:
        return []
    mesh = cm.program.mesh
    by_id = {id(p): name for name, p in cm.model.named_parameters()}
    producers = grad_producers(cm, gm)
    out = []
    for i, b in enumerate(cm.ddp.buckets):
        if b.family == "dense":
            over = f"dp×cp = {mesh.dp * mesh.cp} ranks"
        else:
            over = f"ep_dp = {mesh.ep_dp} ranks"
        if b.group is None:
            over += " (group of one: no traffic)"
        kind = "reduce-scatter" if b.shards is not None else "all-reduce"
        label = (f"{b.family} bucket {i}\n{kind} over {over}\n{len(b.params)} params, "
                 f"{format_value(b.nbytes, 'bytes')} {str(b.flat.dtype).replace('torch.', '')}")
        grads = [producers[by_id[id(p)]] for p in b.params if by_id.get(id(p)) in producers]
        out.append(Reduction(f"reduction/{i}", label, grads))
    if len(out) <= max_buckets:
        return out
    merged: list[Reduction] = []
    for fam in ("dense", "expert"):
        mine = [(b, r) for b, r in zip(cm.ddp.buckets, out) if b.family == fam]
        if not mine:
            continue
        b0 = mine[0][0]
        over = f"dp×cp = {mesh.dp * mesh.cp} ranks" if fam == "dense" else f"ep_dp = {mesh.ep_dp} ranks"
        total = sum(b.nbytes for b, _ in mine)
        kind = "reduce-scatter" if b0.shards is not None else "all-reduce"
        label = (f"{fam} buckets ×{len(mine)}\n{kind} over {over}" + (" (no peers)" if b0.group is None else "")
                 + f"\n{sum(len(b.params) for b, _ in mine)} params, {format_value(total, 'bytes')}")
        merged.append(Reduction(f"reduction/{fam}", label, [g for _, r in mine for g in r.grads]))
    return merged
