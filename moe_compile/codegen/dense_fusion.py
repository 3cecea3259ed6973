"""Dense fusion: the dense part of a lowered forward/backward graph compiled with inductor.

    inline    first, on a copy: the routed-row ops that are index arithmetic (unpermute, its backward,
              permute's backward) become aten nodes, so they fuse with the dense code around them
              (row_decompositions.py); on CPU at ep_mp = 1 the expert FFN and its backward become their GEMMs
              (moe::expert_mm ops) around the activation in aten, fused into one loop each way
              (ffn_decompositions.py)
    split     the lowered graph, in node order, into maximal runs of pure aten nodes ("segments")
              and the opaque nodes between them: every moe::/moe_triton::/moe_cp:: op, lease op,
              collective, or anything with side effects (by schema or effect registration)
    compile   each segment that computes something (not only views) with inductor
              (``torch._inductor.standalone_compile`` on the segment's fake inputs)
    stitch    an outer GraphModule that runs the opaque nodes eagerly, in their original order,
              and calls the compiled segments between them

Numerics: inductor keeps reduced-precision (bf16) intermediates of a fused loop in float32 where the
eager graph rounds each op's output, so bf16 results differ from dense_fusion="none" by more than one
rounding, and a router's top-k can pick differently on near-ties (torch.compile's default behaviour too;
torch._inductor.config.emulate_precision_casts=True rounds as eager does). fp32 matches to 1e-5.

Why split instead of handing the whole graph to inductor: the lease ops return nothing and depend on
no tensor they order against (``lease_release`` follows its reader only by position), so inductor's
dead-code elimination and its memory-driven reordering would drop or move them; transport ops are
collectives whose order must match across ranks. Inside a segment every op is pure, so any fusion or
reordering inductor does there is safe. ``prog.graphs[kind]`` keeps the unsplit lowered graph.

    dense_fusion="inductor"  always (CPU needs a C++ compiler: a clear error if there is none)
    dense_fusion="none"      the lowered graph runs as it is
    dense_fusion="auto"      per device (AUTO_DEFAULT), by measurement:
        CPU   "none". benchmarks/one_rank_step.py (OLMoE-like, 4 layers, d=256, 16 experts, top-8,
              4×256 tokens, one thread) measured the step on a quiet 2-core machine at 0.70× HF eager
              with inductor (row ops inlined) against 0.90× without (medians; 0.85 in an earlier run).
              The compile costs 3.7 s more per program with a warm inductor cache and 2-3× as long
              cold (a C++ build per distinct segment), so 61 ms per step pays it back after 60-400
              steps, and on CPU this project compiles many short programs (tests, demos) where that
              never happens. Long CPU runs should pass dense_fusion="inductor".
              Without a C++ compiler auto is "none" anyway.
        CUDA  "inductor". The same benchmark with --device cuda on one H200 (torch 2.11, triton 3.6,
              fp32, 3 rounds): 24.5 ms per step with inductor against 36.8 ms without and 38.1 ms
              for HF eager (0.64× and 0.97× HF eager; minima 0.61× and 0.79×). This size is launch-
              bound on a GPU (GEMMs 0.6 ms of the step), which fusion helps most; at every size it
              removes the dense part's elementwise round trips through memory. The compile cost 25 s
              more (81.5 s against 56.5 s, cold cache), repaid after about 2,000 steps here — GPU
              runs are training runs, so auto takes it.
"""

from __future__ import annotations

import inspect
import operator
import shutil
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..errors import OptionError
from .row_decompositions import inline_row_ops

DENSE_NAMESPACES = ("aten", "prims")
# aten ops that move no data: a segment made only of these is not worth an inductor compile
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze", "unsqueeze",
             "slice", "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "unbind"}
# which mode "auto" picks per device type (see the module docstring for the measurement)
AUTO_DEFAULT = {"cpu": "none", "cuda": "inductor"}


def _compiler_names() -> list[str]:
    """The compiler names inductor's CPU backend tries (its config reads CXX when torch is imported)."""
    from torch._inductor import config

    names = config.cpp.cxx if isinstance(config.cpp.cxx, list | tuple) else (config.cpp.cxx,)
    return [n for n in names if n]


def cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use, or None when there is none."""
    return next((shutil.which(n) for n in _compiler_names() if shutil.which(n)), None)


def resolve_dense_fusion(mode: str, device_type: str) -> str:
    """"inductor" | "none" for this device; "inductor" on CPU without a C++ compiler raises."""
    if mode == "auto":
        mode = AUTO_DEFAULT.get(device_type, "none")
        if mode == "inductor" and device_type == "cpu" and cpp_compiler() is None:
            mode = "none"  # auto never requires a compiler: without one the dense part stays eager
    if mode == "inductor" and device_type == "cpu" and cpp_compiler() is None:
        raise OptionError(
            f"dense_fusion='inductor' on CPU needs a C++ compiler for inductor's kernels, and none of "
            f"{_compiler_names()} is on PATH: install g++ (or set CXX before torch is imported, or "
            "torch._inductor.config.cpp.cxx), or use dense_fusion='none'")
    return mode


def _is_dense(n: fx.Node, opaque: set[fx.Node]) -> bool:
    if n.op != "call_function":
        return False
    t = n.target
    if t is operator.getitem:  # a getitem belongs with the node it unpacks
        return n.args[0] not in opaque
    if not isinstance(t, torch._ops.OpOverload) or t.namespace not in DENSE_NAMESPACES:
        return False
    from torch._library.utils import is_impure

    return not is_impure(t, impure_random=True)


def _computes(nodes: list[fx.Node]) -> bool:
    return any(n.target is not operator.getitem and n.target._overloadpacket.__name__ not in _VIEW_OPS
               for n in nodes)


def split_segments(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Maximal runs of consecutive dense nodes, in graph order; an inlined row op starts a new run.

    The cut before an inlined row op makes its inputs materialised tensors: inside one segment
    inductor would recompute a pointwise producer (say the norm backward that makes unpermute's
    grad_y) once per routed row that reads it, K times over. Its outputs still fuse downstream."""
    runs: list[list[fx.Node]] = []
    opaque: set[fx.Node] = set()
    cur: list[fx.Node] = []
    group = None
    for n in gm.graph.nodes:
        if _is_dense(n, opaque):
            g = n.meta.get("moe_inlined_from")
            if g is not None and g != group and cur:
                runs.append(cur)
                cur = []
            group = g
            cur.append(n)
            continue
        if n.op == "call_function":
            opaque.add(n)
        if cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


class _Compiled(torch.nn.Module):
    """One compiled segment as a module the outer graph can call (inductor returns a callable object).

    Inductor's kernels assume the strides of the example inputs, but a producer may hand over another
    layout of the same values (e.g. a compiled segment returning a permuted view where the eager graph
    had a contiguous tensor); such an input is copied into the expected layout first."""

    def __init__(self, fn, fake: list) -> None:
        super().__init__()
        self.fn = fn
        self.layouts = [(tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor) else None for v in fake]

    def forward(self, *args):
        args = list(args)
        for i, (a, lay) in enumerate(zip(args, self.layouts)):
            if lay is not None and a.stride() != lay[1]:
                args[i] = torch.empty_strided(*lay, dtype=a.dtype, device=a.device).copy_(a)
        return self.fn(*args)


# a view the traced graph took of a contiguous value may not be one after inductor's decompositions,
# which do not keep every op's output layout: its cat of a tensor with legacy empty ones (MiMo-V2-Flash's
# rotary `cat([k_embed, k_pass])`, k_pass empty) clones that tensor with its strides, where aten.cat returns a contiguous
# result. The graph is functional, so a reshape (a view wherever the layout allows) computes the same.
_RESHAPED_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def _segment_module(gm: fx.GraphModule, seg: list[fx.Node], later_users: set[fx.Node]):
    """A GraphModule of ``seg``: inputs = what it reads from outside, outputs = what later nodes read."""
    inside = set(seg)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    for n in seg:
        for a in n.all_input_nodes:
            if a not in inside and a not in env:
                env[a] = g.placeholder(a.name)
                env[a].meta.update(a.meta)
                inputs.append(a)
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.target in _RESHAPED_VIEWS:
            env[n].target = torch.ops.aten.reshape.default
    outputs = [n for n in seg if any(u in later_users for u in n.users)]
    g.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, g), inputs, outputs


