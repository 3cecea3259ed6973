"""verify — the IR contract, checked after every pass; failures name the pass that broke it.

    lint the graph
    every call_function node whose value is used has meta['val'] (fake values)
    every moe:: node carries MoENodeMeta
    DENSE:        per MoE block one router and one routed_experts node, no transport
    PARTITIONED+: no routed_experts left; per block exactly one permute, dispatch, grouped_ffn,
                  combine, unpermute in forward, and at most one backward mirror of each;
                  expert weights feed only expert GEMM ops (no dense expert compute left)
"""

from __future__ import annotations

from collections import Counter

import torch.fx as fx

from ..errors import IRError
from ..ir import MOE_META, Stage, get_stage
from ..ops import op_name
from .base import PassContext, moe_nodes, op_arg, user_line

PARTITIONED_OPS = ("permute", "dispatch", "grouped_ffn", "combine", "unpermute")
EXPERT_WEIGHT_USERS = {"grouped_ffn", "grouped_ffn_backward", "routed_experts", "grouped_ffn_mx",
                       "grouped_ffn_backward_mx", "grouped_ffn_biased_backward", "weight_cache"}


def verify(gm: fx.GraphModule, ctx: PassContext, after: str) -> None:
    def fail(msg: str) -> None:
        raise IRError(f"after pass {after}: {msg}")

    try:
        gm.graph.lint()
    except Exception as e:  # noqa: BLE001 - lint raises plain RuntimeError/AssertionError
        fail(f"graph lint failed: {e}")
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.users and "val" not in n.meta:
            fail(f"node {n.name} ({n.target}) has no meta['val']{user_line(n)}")
    per_block: dict[str, Counter] = {}
    for n in moe_nodes(gm):
        if MOE_META not in n.meta:
            fail(f"MoE node {n.name} carries no metadata")
        name = op_name(n.target)
        if name.startswith("lease_") or name in ("quantize_mx", "weight_cache", "mx_linear"):
            continue
        # the MXFP8 expert FFN counts as the expert FFN
        per_block.setdefault(op_arg(n, "block"), Counter())[name.replace("_mx", "")] += 1
    stage = get_stage(gm)
    for block, c in per_block.items():
        if stage == Stage.DENSE:
            if c["routed_experts"] != 1 or c["dispatch"] or c["combine"]:
                fail(f"{block}: a DENSE graph needs one routed_experts node and no transport, found {dict(c)}")
            continue
        if c["routed_experts"]:
            fail(f"{block}: a routed_experts node is left in a {stage.name} graph")
        bad = {o: c[o] for o in PARTITIONED_OPS if c[o] != 1}
        if bad:
            fail(f"{block}: expected exactly one of each of {PARTITIONED_OPS}, counts off: {bad}")
        # A mirror exists only where a gradient flows (no input gradient → no dispatch mirror), but
        # never twice, and never without its forward op.
        extra = {f"{o}_backward": c[f"{o}_backward"] for o in PARTITIONED_OPS if c[f"{o}_backward"] > 1}
        if extra:
            fail(f"{block}: backward mirrors appear more than once: {extra}")
    if stage >= Stage.LEASED and "lease_plan" not in gm.meta:
        fail("a LEASED graph carries no lease plan")
    if stage >= Stage.PARTITIONED:
        for n in moe_nodes(gm, "grouped_ffn") + moe_nodes(gm, "grouped_ffn_mx"):
            for w in (op_arg(n, "w_in"), op_arg(n, "w_out")):
                if op_name(w.target) == "weight_cache":  # MXFP8: check the weight behind its cache
                    w = op_arg(w, "w")
                others = [u for u in w.users if op_name(u.target) not in EXPERT_WEIGHT_USERS]
                if others:
                    fail(f"{op_arg(n, 'block')}: expert weight {w.name} also feeds {[u.name for u in others]} "
                         f"(dense expert compute left){user_line(others[0])}")
