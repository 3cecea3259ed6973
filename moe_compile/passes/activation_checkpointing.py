"""activation_checkpointing — which forward values the joint graph saves for backward, and which it
recomputes there (CompileOptions.activation_checkpointing).

Terms: a *saved* value stays live from forward to backward (M_saved); a *recomputed* one is rebuilt in
backward from saved values, right before its first backward reader (the partitioner reorders backward
to mimic the autograd engine). Tags are torch.utils.checkpoint's CheckpointPolicy in node.meta["recompute"]:

    mode        recompute (PREFER_RECOMPUTE)                         save (MUST_SAVE)
    None        nothing (default_partition, as before)               every value backward reads
    selective   elementwise / view / reduction ops,                  GEMM outputs (mm, attention,
                permute / unpermute                                  grouped expert FFN)
    moe         every op inside an MoE block where legal             untagged: min-cut decides
    full        every op inside a decoder layer where legal          each decoder layer's outputs
                                                                     (= the next layer's inputs);
                                                                     outside layers: min-cut decides
    every mode  —                                                    NEVER_RECOMPUTE below

    NEVER_RECOMPUTE (always MUST_SAVE, whatever the mode):
      * moe::router, the routing decision ([T, K] indices and weights, [T, N] scores): its input is
        recomputed in backward by other kernels than in forward (inductor fuses a backward recompute
        differently), which may round otherwise (bf16: logits 8e-3 apart) and flip a near tie in top-k,
        so backward would differentiate another routing than forward ran (measured: 1–3 of 128 tokens)
      * transport and other moe:: ops outside PURE_LOCAL: dispatch / combine are collectives; one
        recomputed on some ranks only deadlocks the others, and each one re-writes symmetric payloads the
        lease plan placed at their joint-graph position (passes/plan_leases.py); recomputing a
        collective would thus need a collective in backward — we save its outputs instead
      * random (seeded) ops: dropout would draw a different mask; attention is seeded too (dropout_p)
      * impure ops (side effects)
      * an op reading a transport output (e.g. received rows in symmetric memory) whose first
        backward use would come after that payload's last backward reader: its lease would be
        released already (a read of a reused slot)

"selective" goes through default_partition (recompute exactly what is tagged; everything else that
backward reads is saved). "moe" and "full" go through torch's min-cut partitioner, which honours the tags
and decides the untagged rest (it never recomputes custom or collective ops); readers of transport outputs
are saved for it. Both are deterministic functions of the graph, hence the same on every rank.
"""

from __future__ import annotations

import operator
import re
from collections import Counter

import torch
import torch.fx as fx
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy

from ..ops import op_name
from ..viz.graph import module_path
from .plan_leases import backward_nodes

MODES = (None, "selective", "moe", "full")
# min-cut saves less where the tags leave ops untagged (tiny OLMoE, S=64: moe −21%, full −5% saved bytes);
# selective tags every op, so min-cut cannot improve it, and default_partition keeps it exactly as tagged
MIN_CUT_MODES = ("moe", "full")
PURE_LOCAL = ("router", "permute", "unpermute", "grouped_ffn")  # moe:: ops without communication or state
MOE_GEMMS = ("grouped_ffn", "grouped_ffn_mx", "mx_linear")
_aten = torch.ops.aten
GEMMS = {  # aten ops whose outputs "selective" keeps (matmul-class work: costly to redo)
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.convolution.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_mm.default,
}
if hasattr(_aten, "_grouped_mm"):
    GEMMS.add(_aten._grouped_mm.default)
_LAYER = re.compile(r"^(.*?\.\d+)(?=\.|$)")  # "model.layers.3.mlp.experts.1" → "model.layers.3"




def layer_of(n: fx.Node) -> str | None:
    """Decoder layer (module path up to the first list index) of ``n``, or of the op a getitem reads."""
    p = module_path(_producer(n))
    m = _LAYER.match(p) if p else None
    return m.group(1) if m else None


def _producer(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _is_random(n: fx.Node) -> bool:
    """A seeded op (dropout, and attention, whose dropout_p may be 0): recomputing one makes torch
    functionalize the RNG (an rng-state value of symbolic size the lease lowering cannot place), and
    with dropout_p > 0 a plain recompute would draw a different mask. Their outputs are saved."""
    return torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())


def _never_recompute(n: fx.Node) -> str | None:
    name = op_name(n.target)
    if name == "router":
        return "moe::router: the routing is saved (recomputed from recomputed inputs it may pick other experts)"
    if name is not None:
        return None if name in PURE_LOCAL else f"moe::{name} communicates or holds state"
    ns = str(getattr(n.target, "namespace", ""))
    if ns == "moe_check":
        return "moe_check:: op (a check that raises; its copy is small)"
    if ns.startswith("moe") or ns in ("_c10d_functional", "c10d_functional", "_dtensor"):
        return f"{ns}:: op (collective)"
    if _is_random(n):
        return "random op (a recompute would draw different numbers)"
    if n.is_impure(impure_random=False):
        return "impure op"
    return None


