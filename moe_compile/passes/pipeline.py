"""The ordered pass list and its driver (stage checks, verify after each pass, debug dumps)."""

from __future__ import annotations

from pathlib import Path

import torch.fx as fx

from ..ir import Stage, set_stage
from .base import MoEPass, PassContext, PassRecord, op_counts, require_stage
from .context_parallel import context_parallel_attention
from .cp_convs import cp_causal_convs
from .cp_positions import cp_shard_positions
from .index_bounds import index_bounds
from .insert_dispatch_combine import insert_dispatch_combine
from .mxfp8_casts import mxfp8_casts
from .partition_experts import partition_experts
from .plan_leases import plan_leases
from .verify import verify

FORWARD_PASSES: list[MoEPass] = [index_bounds, context_parallel_attention, cp_shard_positions, cp_causal_convs,
                                 partition_experts, insert_dispatch_combine]
JOINT_PASSES: list[MoEPass] = [mxfp8_casts, plan_leases]


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[MoEPass], debug_dir: Path | None = None,
               tag: str = "") -> fx.GraphModule:
    verify(gm, ctx, after="capture" if not ctx.is_joint else "autograd")
    pictures = ctx.program.options.debug_pictures
    for i, p in enumerate(passes):
        require_stage(gm, p)
        before = op_counts(gm)
        names = _node_names(gm) if debug_dir is not None else set()
        if debug_dir is not None:
            _dump(debug_dir, f"{tag}{i:02d}_{p.name}_before", gm, pictures=pictures)
        gm = p(gm, ctx)
        set_stage(gm, p.ensures)
        verify(gm, ctx, after=p.name)
        after = op_counts(gm)
        diff = {k: after[k] - before[k] for k in set(before) | set(after) if after[k] != before[k]}
        ctx.records.append(PassRecord(p.name, diff))
        if debug_dir is not None:
            after_names = _node_names(gm)
            nodes = (sorted(after_names - names), sorted(names - after_names))
            _dump(debug_dir, f"{tag}{i:02d}_{p.name}_after", gm, diff, nodes, pictures)
    return gm


def _node_names(gm: fx.GraphModule) -> set[str]:
    """'name:op' of every node, for the node diff of a debug dump."""
    from ..ops import op_name

    return {f"{n.name}:{op_name(n.target) or getattr(n.target, '__name__', n.op)}" for n in gm.graph.nodes}


def _dump(debug_dir: Path, name: str, gm: fx.GraphModule, diff: dict | None = None,
          nodes: tuple[list[str], list[str]] | None = None, pictures: bool = False) -> None:
    debug_dir.mkdir(parents=True, exist_ok=True)
    text = gm.print_readable(print_output=False)
    if nodes is not None:
        text = f"# nodes added: {nodes[0]}\n# nodes removed: {nodes[1]}\n" + text
    if diff is not None:
        text = "# op-count diff: " + repr(dict(sorted(diff.items()))) + "\n" + text
    (debug_dir / f"{name}.py").write_text(text)
    if pictures:  # optional: graphviz layout costs about a second per few hundred nodes
        from ..viz import GraphvizMissing, build_view, warn_dot_missing, write_view

        view = build_view(gm, title=name, highlight=[s.split(":")[0] for s in nodes[0]] if nodes else ())
        try:
            write_view(view, str(debug_dir / f"{name}.svg"))
        except GraphvizMissing:  # no `dot` program: the graph source instead, and one warning
            write_view(view, str(debug_dir / f"{name}.dot"))
            warn_dot_missing()


__all__ = ["FORWARD_PASSES", "JOINT_PASSES", "Stage", "run_passes"]
