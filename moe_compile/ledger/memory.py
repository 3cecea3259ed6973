"""Execution working memory read off the executable forward and backward graphs (liveness).

Every value's bytes come from its fake tensor (``meta['val']``); views share their storage and count
once. The model follows how the compiled program runs:

    forward:  a value is allocated when its node runs and freed after its last user (FX frees dead
              locals), unless the graph returns it: user outputs and tensors saved for backward stay
    backward: starts with what forward left live (saved tensors, user outputs) plus the tangents;
              saved tensors stay live until the backward graph returns (the boxed call keeps its
              argument list; see ``saved_until_end``); the gradients it returns are live together
              at its end, before autograd accumulates them into ``.grad``
    high-water = the most bytes live at any node, beyond parameters and inputs
    checkpointing (CompileOptions.activation_checkpointing) changes the graphs, not this model: the
              forward saves less, and the backward's recomputed ops are ordinary nodes of its graph

Kernel-internal temporaries (inside one op) are not graph values and are not counted. Under the
symmetric transport the rows dispatch and combine_backward write live in the lease pools' symmetric
memory (M_sym), not in the allocator: those outputs are left out here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from ..ir import MOE_META
from ..ops import op_name

SYMMETRIC_WRITERS = ("dispatch", "combine_backward")  # their row outputs are lease-pool views


@dataclass(frozen=True)
class GraphMemory:
    saved_bytes: int  # activations the forward keeps for backward (parameters and inputs excluded)
    saved_moe_bytes: dict[str, int]  # of those, produced by moe:: ops, by role
    output_bytes: int  # user outputs the forward returns (loss, logits, …)
    forward_high_water: int
    backward_high_water: int
    grad_bytes: int  # gradients the backward graph returns together
    profile: list[tuple[str, int]] = field(default_factory=list, compare=False)  # (graph:node, live bytes)
    recomputed: int = 0  # forward ops the backward graph recomputes (activation checkpointing)

    @property
    def high_water(self) -> int:
        return max(self.forward_high_water, self.backward_high_water)


def _tensors(v: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(v) if isinstance(t, torch.Tensor)]


def _key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _producer(n: fx.Node) -> fx.Node:
    """The node that computed ``n``'s value (a getitem's tuple-producing parent)."""
    import operator

    while n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


class _Sim:
    """Live bytes over one graph; ``live`` maps storage keys to bytes, ``held`` keys never freed here."""

    def __init__(self, tag: str, live: dict, record: bool) -> None:
        self.tag = tag
        self.live = live
        self.cur = sum(live.values())
        self.peak = self.cur
        self.profile: list[tuple[str, int]] = []
        self.record = record

    def run(self, gm: fx.GraphModule, external: set, keep: set[fx.Node], free_placeholders: bool,
            symmetric: bool = False) -> None:
        nodes = list(gm.graph.nodes)
        if symmetric:
            for n in nodes:
                if n.op == "call_function" and op_name(n.target) in SYMMETRIC_WRITERS:
                    v = n.meta.get("val")
                    for t in _tensors(v[0] if op_name(n.target) == "dispatch" else v):
                        external.add(_key(t))
        last: dict[fx.Node, int] = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last[a] = i
        owners: dict[StorageWeakRef, set[fx.Node]] = defaultdict(set)
        for i, n in enumerate(nodes):
            if n.op in ("placeholder", "call_function"):
                for t in _tensors(n.meta.get("val")):
                    k = _key(t)
                    if n.op == "call_function" and k not in external and k not in self.live:
                        self.live[k] = _nbytes(t)
                        self.cur += self.live[k]
                    owners[k].add(n)
                self.peak = max(self.peak, self.cur)
                if self.record and n.op == "call_function":
                    self.profile.append((f"{self.tag}:{n.name}", self.cur))
            dead = [a for a in n.all_input_nodes if last[a] == i]
            if n.op == "call_function" and not n.users:
                dead.append(n)
            for a in dead:
                if a in keep or (a.op == "placeholder" and not free_placeholders):
                    continue
                for t in _tensors(a.meta.get("val")):
                    k = _key(t)
                    owners[k].discard(a)
                    if not owners[k] and k in self.live and k not in external:
                        self.cur -= self.live.pop(k)


def graph_memory(forward: fx.GraphModule, backward: fx.GraphModule | None, saved_until_end: bool = True,
                 record: bool = False, symmetric: bool = False) -> GraphMemory:
    """Liveness of the executable graphs of one training step (see the module docstring)."""
    f_out = list(forward.graph.output_node().args[0])
    f_ph = {_key(t) for n in forward.graph.nodes if n.op == "placeholder" for t in _tensors(n.meta.get("val"))}
    b_ph = [n for n in backward.graph.nodes if n.op == "placeholder"] if backward is not None else []
    b_saved = [n for n in b_ph if not n.name.startswith("tangents")]
    n_user = len(f_out) - len(b_saved)
    if n_user < 0:
        raise ValueError(f"backward graph takes {len(b_saved)} saved values but forward returns only {len(f_out)}")
    keep = {a for a in f_out if isinstance(a, fx.Node)}
    fsim = _Sim("forward", {}, record)
    f_ph = set(f_ph)
    before = set(f_ph)
    fsim.run(forward, f_ph, keep, free_placeholders=False, symmetric=symmetric)
    f_ph_symmetric = f_ph - before  # lease-pool views the forward writes

    def bytes_of(nodes: list) -> tuple[int, dict[StorageWeakRef, int]]:
        ks = {}
        for a in nodes:
            if isinstance(a, fx.Node):
                for t in _tensors(a.meta.get("val")):
                    k = _key(t)
                    if k in fsim.live:
                        ks[k] = fsim.live[k]
        return sum(ks.values()), ks

    saved_nodes = f_out[n_user:]
    saved_bytes, saved_keys = bytes_of(saved_nodes)
    output_bytes, _ = bytes_of(f_out[:n_user])
    by_role: dict[str, int] = defaultdict(int)
    seen: set = set()
    for a in saved_nodes:  # what backward holds of MoE ops, in the allocator or in symmetric memory
        if not isinstance(a, fx.Node):
            continue
        meta = _producer(a).meta.get(MOE_META)
        for t in _tensors(a.meta.get("val")):
            k = _key(t)
            if meta is not None and k not in seen and (k in saved_keys or k in f_ph_symmetric):
                seen.add(k)
                by_role[meta.role.value] += saved_keys.get(k, _nbytes(t))
    if backward is None:
        return GraphMemory(saved_bytes, dict(by_role), output_bytes, fsim.peak, 0, 0, fsim.profile)

    # Backward: its placeholders are new fake tensors; map saved ones onto the forward's storages.
    live: dict = {}
    external: set = set()
    for ph, fo in zip(b_saved, saved_nodes):
        for tb, tf in zip(_tensors(ph.meta.get("val")), _tensors(getattr(fo, "meta", {}).get("val"))):
            kf = _key(tf)
            if kf in fsim.live:
                live[_key(tb)] = fsim.live[kf]
            else:
                external.add(_key(tb))  # a parameter or input the forward received
    base = fsim.cur - sum(live.values())  # user outputs (and anything else still live) stay throughout
    for n in b_ph:
        if n.name.startswith("tangents"):
            for t in _tensors(n.meta.get("val")):
                live[_key(t)] = _nbytes(t)
    bsim = _Sim("backward", live, record)
    b_out = [a for a in backward.graph.output_node().args[0] if isinstance(a, fx.Node)]
    bsim.run(backward, external, set(b_out), free_placeholders=not saved_until_end, symmetric=symmetric)
    grad_bytes = sum({_key(t): _nbytes(t) for a in b_out for t in _tensors(a.meta.get("val"))
                      if _key(t) not in external}.values())
    profile = fsim.profile + [(k, v + base) for k, v in bsim.profile]
    return GraphMemory(saved_bytes, dict(by_role), output_bytes, fsim.peak, bsim.peak + base, grad_bytes, profile,
                       recomputed=recomputed_ops(forward, backward))


def recomputed_ops(forward: fx.GraphModule, backward: fx.GraphModule) -> int:
    """Ops the backward graph recomputes: copies of forward ops (the partitioner keeps their names) that
    compute floating-point values. Views, masks and assertions (which the partitioner may duplicate
    without any checkpointing) are left out."""
    import operator

    def computes(n: fx.Node) -> bool:
        schema = getattr(n.target, "_schema", None)
        if schema is not None and any(r.alias_info is not None for r in schema.returns):
            return False  # a view
        return n.target is not operator.getitem and any(t.is_floating_point() for t in _tensors(n.meta.get("val")))

    fwd = {n.name for n in forward.graph.nodes if n.op == "call_function"}
    return sum(1 for n in backward.graph.nodes if n.op == "call_function" and n.name in fwd and computes(n))


def allocator_peak(prof) -> int:  # prof: a torch.profiler.profile(profile_memory=True) that ran
    """Peak of the CPU allocator's running total (allocations − frees) over the profiled region."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak
