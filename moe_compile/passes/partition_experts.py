"""partition_experts — assign each routed-experts node its expert shard over EP-MP.

Terms: N routed experts, M_E = ep_mp, num_local_experts L = N / M_E. Rank with EP-MP index r stores
experts [r·L, (r+1)·L); dense parameters (router, attention, shared expert) replicate.

    for node in routed_experts nodes:
        shard = ExpertShard(N, M_E, r)                 # same rule on every rank
        check N % M_E == 0
        check the expert-weight inputs are [L, F, d] and [L, d, h]   # the runtime holds only its shard
        check the expert biases (if any) are [L, F] and [L, d]        # sharded with their experts
        node.meta[moe] = MoENodeMeta(role=routed_experts, shard=shard)

Requires DENSE, ensures DENSE (with shards).
"""

from __future__ import annotations

import torch.fx as fx

from ..errors import IRError
from ..ir import Stage
from .base import PassContext, moe_nodes, moe_pass, op_arg, tag_moe_nodes, user_line, val_shape


@moe_pass(requires=Stage.DENSE, ensures=Stage.DENSE)
def partition_experts(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    tag_moe_nodes(gm, ctx)
    prog = ctx.program
    for n in moe_nodes(gm, "routed_experts"):
        spec = prog.blocks[op_arg(n, "block")]
        e = spec.experts
        if e.num_experts % prog.ep_size:
            raise IRError(f"{spec.path}: {e.num_experts} experts cannot be split over ep_mp={prog.ep_size}")
        nl = e.num_experts // prog.ep_size
        want_in, want_out = (nl, e.in_rows, e.d_model), (nl, e.d_model, e.hidden)
        got_in, got_out = val_shape(op_arg(n, "w_in")), val_shape(op_arg(n, "w_out"))
        if (got_in, got_out) != (want_in, want_out):
            raise IRError(
                f"{spec.path}: expert weights reach the graph as {got_in}, {got_out}, but rank {prog.ep_rank} of "
                f"ep_mp={prog.ep_size} must hold its shard {want_in}, {want_out}{user_line(n)}"
            )
        if e.bias:  # expert biases shard with their experts: rows [r·L, (r+1)·L)
            b_in, b_out = op_arg(n, "b_in"), op_arg(n, "b_out")
            got = (val_shape(b_in), val_shape(b_out)) if b_in is not None and b_out is not None else None
            if got != ((nl, e.in_rows), (nl, e.d_model)):
                raise IRError(f"{spec.path}: expert biases reach the graph as {got}, but rank {prog.ep_rank} of "
                              f"ep_mp={prog.ep_size} must hold its shard {(nl, e.in_rows)}, {(nl, e.d_model)}{user_line(n)}")
    return gm
