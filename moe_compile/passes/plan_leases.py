"""plan_leases — lifetimes and slots of the symmetric payloads of the joint graph.

Terms: a *lease* holds a symmetric payload written in forward and read in backward, from its writer
until right after its last backward reader. Payloads that do not cross into backward live in
*shared transient slots*. Payloads of one (stage, storage family) share a pool of equal slots; the
*high-water* is the most payloads of a family live at once. With sharing off, every payload gets its
own slot (a fixed per-block cache).

    positions   = joint-graph node order (forward nodes precede backward nodes)
    for each transport node of the symmetric transport:
        payload  = what it writes into symmetric memory (receive rows, rows exposed for GET, counts)
        interval = [writer, last reader + 1)         # within one op for GET sources and counts
        leased   = written in forward, read in backward
    slots       = interval colouring per (stage, family): lowest slot free at the payload's start
    high-water  = max live payloads per (stage, family)  (= slots when sharing)
    instances   = forwards in flight H: the lease family's pool holds H copies of its slots
    verify      = no slot holds two payloads whose intervals overlap

Only the symmetric transport has symmetric payloads; other transports get an empty plan. Requires
PARTITIONED or QUANTIZED, ensures LEASED; the plan is a pure function of the graph, hence identical
on every rank.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..errors import IRError
from ..ir import Stage
from ..leases import LEASE_FAMILY, LeasePlan, Payload, payload_name
from ..ops import op_name
from .base import PassContext, moe_nodes, moe_pass, op_arg

LEASE_META = "moe_lease"  # node.meta key: [(payload name, "write" | "read" | "release")]


def backward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on a tangent (the backward part of a joint graph)."""
    bwd: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and "tangent" in n.name) or any(a in bwd for a in n.all_input_nodes):
            if n.op != "output":
                bwd.add(n)
    return bwd


def _nbytes(v: torch.Tensor) -> int:
    return v.numel() * v.element_size()


def _readers(n: fx.Node, index: int | None) -> list[fx.Node]:
    """Consumers of output ``index`` of ``n`` (through getitem), or of ``n`` itself."""
    if index is None:
        return [u for u in n.users if u.op != "output"]
    outs = [u for u in n.users if u.target is operator.getitem and u.args[1] == index]
    return [r for o in outs for r in o.users if r.op != "output"]


