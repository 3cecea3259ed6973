"""Pass infrastructure: the pass signature ``(gm, ctx) -> gm``, stage pre/postconditions, MoE node
tagging, and fake-value propagation for nodes a pass inserts."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import IRError
from ..ir import MOE_META, DispatchSpec, ExpertShard, MoENodeMeta, Role, Stage, get_stage
from ..ops import op_name

_ROLES = {
    "router": Role.ROUTER,
    "routed_experts": Role.ROUTED_EXPERTS,
    "permute": Role.PERMUTE,
    "dispatch": Role.DISPATCH,
    "local_layout": Role.DISPATCH,
    "grouped_ffn": Role.EXPERT_FFN,
    "grouped_ffn_mx": Role.EXPERT_FFN,
    "grouped_ffn_biased": Role.EXPERT_FFN,  # its backward: grouped_ffn_biased_backward (expert biases)
    "combine": Role.COMBINE,
    "unpermute": Role.UNPERMUTE,
    "quantize_mx": Role.CAST,
    "weight_cache": Role.CAST,
    "mx_linear": Role.CAST,
}


def role_of(name: str) -> tuple[Role, bool]:
    """(role, is backward mirror) of a moe:: op name."""
    mirror = "_backward" in name
    return _ROLES[name.replace("_backward", "")], mirror


@dataclass
class PassRecord:
    name: str
    op_diff: dict[str, int]  # op name → count after − count before (non-zero only)


@dataclass
class PassContext:
    """What passes may read: the program being compiled and this graph's compile-time facts."""

    program: Any  # moe_compile.program.Program
    fake_mode: Any = None
    is_joint: bool = False
    dispatch: dict[str, DispatchSpec] = field(default_factory=dict)  # block → transport shape
    records: list[PassRecord] = field(default_factory=list)
    lease_plan: Any = None  # moe_compile.leases.LeasePlan, once plan_leases ran
    input_names: list[str | None] = field(default_factory=list)  # graph input index → parameter name


PassFn = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


@dataclass(frozen=True)
class MoEPass:
    name: str
    fn: PassFn
    requires: Stage | tuple[Stage, ...]
    ensures: Stage
    graph: str  # "forward" (before autograd) | "joint"
    doc: str = ""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        return self.fn(gm, ctx)


def moe_pass(*, requires: Stage | tuple[Stage, ...], ensures: Stage,
             graph: str = "forward") -> Callable[[PassFn], MoEPass]:
    def wrap(fn: PassFn) -> MoEPass:
        return MoEPass(fn.__name__, fn, requires, ensures, graph, (fn.__doc__ or "").strip())

    return wrap


# -- node helpers ----------------------------------------------------------------------------------


def op_arg(node: fx.Node, name: str) -> Any:
    """Argument ``name`` of a ``moe::`` op node, positional or keyword."""
    names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
    i = names.index(name)
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[i] if i < len(node.args) else node.target._schema.arguments[i].default_value  # type: ignore[union-attr]


def moe_nodes(gm: fx.GraphModule, name: str | None = None) -> list[fx.Node]:
    return [
        n for n in gm.graph.nodes
        if n.op == "call_function" and op_name(n.target) is not None and (name is None or op_name(n.target) == name)
    ]


def op_counts(gm: fx.GraphModule) -> Counter:
    c: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            c[op_name(n.target) or getattr(n.target, "__name__", str(n.target))] += 1
    return c


def user_line(node: fx.Node) -> str:
    """The user's source line that produced ``node`` (innermost frame of its stack trace), if known."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    files = [i for i, ln in enumerate(lines) if ln.strip().startswith("File ")]
    if not files:
        return ""
    i = files[-1]
    where = lines[i].strip()
    code = lines[i + 1].strip() if i + 1 < len(lines) else ""
    return f" (from {where}: {code})"


def tag_moe_nodes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """(Re)derive MoENodeMeta of every moe:: node from its op, its ``block`` argument and the program."""
    prog = ctx.program
    for n in moe_nodes(gm):
        name = op_name(n.target)
        if name.startswith("lease_"):
            payload = op_arg(n, "payload") if name != "lease_activate" else ""
            n.meta[MOE_META] = MoENodeMeta(block=payload.split("/")[0], role=Role.LEASE, layer_index=-1,
                                           extra={"op": name, "payload": payload})
            continue
        role, mirror = role_of(name)
        block = op_arg(n, "block")
        spec = prog.blocks.get(block)
        if spec is None:
            if role == Role.CAST:  # a cast on a dense linear: no MoE block
                n.meta[MOE_META] = MoENodeMeta(block=block, role=role, layer_index=-1, mirror=mirror)
                continue
            raise IRError(f"node {n.name} ({name}) names MoE block {block!r}, which the front end never recognised")
        shard = ExpertShard(spec.experts.num_experts, prog.ep_size, prog.ep_rank)
        n.meta[MOE_META] = MoENodeMeta(
            block=block, role=role, layer_index=spec.index, shard=shard,
            dispatch=ctx.dispatch.get(block), mirror=mirror,
        )


def propagate_fake(nodes: list[fx.Node]) -> None:
    """Fill ``meta['val']`` of inserted nodes by running their targets on the fake values of their
    inputs (in the fake mode those values belong to)."""

    def val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, fx.Node) else a

    inputs = [val(a) for n in nodes for a in n.all_input_nodes if a not in nodes]
    fake_mode = next(t.fake_mode for t in inputs if isinstance(t, FakeTensor))
    with fake_mode:
        for n in nodes:
            args = fx.node.map_aggregate(n.args, val)
            kwargs = fx.node.map_aggregate(n.kwargs, val)
            if n.target is operator.getitem:
                n.meta["val"] = args[0][args[1]]
            else:
                n.meta["val"] = n.target(*args, **kwargs)


def normalize_capture(gm: fx.GraphModule) -> None:
    """Dynamo graphs keep fake values under 'example_value' (the IR contract wants 'val') and may call
    ops through their overload packet (passes match ``.default`` overloads)."""
    for n in gm.graph.nodes:
        if "val" not in n.meta and "example_value" in n.meta:
            n.meta["val"] = n.meta["example_value"]
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverloadPacket) and op_name(n.target):
            n.target = n.target.default
    gm.recompile()


def require_stage(gm: fx.GraphModule, p: MoEPass) -> None:
    allowed = p.requires if isinstance(p.requires, tuple) else (p.requires,)
    if get_stage(gm) not in allowed:
        want = " or ".join(s.name for s in allowed)
        raise IRError(f"pass {p.name} requires a {want} graph, got {get_stage(gm).name}")


def val_shape(node: Any) -> tuple[int, ...]:
    v = node.meta["val"]
    return tuple(int(s) for s in v.shape)


def is_tensor_val(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)