def _wanted(n: fx.Node, mode: str, blocks: set[str]) -> bool:
    """Whether ``mode`` asks to recompute ``n`` (legality is checked separately)."""
    name = op_name(n.target)
    if mode == "selective":
        return n.target not in GEMMS and name not in MOE_GEMMS
    if mode == "moe":
        p = module_path(n)
        return p is not None and any(p == b or p.startswith(b + ".") for b in blocks)
    return layer_of(n) is not None  # full


def tag_recompute(joint: fx.GraphModule, mode: str, blocks: set[str] = frozenset(), min_cut: bool = False) -> Counter:
    """Set node.meta["recompute"] on the forward nodes of ``joint``; returns a count per decision. With
    ``min_cut`` the untagged readers of transport outputs are saved too (min-cut decides untagged ops)."""
    nodes = list(joint.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    bwd = backward_nodes(joint)
    fwd = [n for n in nodes if n.op == "call_function" and n not in bwd]
    tensor = {n for n in fwd if isinstance(n.meta.get("val"), torch.Tensor | tuple | list)}
    why: dict[fx.Node, str] = {}
    tag: dict[fx.Node, CheckpointPolicy] = {}
    for n in fwd:
        if n.target is operator.getitem or n not in tensor:
            continue
        reason = _never_recompute(n)
        if reason:
            tag[n], why[n] = CheckpointPolicy.MUST_SAVE, reason
        elif _wanted(n, mode, blocks):
            tag[n] = CheckpointPolicy.PREFER_RECOMPUTE
    if mode == "full":  # layer outputs are saved: they are the next layer's inputs
        for n in fwd:
            if tag.get(_producer(n)) == CheckpointPolicy.PREFER_RECOMPUTE and any(
                    u not in bwd and layer_of(u) != layer_of(n) for u in n.users):
                tag[_producer(n)], why[_producer(n)] = CheckpointPolicy.MUST_SAVE, "decoder layer output"
    if mode == "selective":  # keep the GEMM outputs
        for n in fwd:
            if n not in tag and (n.target in GEMMS or op_name(n.target) in MOE_GEMMS):
                tag[n], why[n] = CheckpointPolicy.MUST_SAVE, "GEMM output"

    def recomputed(n: fx.Node) -> bool:
        return tag.get(_producer(n)) == CheckpointPolicy.PREFER_RECOMPUTE

    transport = [n for n in fwd if op_name(n.target) is not None and op_name(n.target) not in PURE_LOCAL]
    changed = True
    while changed:  # a recompute reading a transport output must run before that payload is released
        changed = False
        first_need: dict[fx.Node, float] = {}
        for n in reversed(fwd):
            first_need[n] = min((pos[u] if u in bwd else first_need.get(u, float("inf")) if recomputed(u)
                                 else float("inf") for u in n.users), default=float("inf"))
        for t in transport:
            outs = [u for u in t.users if u.target is operator.getitem] or [t]
            for o in outs:
                readers = [u for u in o.users if u in bwd]
                release = max((pos[r] for r in readers), default=-1)
                for u in o.users:
                    p = _producer(u)
                    if u in bwd or not recomputed(u) or first_need[p] <= release:
                        continue
                    tag[p], why[p] = CheckpointPolicy.MUST_SAVE, f"reads {t.name} after its lease ends"
                    changed = True
    if min_cut:
        for t in transport:
            for o in [u for u in t.users if u.target is operator.getitem] or [t]:
                for u in o.users:
                    if u not in bwd and _producer(u) not in tag:
                        tag[_producer(u)], why[_producer(u)] = CheckpointPolicy.MUST_SAVE, f"reads {t.name}"
    for n, t in tag.items():
        n.meta["recompute"] = t
        n.meta["recompute_reason"] = why.get(n, "")
        for u in n.users:  # getitems of a multi-output op share its decision
            if u.target is operator.getitem:
                u.meta["recompute"] = t
    counts = Counter("recompute" if t == CheckpointPolicy.PREFER_RECOMPUTE else why.get(n, "save")
                     for n, t in tag.items())
    joint.meta["activation_checkpointing"] = {"mode": mode, "decisions": dict(counts)}
    return counts


def partition(joint: fx.GraphModule, joint_inputs, mode: str | None, blocks: set[str] = frozenset(),
              min_cut: bool | None = None, **kw):
    """Forward and backward graphs of ``joint`` under checkpointing ``mode`` (see the module docstring).
    ``min_cut`` None: where it helps (MIN_CUT_MODES)."""
    if mode is None:
        return default_partition(joint, joint_inputs, **kw)
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r}: supported values are {MODES}")
    min_cut = mode in MIN_CUT_MODES if min_cut is None else min_cut
    tag_recompute(joint, mode, set(blocks), min_cut)
    if min_cut:
        return min_cut_rematerialization_partition(joint, joint_inputs, **kw)
    return default_partition(joint, joint_inputs, **kw)
