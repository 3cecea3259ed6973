"""The torch.compile backend: dynamo graph → forward passes → aot_autograd (joint passes, partition)
→ codegen lowering of the forward and backward graphs."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._functorch.partitioners import default_partition
from torch._guards import detect_fake_mode

from .capture import decompositions
from .codegen import lower
from .codegen.dense_fusion import dense_executable
from .ir import Stage, get_stage, set_stage
from .passes import FORWARD_PASSES, JOINT_PASSES, PassContext, run_passes
from .passes.base import normalize_capture, tag_moe_nodes
from .passes.grad_reduction import place_grad_reduction
from .passes.mxfp8_casts import apply_mxfp8
from .passes.plan_leases import build_plan
from .program import Program


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy for inspection (node meta shallow-copied; no tensors duplicated)."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    if out is not None:
        g.output(out)
    copy = fx.GraphModule(gm, g)
    copy.meta.update(gm.meta)
    return copy


class MoEBackend:
    def __init__(self, program: Program) -> None:
        self.program = program

    def __call__(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
        prog = self.program
        if prog.options.capacity_factor is None and prog.ep_size > 1:  # dropless: capacity follows the load
            from .runtime.dropless import DroplessEntry, dropless_state

            pristine, first = snapshot(gm), [gm]  # each recompile runs the passes on a fresh copy

            def build():
                return self.compile(first.pop() if first else snapshot(pristine), example_inputs)

            state = dropless_state(prog.ctx_id, prog.ep_size, prog.options.dropless_headroom)
            return DroplessEntry(state, build)
        return self.compile(gm, example_inputs)

    def compile(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
        prog = self.program
        prog.compiles += 1
        debug = prog.debug_path()
        fake_mode = detect_fake_mode(example_inputs)
        normalize_capture(gm)
        set_stage(gm, Stage.DENSE)
        names = [prog.param_names.get(id(t)) for t in example_inputs]
        ctx = PassContext(prog, fake_mode, input_names=names)
        tag_moe_nodes(gm, ctx)
        prog.graphs = {"captured": snapshot(gm)}  # a new capture: none of the last one's graphs stays
        gm = run_passes(gm, ctx, FORWARD_PASSES, debug, "fwd_")
        prog.graphs["partitioned"] = snapshot(gm)
        mine = prog.graphs
        stage = get_stage(gm)
        joint_plan: list = []  # the training compile's lease plan (set by partition_fn)

        def partition_fn(joint: fx.GraphModule, joint_inputs, **kw):
            jctx = PassContext(prog, detect_fake_mode(joint_inputs) or fake_mode, is_joint=True,
                               dispatch=ctx.dispatch, records=ctx.records, input_names=names)
            set_stage(joint, stage)
            tag_moe_nodes(joint, jctx)
            joint = run_passes(joint, jctx, JOINT_PASSES, debug, "joint_")
            mine["joint"] = snapshot(joint)
            prog.training_graphs = mine  # this capture trains: the ledger reads its graphs
            prog.records = list(jctx.records)
            joint_plan.append(jctx.lease_plan)
            prog.lease_plans["training"] = jctx.lease_plan
            if prog.options.activation_checkpointing is None:
                return default_partition(joint, joint_inputs, **kw)
            from .passes.activation_checkpointing import partition  # what backward recomputes
            return partition(joint, joint_inputs, prog.options.activation_checkpointing, set(prog.blocks), **kw)

        def compiler(kind: str):
            def compile_graph(g: fx.GraphModule, _inputs):
                gctx = PassContext(prog, fake_mode, dispatch=ctx.dispatch, input_names=names)
                tag_moe_nodes(g, gctx)
                if joint_plan:
                    gctx.lease_plan = joint_plan[0]
                else:  # inference: no joint graph; cast here, and every payload is transient
                    g = apply_mxfp8(g, gctx)
                    gctx.lease_plan = build_plan(g, gctx)
                    prog.lease_plans["inference"] = gctx.lease_plan
                if kind == "backward":  # bucket all-reduces as nodes, overlapping the backward
                    g = place_grad_reduction(g, gctx)
                g = lower(g, gctx, kind)
                tag_moe_nodes(g, gctx)  # lowering may add nodes (lease ops)
                mine[kind] = g  # the FX graph for inspection; it runs as dense_executable makes it
                return make_boxed_func(dense_executable(g, prog).forward)

            return compile_graph

        return aot_module_simplified(
            gm, example_inputs, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
            partition_fn=partition_fn, decompositions=decompositions(),
        )
