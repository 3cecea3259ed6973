"""Render an FX graph of the MoE IR with graphviz (pydot).

Full view: one graphviz node per FX node (getitem nodes folded into their edges), clusters per
pipeline stage → layer → MoE block, edges labelled with the value's shape and dtype. Collapsed view
(large graphs): per layer, every MoE node (router, permute, dispatch, expert FFN, combine, unpermute,
leases, casts) stays a node, and the layer's other ops fold into one "dense ops ×n" node per direction
(forward / backward). Gradient-reduction buckets attach to the nodes producing their gradients.

    group(node)  = layer prefix of its module path ("model.layers.3"), from nn_module_stack, the MoE
                   metadata's block, or (neither) the group of its most recently computed input
    rep(node)    = node itself (full view, or an MoE / lease / cast / collective node)
                 | "<group>/dense/<direction>/<a|b|c>" | "<group>/inputs"  (collapsed view; a, b, c:
                   before, between, after the layer's MoE nodes in graph order)
    edges        = FX edges between different reps, deduplicated, labelled by their first value
"""

from __future__ import annotations

import html
import operator
import re
import shutil
import subprocess
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import pydot
import torch
import torch.fx as fx

from ..errors import MoECompileError
from ..ir import MOE_META
from .style import LOOKS, is_mirror, kind_of, node_attrs

_DT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64", torch.int64: "i64",
       torch.int32: "i32", torch.bool: "bool", torch.uint8: "u8"}
_LAYER = re.compile(r"^((?:[^.]+\.)*?\d+)(?:\.|$)")
DOT_MISSING = ("pictures (SVG, PNG) need graphviz's `dot` program, which is not on PATH (pip installs pydot, "
               "not graphviz): install it with `apt-get install graphviz`, `conda install graphviz` or "
               "`brew install graphviz`; graph sources (.dot) are written without it")
KEEP = {"router", "permute", "unpermute", "dispatch", "combine", "expert_ffn", "routed_experts", "lease_acquire",
        "lease_release", "cast", "collective", "output"}


def dtype_name(dt: torch.dtype) -> str:
    return _DT.get(dt, str(dt).replace("torch.", ""))


def value_label(v: object) -> str:
    """'[256, 64] f32' for a tensor; tuples joined; '' for non-tensors."""
    if isinstance(v, torch.Tensor):
        return f"[{', '.join(str(int(s)) for s in v.shape)}] {dtype_name(v.dtype)}"
    if isinstance(v, list | tuple):
        parts = [value_label(x) for x in v]
        return " | ".join(p for p in parts if p)
    return ""


def module_path(node: fx.Node) -> str | None:
    meta = node.meta.get(MOE_META)
    if meta is not None:
        return meta.block
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path = str(list(stack.values())[-1][0])  # e.g. "L['self'].layers._modules['0']" or "L['model'].layers['0']"
    path = re.sub(r"\.?(?:_modules)?\['([^']+)'\]", r".\1", re.sub(r"^L\['[^']*'\]\.?|^self\.?", "", path))
    return path.replace(".modules.", ".").lstrip(".") or None


def layer_of(path: str | None) -> str | None:
    if not path:
        return None
    m = _LAYER.match(path)
    return m.group(1) if m else path.split(".")[0]


def is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward" or is_mirror(node)


@dataclass
class Reduction:
    """A gradient bucket drawn as a node, fed by the nodes producing its gradients."""

    name: str
    label: str
    grads: list[fx.Node] = field(default_factory=list)


@dataclass
class GraphView:
    dot: pydot.Dot
    collapsed: bool
    kinds: Counter  # drawn kinds (node classes) → count
    nodes: int
    level: str = "full"  # full | moe (MoE nodes per layer) | layers (one node per layer)