def collect_payloads(gm: fx.GraphModule, symmetric: bool) -> tuple[list[dict], int, int]:
    """Payload records (before slot assignment), the schedule length and the fwd/bwd boundary."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    bwd = backward_nodes(gm)
    boundary = min((pos[n] for n in bwd), default=len(nodes))
    out: list[dict] = []
    if not symmetric:
        return out, len(nodes), boundary

    def add(what: str, n: fx.Node, val: torch.Tensor, readers: list[fx.Node]) -> None:
        block = op_arg(n, "block")
        last = max(readers, key=lambda r: pos[r]) if readers else None
        leased = n not in bwd and any(r in bwd for r in readers)
        out.append(dict(
            name=payload_name(block, what), block=block, shape=tuple(int(s) for s in val.shape), dtype=str(val.dtype),
            nbytes=_nbytes(val), acquire=pos[n], release=(pos[last] + 1) if last is not None else pos[n] + 1,
            leased=leased, family=LEASE_FAMILY if leased else ("counts" if what == "counts" else "transient"),
            readers=tuple((op_name(r.target) or str(r.target), block) for r in readers),
            released_by=(op_name(last.target), block) if last is not None else None,
        ))

    for n in moe_nodes(gm):
        name = op_name(n.target)
        if name == "dispatch":
            recv, _, layout = n.meta["val"]
            ep, nl = layout.shape[1], layout.shape[3]
            add("counts", n, torch.empty((ep, ep, nl), dtype=torch.int64, device="meta"), [])
            add("dispatch", n, recv, _readers(n, 0))
        elif name == "combine":
            add("combine", n, n.args[0].meta["val"], [])
        elif name == "combine_backward":
            add("combine_backward", n, n.meta["val"], _readers(n, None))
        elif name == "dispatch_backward":
            add("dispatch_backward", n, n.args[0].meta["val"], [])
    return out, len(nodes), boundary


def assign_slots(records: list[dict], sharing: bool, schedule_len: int, boundary: int,
                 in_flight: int = 1, stage: int = 0) -> LeasePlan:
    payloads: list[Payload] = []
    slot_bytes: dict[tuple[int, str], int] = {}
    by_family: dict[tuple[int, str], list[dict]] = {}
    for r in records:
        by_family.setdefault((stage, r["family"]), []).append(r)
    for key, recs in sorted(by_family.items()):
        slot_bytes[key] = max(r["nbytes"] for r in recs)
        free_at: list[int] = []  # per slot: the position from which it is free
        for r in sorted(recs, key=lambda r: (r["acquire"], r["name"])):
            slot = next((i for i, f in enumerate(free_at) if f <= r["acquire"]), None) if sharing else None
            if slot is None:
                slot = len(free_at)
                free_at.append(0)
            free_at[slot] = r["release"]
            payloads.append(Payload(slot=slot, stage=key[0], **r))
    payloads.sort(key=lambda p: (p.acquire, p.name))
    return LeasePlan(tuple(payloads), schedule_len, sharing, high_water(payloads), slot_bytes, boundary,
                     in_flight={stage: in_flight})


def high_water(payloads: list[Payload] | tuple[Payload, ...]) -> dict[tuple[int, str], int]:
    """Most payloads of each (stage, family) live at one position (sweep over interval ends)."""
    events: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for p in payloads:
        events.setdefault((p.stage, p.family), []).extend([(p.acquire, 1), (p.release, -1)])
    out = {}
    for key, ev in events.items():
        live = peak = 0
        for _, d in sorted(ev, key=lambda e: (e[0], e[1])):  # a release at t frees before an acquire at t
            live += d
            peak = max(peak, live)
        out[key] = peak
    return out


def verify_lease_plan(plan: LeasePlan) -> None:
    """Reject a plan in which a slot could be written while a lease on it is live."""
    by_slot: dict[tuple[int, str, int], list[Payload]] = {}
    for p in plan.payloads:
        if p.release <= p.acquire:
            raise IRError(f"lease plan rejected: payload {p.name} has an empty lifetime [{p.acquire}, {p.release})")
        if p.nbytes > plan.slot_bytes.get((p.stage, p.family), 0):
            raise IRError(f"lease plan rejected: payload {p.name} ({p.nbytes} bytes) exceeds its pool's slot size")
        by_slot.setdefault((p.stage, p.family, p.slot), []).append(p)
    for (stage, family, slot), ps in by_slot.items():
        ps = sorted(ps, key=lambda p: p.acquire)
        for prev, nxt in zip(ps, ps[1:]):
            if nxt.acquire < prev.release:
                raise IRError(
                    f"lease plan rejected: slot {slot} of pool {family}@{stage} is written by {nxt.name} at "
                    f"position {nxt.acquire} while the lease of {prev.name} (MoE layer {prev.block}) is live "
                    f"[{prev.acquire}, {prev.release})")


def build_plan(gm: fx.GraphModule, ctx: PassContext) -> LeasePlan:
    records, length, boundary = collect_payloads(gm, ctx.program.transport == "symmetric")
    opts = ctx.program.options
    prog = ctx.program
    plan = assign_slots(records, opts.lease_sharing, length, boundary, opts.forwards_in_flight, prog.pipeline_stage)
    verify_lease_plan(plan)
    if prog.schedule is not None:  # pipeline: prove the plan safe over the schedule's own action order
        from ..schedules import verify_schedule

        verify_schedule({prog.pipeline_stage: plan}, prog.schedule.order, prog.schedule.name)
    nodes = list(gm.graph.nodes)
    for p in plan.payloads:
        nodes[p.acquire].meta.setdefault(LEASE_META, []).append((p.name, "write"))
        if p.released_by is not None:
            nodes[p.release - 1].meta.setdefault(LEASE_META, []).append((p.name, "release"))
    return plan


@moe_pass(requires=(Stage.PARTITIONED, Stage.QUANTIZED), ensures=Stage.LEASED, graph="joint")
def plan_leases(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    plan = build_plan(gm, ctx)
    gm.meta["lease_plan"] = plan
    ctx.lease_plan = plan
    return gm
