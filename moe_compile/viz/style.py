"""How graph nodes look: each node is classified (by its MoE role, else by its op) into a kind with
its own colour and shape, and an SVG class ``moe-<kind>`` so a rendered picture can be searched.

    router            amber hexagon         permute / unpermute   violet parallelograms
    dispatch          blue right arrow      combine               green left arrow
    expert_ffn        orange 3-D box        routed_experts        orange 3-D box (dense stage)
    lease_acquire     pink inverted house   lease_release         pink house
    cast (MXFP8)      yellow trapezium      collective            sky octagon
    reduction         red double octagon (gradient buckets)
    dense op          grey box              parameter / input     pale note      output   double circle
    MoE layer         peach 3-D box (a whole layer, in the coarsest collapsed view)

Backward mirrors keep their kind's colour, with a dashed outline and the extra class ``moe-mirror``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir import MOE_META, Role
from ..ops import op_name


@dataclass(frozen=True)
class Look:
    fill: str
    shape: str
    legend: str


LOOKS: dict[str, Look] = {
    "router": Look("#fcd34d", "hexagon", "router"),
    "permute": Look("#ddd6fe", "parallelogram", "permute"),
    "unpermute": Look("#ddd6fe", "invtrapezium", "unpermute (router-weighted)"),
    "dispatch": Look("#60a5fa", "rarrow", "dispatch (EP-MP transport)"),
    "combine": Look("#34d399", "larrow", "combine (EP-MP transport)"),
    "expert_ffn": Look("#fb923c", "box3d", "grouped expert FFN"),
    "routed_experts": Look("#fb923c", "box3d", "routed experts (dense stage)"),
    "shared_expert": Look("#fdba74", "box", "shared expert"),
    "lease_acquire": Look("#f472b6", "invhouse", "lease acquire (symmetric payload)"),
    "lease_release": Look("#fbcfe8", "house", "lease release"),
    "cast": Look("#fde047", "trapezium", "MXFP8 cast"),
    "collective": Look("#7dd3fc", "octagon", "collective"),
    "reduction": Look("#f87171", "doubleoctagon", "gradient reduction (bucket all-reduce or reduce-scatter)"),
    "dense": Look("#e5e7eb", "box", "dense op"),
    "moe_layer": Look("#fed7aa", "box3d", "MoE layer (collapsed)"),
    "param": Look("#f5f5f4", "note", "parameter"),
    "input": Look("#f5f5f4", "note", "input / saved value"),
    "output": Look("#d1d5db", "doublecircle", "graph output"),
}
_ROLE_KIND = {
    Role.ROUTER: "router", Role.ROUTED_EXPERTS: "routed_experts", Role.SHARED_EXPERT: "shared_expert",
    Role.PERMUTE: "permute", Role.DISPATCH: "dispatch", Role.EXPERT_FFN: "expert_ffn", Role.COMBINE: "combine",
    Role.UNPERMUTE: "unpermute", Role.CAST: "cast",
}
_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n)}


def _name(node: fx.Node) -> str:
    t = node.target
    return op_name(t) or getattr(t, "__name__", None) or str(t)


def kind_of(node: fx.Node) -> str:
    """The visual kind of ``node`` (a key of LOOKS)."""
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    meta = node.meta.get(MOE_META)
    name = _name(node).lower()
    if meta is not None:
        if meta.role == Role.LEASE:
            return "lease_release" if "release" in name else "lease_acquire"
        return _ROLE_KIND[meta.role]
    if "lease" in name:
        return "lease_release" if "release" in name else "lease_acquire"
    if any(s in name for s in ("mxfp8", "quantize", "to_mx", "cast_fp8")):
        return "cast"
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype in _FP8 and node.target is not operator.getitem:
        return "cast"
    ns = getattr(node.target, "namespace", None) or getattr(getattr(node.target, "_schema", None), "name", "")
    if isinstance(ns, str) and ("c10d" in ns):
        return "collective"
    return "dense"


def is_mirror(node: fx.Node) -> bool:
    meta = node.meta.get(MOE_META)
    return bool(meta is not None and meta.mirror)


def node_attrs(kind: str, mirror: bool = False, highlight: bool = False) -> dict[str, str]:
    look = LOOKS[kind]
    style = ["filled"] + (["dashed"] if mirror else []) + (["bold"] if highlight else [])
    attrs = {
        "shape": look.shape, "style": ",".join(style), "fillcolor": look.fill,
        "class": f"moe-{kind}" + (" moe-mirror" if mirror else "") + (" moe-new" if highlight else ""),
        "fontname": "Helvetica", "fontsize": "10",
    }
    if highlight:
        attrs.update(color="#dc2626", penwidth="3")
    return attrs