def _example_inputs(vals: list) -> tuple[Any, list]:
    """A fake mode with a ShapeEnv (standalone_compile needs one) and the segment's inputs in it, static
    shapes. Under dynamo the graph's own values have one; a dropless rebuild (runtime/dropless.py)
    lowers again outside dynamo, in a fake mode without, so its inputs are re-made, same layouts."""
    mode = detect_fake_mode(vals)
    if mode is not None and mode.shape_env is not None:
        return mode, vals
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        return mode, [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                      if isinstance(v, torch.Tensor) else v for v in vals]


def _standalone_compile(sub: fx.GraphModule, fake: list, mode):
    """inductor's standalone_compile of ``sub`` on ``fake`` (static shapes, in ``mode``). torch 2.13
    takes the fake mode as an argument; torch 2.11 has no ``fake_mode`` (a TypeError, seen on its CUDA
    build) and reads the same mode from a tracing context instead."""
    compile_ = torch._inductor.standalone_compile
    if "fake_mode" in inspect.signature(compile_).parameters:
        return compile_(sub, fake, dynamic_shapes="from_example_inputs", fake_mode=mode)
    with torch._guards.tracing(torch._guards.TracingContext(mode)):
        return compile_(sub, fake, dynamic_shapes="from_tracing_context")


def fuse_dense(gm: fx.GraphModule, ffn: bool = True) -> tuple[fx.GraphModule, dict[str, Any]]:
    """An executable copy of ``gm`` whose dense segments run as inductor kernels; returns it and a
    summary (segments compiled, nodes in them, opaque nodes kept, row ops inlined). ``ffn``: inline the
    expert FFN's activation too (ffn_decompositions.py)."""
    gm, inlined = inline_row_ops(gm, ffn)
    segs = [s for s in split_segments(gm) if _computes(s)]
    in_seg = {n: i for i, s in enumerate(segs) for n in s}
    out_g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root = torch.nn.Module()
    done: set[int] = set()
    for n in gm.graph.nodes:
        i = in_seg.get(n)
        if i is None:
            env[n] = out_g.node_copy(n, lambda a: env[a])
            continue
        if i in done:
            continue
        done.add(i)
        inside = set(segs[i])
        later = {u for m in segs[i] for u in m.users if u not in inside}
        sub, inputs, outputs = _segment_module(gm, segs[i], later)
        mode, fake = _example_inputs([a.meta["val"] for a in inputs])
        fn = _standalone_compile(sub, fake, mode)
        name = f"dense_{i}"
        root.add_module(name, _Compiled(fn, fake))
        call = out_g.call_module(name, tuple(env[a] for a in inputs))
        for k, o in enumerate(outputs):
            env[o] = out_g.call_function(operator.getitem, (call, k))
            env[o].meta.update(o.meta)
    for name, mod in gm.named_children():  # submodules/attributes the copied opaque nodes may reference
        if not hasattr(root, name):
            root.add_module(name, mod)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and not hasattr(root, n.target):
            setattr(root, n.target, getattr(gm, n.target))
    out = fx.GraphModule(root, out_g)
    summary = {"segments": len(segs), "fused_nodes": len(in_seg),
               "kept_nodes": sum(1 for n in out_g.nodes if n.op == "call_function"), "inlined_row_ops": inlined}
    return out, summary


def dense_executable(gm: fx.GraphModule, program) -> fx.GraphModule:
    """What runs for the lowered graph ``gm``: itself, or (dense_fusion resolves to "inductor") its
    fused copy; the choice and the split are recorded in ``gm.meta["moe_dense_fusion"]``."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    types = {v.device.type for v in vals if isinstance(v, torch.Tensor)}
    device = next(iter(types - {"cpu"}), "cpu")  # an accelerator graph may also take CPU tensors
    mode = resolve_dense_fusion(program.options.dense_fusion, device)
    gm.meta["moe_dense_fusion"] = {"mode": mode}
    if mode == "none":
        return gm
    # the inlined FFN activation runs over every row of the receive buffer: on one EP rank exactly the
    # routed rows, under EP up to ep_mp times more (dropless capacity, grown), which is not measured
    fused, summary = fuse_dense(gm, ffn=program.ep_size == 1)
    gm.meta["moe_dense_fusion"].update(summary, executable=fused)
    return fused