def groups_of(gm: fx.GraphModule) -> dict[fx.Node, str]:
    out: dict[fx.Node, str] = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        g = layer_of(module_path(n))
        if g is None:  # no module path (e.g. a residual add of gradients): the layer of its newest input
            known = [a for a in n.all_input_nodes if out.get(a, "model") != "model" and a.op != "placeholder"]
            g = out[max(known, key=order.__getitem__)] if known else None
        out[n] = g or "model"
    # placeholders take the group of their first user (they come first in the graph)
    for n in gm.graph.nodes:
        if n.op == "placeholder" and out[n] == "model":
            users = [u for u in n.users if u.op != "output"]
            if users:
                out[n] = out[users[0]]
    return out


def _display_name(n: fx.Node) -> str:
    """A placeholder of a captured graph shows the parameter it is (dynamo's source), others their name."""
    ga = n.meta.get("grapharg") if n.op == "placeholder" else None
    src = getattr(getattr(ga, "source", None), "name", None)
    if isinstance(src, str):
        src = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", src)
        return re.sub(r"^L\['self'\]\.?|^L\['([^']+)'\]", r"\1", src) or n.name
    return n.name


def _blocks(gm: fx.GraphModule) -> list[str]:
    seen: dict[str, None] = {}
    for n in gm.graph.nodes:
        meta = n.meta.get(MOE_META)
        if meta is not None:
            seen.setdefault(meta.block, None)
    return list(seen)


def _lab(s: str) -> str:
    """A DOT label: HTML-escaped, line breaks as DOT's \\n."""
    return html.escape(s).replace("\n", "\\n")


def _id(s: str) -> str:
    return '"' + re.sub(r"[^A-Za-z0-9_./|:-]", "_", s) + '"'


def build_view(gm: fx.GraphModule, *, title: str = "", collapse: bool | None = None, max_nodes: int = 350,
               reductions: Iterable[Reduction] = (), highlight: Iterable[str] = (), only_group: str | None = None,
               pp: int = 1, direction: str | None = None, stage: int = 0) -> GraphView:
    """A pydot graph of ``gm`` (see the module docstring). ``collapse``: False (every node), True (per
    layer, MoE nodes kept), "layers" (one node per layer) or None (the first that fits ``max_nodes``).
    ``direction``: "fwd" / "bwd" for a forward / backward graph; None reads each node's partitioner tag
    (joint graphs). ``only_group`` draws one layer. ``highlight`` marks nodes by name (new in a pass)."""
    nodes = [n for n in gm.graph.nodes if not (n.op == "call_function" and n.target is operator.getitem)]
    group = groups_of(gm)
    if collapse is None:  # full; else MoE nodes per layer; else (very large) one node per layer
        per_layer = 12 * len({group[n] for n in nodes})
        level = "full" if len(nodes) <= max_nodes else ("moe" if per_layer <= max_nodes else "layers")
    else:
        level = {False: "full", True: "moe"}.get(collapse, collapse)  # type: ignore[arg-type]
    if level not in ("full", "moe", "layers"):
        raise ValueError(f"collapse={collapse!r}: expected False, True, 'layers' or None (automatic)")
    collapsed = level != "full"
    highlight = set(highlight)
    blocks = _blocks(gm)

    def source(n: fx.Node) -> fx.Node:
        while n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            n = n.args[0]
        return n

    # A layer's dense ops fold into three nodes, before / between / after its MoE nodes in graph
    # order, so the collapsed graph keeps the layer's data flow acyclic (dense → MoE → dense).
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    span: dict[str, tuple[int, int]] = {}
    for n in nodes:
        if kind_of(n) in KEEP and kind_of(n) != "output":
            lo, hi = span.get(group[n], (order[n], order[n]))
            span[group[n]] = (min(lo, order[n]), max(hi, order[n]))

    def part(n: fx.Node) -> str:
        lo, hi = span.get(group[n], (len(order), len(order)))
        return "a" if order[n] < lo else ("b" if order[n] < hi else "c")

    rep: dict[fx.Node, str] = {}
    members: dict[str, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        k = kind_of(n)
        if level == "layers" and k != "output":
            r = group[n]
        elif not collapsed or k in KEEP:
            r = n.name
        elif n.op == "placeholder":
            r = f"{group[n]}/inputs"
        else:
            r = f"{group[n]}/dense/{direction or ('bwd' if is_backward(n) else 'fwd')}/{part(n)}"
        rep[n] = r
        members[r].append(n)
    if only_group is not None:
        members = {r: ms for r, ms in members.items() if group[ms[0]] == only_group}

    dot = pydot.Dot(graph_type="digraph", rankdir="TB", fontname="Helvetica", label=html.escape(title), labelloc="t",
                    compound="true", newrank="true")
    dot.set_node_defaults(fontname="Helvetica", fontsize="10")
    dot.set_edge_defaults(fontname="Helvetica", fontsize="8", color="#6b7280")
    stage = pydot.Cluster(f"stage{stage}", label=f"pipeline stage {stage} (pp={pp})", style="rounded", color="#9ca3af")
    dot.add_subgraph(stage)
    clusters: dict[str, pydot.Cluster] = {}

    def cluster_for(n: fx.Node) -> pydot.Cluster | pydot.Dot:
        g = group[n]
        if g == "model" or level == "layers":
            return stage
        mp = module_path(n) or ""
        block = next((b for b in blocks if mp == b or mp.startswith(b + ".")), None)
        if g not in clusters:
            moe_layer = any(layer_of(b) == g for b in blocks)
            clusters[g] = pydot.Cluster(_id(g).strip('"').replace(".", "_"),
                                        label=g + (" (MoE layer)" if moe_layer else ""), style="rounded,filled",
                                        fillcolor="#fff7ed" if moe_layer else "#f9fafb", color="#d1d5db")
            stage.add_subgraph(clusters[g])
        if block is None or collapsed:
            return clusters[g]
        key = f"{g}::{block}"
        if key not in clusters:
            clusters[key] = pydot.Cluster(_id(key).strip('"').replace(".", "_").replace(":", "_"),
                                          label=f"MoE block {block}", style="rounded,filled", fillcolor="#ffedd5",
                                          color="#fb923c")
            clusters[g].add_subgraph(clusters[key])
        return clusters[key]

    kinds: Counter = Counter()
    for r, ms in members.items():
        n0 = ms[0]
        k = kind_of(n0)
        if level == "layers" and k != "output":
            roles = Counter(kind_of(m) for m in ms if kind_of(m) in KEEP)
            moe = " · ".join(f"{kd} ×{c}" for kd, c in sorted(roles.items()))
            label = f"{r}\n{len(ms)} ops" + (f"\n{moe}" if moe else "")
            k = "moe_layer" if roles else "dense"
        elif collapsed and r.endswith("/inputs"):
            label, k = f"inputs ×{len(ms)}", "input"
        elif collapsed and "/dense/" in r:
            ops = Counter(getattr(m.target, "__name__", str(m.target)).split(".")[0] for m in ms)
            top = ", ".join(f"{o} ×{c}" for o, c in ops.most_common(3))
            label, k = f"{len(ms)} dense ops ({r.split('/')[-2]})\n{top}", "dense"
        else:
            target = n0.target if n0.op == "call_function" else n0.op
            tname = getattr(target, "__name__", None) or str(target)
            label = f"{_display_name(n0)}\n{tname}"
            meta = n0.meta.get(MOE_META)
            if meta is not None and meta.dispatch is not None and k in ("dispatch", "combine"):
                label += f"\ncapacity {meta.dispatch.capacity} rows, ep_mp={meta.dispatch.ep_mp}"
        kinds[k] += 1
        attrs = node_attrs(k, mirror=is_mirror(n0), highlight=any(m.name in highlight for m in ms))
        attrs["tooltip"] = html.escape(label.replace("\n", " "))
        cluster_for(n0).add_node(pydot.Node(_id(r), label=_lab(label), **attrs))

    edges: dict[tuple[str, str], str] = {}
    for n in nodes:
        if n not in rep or rep[n] not in members:
            continue
        for a in n.all_input_nodes:
            s = source(a)
            if s not in rep or rep[s] not in members or rep[s] == rep[n]:
                continue
            edges.setdefault((rep[s], rep[n]), value_label(a.meta.get("val")))
    def grp(r: str) -> str:
        return group[members[r][0]]

    fan_out = Counter(u for u, g in {(u, grp(v)) for u, v in edges if grp(u) != grp(v)})
    fan_in = Counter(v for g, v in {(grp(u), v) for u, v in edges if grp(u) != grp(v)})
    for (u, v), lab in edges.items():
        # values shared by many layers (positions, masks, their gradient sums) must not pull the layers
        # side by side: such edges do not constrain the layout
        extra = {"constraint": "false", "style": "dotted"} if fan_out[u] > 3 or fan_in[v] > 3 else {}
        dot.add_edge(pydot.Edge(_id(u), _id(v), label=_lab(lab), **extra))

    reds = list(reductions)
    if reds:
        rc = pydot.Cluster("reductions", label="gradient reduction (MultiGroupDistributedDataParallel)",
                           style="rounded", color="#ef4444")
        dot.add_subgraph(rc)
        for red in reds:
            rc.add_node(pydot.Node(_id(red.name), label=_lab(red.label), **node_attrs("reduction")))
            kinds["reduction"] += 1
            for src in {rep[g] for g in red.grads if g in rep and rep[g] in members}:
                dot.add_edge(pydot.Edge(_id(src), _id(red.name), color="#ef4444", style="dashed", constraint="false"))
    _legend(dot, kinds)
    return GraphView(dot, collapsed, kinds, len(members), level)


def _legend(dot: pydot.Dot, kinds: Counter) -> None:
    lg = pydot.Cluster("legend", label="legend", style="rounded", color="#9ca3af", fontsize="10")
    for k in sorted(kinds):
        attrs = node_attrs(k)
        attrs["class"] = f"legend legend-{k}"
        lg.add_node(pydot.Node(_id(f"legend/{k}"), label=_lab(LOOKS[k].legend), **attrs))
    dot.add_subgraph(lg)


class GraphvizMissing(MoECompileError, RuntimeError):
    """An SVG or PNG was asked for, and graphviz's ``dot`` program is not on PATH."""


def have_dot() -> bool:
    """Whether graphviz's ``dot`` program (needed for SVG and PNG, not for .dot sources) is on PATH."""
    return shutil.which("dot") is not None


_warned_missing = False


def warn_dot_missing() -> None:
    """Warn (once per process) that pictures are skipped for want of ``dot``."""
    global _warned_missing
    if not _warned_missing:
        _warned_missing = True
        warnings.warn(DOT_MISSING, stacklevel=2)


def write_view(view: GraphView, path: str, fmt: str | None = None, dpi: int = 60, timeout: float = 300.0) -> str:
    """Write ``view`` as svg / png / dot (by suffix, or ``fmt``); returns the path. PNGs render at ``dpi``
    (large bitmaps are slow to rasterise; SVG is the format to zoom). SVG and PNG need graphviz's
    ``dot`` program (:class:`GraphvizMissing` without it); a .dot source needs nothing."""
    fmt = fmt or str(path).rsplit(".", 1)[-1]
    if fmt not in ("svg", "png", "dot"):
        raise ValueError(f"{path}: graph format must be svg, png or dot, got {fmt!r}")
    if fmt == "dot":
        with open(path, "w") as f:
            f.write(view.dot.to_string())
    else:
        if not have_dot():
            raise GraphvizMissing(f"{path}: {DOT_MISSING}")
        if fmt == "png":
            view.dot.set("dpi", str(dpi))
        src = view.dot.to_string()
        view.dot.obj_dict["attributes"].pop("dpi", None)
        try:
            res = subprocess.run(["dot", f"-T{fmt}", "-o", str(path)], input=src.encode(), capture_output=True,
                                 timeout=timeout)
        except FileNotFoundError:  # gone between the lookup and the call
            raise GraphvizMissing(f"{path}: {DOT_MISSING}") from None
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{path}: graphviz layout of {view.nodes} nodes took over {timeout:.0f}s; draw a "
                               "coarser view (collapse='layers') or one layer (only_group=...)") from None
        if res.returncode:
            raise RuntimeError(f"{path}: dot failed: {res.stderr.decode()[-2000:]}")
    return str(path)
