"""place_grad_reduction: gradient-bucket reductions as nodes of the compiled backward.

Terms: MultiGroupDistributedDataParallel (train/ddp.py), dense/expert bucket, slot (a parameter's
stable index in the reducer). Without this pass the compiled backward returns every gradient at once
at its end, so no bucket's all-reduce can start before the whole backward has run.

    moe_ddp::bucket_ready(ctx, slots, grads)   right after the last of a bucket's gradients is produced:
                                               add them into the flat bucket (pre-scaled), and under
                                               sync start the all-reduce of every complete bucket
    moe_ddp::bucket_wait(ctx, like)            before the output: start the buckets still pending,
                                               wait for all, scale (the gradients' first use is
                                               after the backward returns)

    outputs  ← the backward's outputs; output j is the gradient of forward input j (aot_autograd)
    produced ← [(node, slot)] for outputs whose input is a reduced parameter, in node (production) order
    groups   ← reducer.claim(slots)          re-buckets by production order on first sight; by bucket
    for each group: bucket_ready after its last-produced node
    bucket_wait before the output; those outputs become None (autograd accumulates nothing for them)

Under no_sync the nodes only accumulate (the reducer reads its flag when they run). Like AccumulateGrad,
they add only into parameters the running backward accumulates into (none under
torch.autograd.grad(outputs, inputs=activations), as a pipeline stage's metadata inference runs).
Inputs that are not reduced parameters (batch tensors, pipeline activations, frozen weights) keep
their outputs. A program compiled for forwards_in_flight > 1 keeps the hooks: the summed losses of
several forwards run several compiled backwards in one autograd backward, and only the last of them
could start the reductions.
The nodes dispatch on a tensor argument, so on meta tensors (planning runs) they do nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import IRError
from ..train.ddp import reducer
from .base import PassContext


@torch.library.custom_op("moe_ddp::bucket_ready", mutates_args=())
def bucket_ready(ctx: int, slots: list[int], grads: list[torch.Tensor]) -> None:
    reducer(ctx).graph_ready(slots, grads)


@torch.library.custom_op("moe_ddp::bucket_wait", mutates_args=())
def bucket_wait(ctx: int, like: torch.Tensor) -> None:
    reducer(ctx).graph_finish()


for _op in (bucket_ready, bucket_wait):
    _op.register_fake(lambda *a: None)


def place_grad_reduction(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Reduce gradient buckets inside the backward graph, each as soon as its gradients exist."""
    prog = ctx.program
    if prog.options.grad_reduction != "in_graph" or prog.options.forwards_in_flight > 1:
        return gm  # several forwards in flight may share one backward: only its end may reduce (hooks)
    rid = prog.ctx_id if prog.reducer_id is None else prog.reducer_id
    try:
        red = reducer(rid)
    except RuntimeError:  # no data-parallel reducer (no process group): nothing to reduce
        return gm
    g = gm.graph
    out = g.output_node()
    grads = list(out.args[0])
    if len(grads) != len(ctx.input_names):
        raise IRError(f"place_grad_reduction: the backward returns {len(grads)} gradients for {len(ctx.input_names)} "
                      "forward inputs; compile with grad_reduction='hooks'")
    order = {n: i for i, n in enumerate(g.nodes)}
    produced = []
    for j, (gnode, name) in enumerate(zip(grads, ctx.input_names)):
        slot = red.slot(name) if name is not None else None
        if isinstance(gnode, fx.Node) and slot is not None:
            produced.append((order[gnode], slot, j, gnode))
    if not produced:
        return gm
    produced.sort()
    node_of = {slot: gnode for _, slot, _, gnode in produced}
    for group in red.claim([slot for _, slot, _, _ in produced]):
        last = max((node_of[k] for k in group), key=order.__getitem__)
        with g.inserting_after(last):
            n = g.call_function(torch.ops.moe_ddp.bucket_ready.default, (rid, group, [node_of[k] for k in group]))
        n.meta["val"] = None
    with g.inserting_before(out):
        n = g.call_function(torch.ops.moe_ddp.bucket_wait.default, (rid, produced[-1][3]))
    n.meta["val"] = None
    for _, _, j, _ in produced:
        grads[j] = None
    out.args = (type(out.args[0])(grads),) + tuple(out.args[1:])
    g.lint()
    gm.recompile()
    return gm
