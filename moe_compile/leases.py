"""Lease plan types: lifetimes of symmetric-memory payloads over the forward/backward schedule.

Glossary: a *lease* reserves a symmetric payload that a later backward still reads; autograd releases
it after that consumer. Payloads backward never reads live in *shared transient slots*. The
*high-water* is the maximum number of simultaneously live payloads of one stage and storage family.
The plan is identical on every rank (symmetric allocation is collective).

Schedule positions are indices into the joint graph's node order (forward nodes first, then backward).
A payload occupies its slot on the half-open interval [acquire, release).

Forwards in flight: a stage may run H forwards before their backwards (gradient accumulation that sums
losses, pipeline schedules). Leased payloads then need H disjoint copies of their slots: the lease
pool holds H *instances* of the per-forward colouring, instance i owning slots [i·S, (i+1)·S). Transient
payloads live inside one graph execution, and graphs never interleave, so they need one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Transport call → its payload's kind (the suffix of the payload name); one table for the planner
# (plan_leases) and the runtime (SymmetricTransport), so their names cannot drift apart
PAYLOAD_KINDS = {
    "dispatch": "dispatch.recv",  # leased until its last (backward) reader
    "combine": "combine.src",  # expert outputs exposed for GET, within the op
    "combine_backward": "combine_backward.recv",  # output-gradient rows, until grouped_ffn_backward
    "dispatch_backward": "dispatch_backward.src",  # input-gradient rows exposed for GET, within the op
    "counts": "counts",  # requested-count matrix exchange, within the op
}


LEASE_FAMILY = "lease"  # payloads written in forward and read in backward


def payload_name(block: str, what: str) -> str:
    return f"{block}/{PAYLOAD_KINDS[what]}"


@dataclass(frozen=True)
class Payload:
    name: str  # e.g. "layers.0.mlp/dispatch.recv"
    block: str  # MoE block (original module path)
    family: str  # storage family: payloads of one family share a pool of equal-size slots
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    acquire: int  # schedule position where the payload is written
    release: int  # schedule position after its last consumer (exclusive)
    leased: bool  # a backward consumer reads it: held by a lease until then
    slot: int  # slot index in its family's pool
    stage: int = 0  # pipeline stage
    readers: tuple[tuple[str, str], ...] = ()  # (moe op, block) of every consumer
    released_by: tuple[str, str] | None = None  # release after this (moe op, block); None: within its op


@dataclass(frozen=True)
class LeasePlan:
    payloads: tuple[Payload, ...]
    schedule_len: int  # number of positions in the schedule
    sharing: bool  # False: every payload has its own fixed per-block cache
    high_water: dict[tuple[int, str], int] = field(default_factory=dict)  # (stage, family) → count
    slot_bytes: dict[tuple[int, str], int] = field(default_factory=dict)  # (stage, family) → bytes/slot
    boundary: int = 0  # first backward position (forward positions are < boundary)
    in_flight: dict[int, int] = field(default_factory=dict)  # stage → forwards in flight H (default 1)

    def instances(self, stage: int, family: str) -> int:
        """Copies of the per-forward slots a pool holds: H for leases, 1 for transient families."""
        return self.in_flight.get(stage, 1) if family == LEASE_FAMILY else 1

    def base_slots(self, stage: int, family: str) -> int:
        """Slots of one forward's colouring of (stage, family)."""
        return 1 + max((p.slot for p in self.payloads if p.stage == stage and p.family == family), default=-1)

    def pool_slots(self, stage: int, family: str) -> int:
        return self.base_slots(stage, family) * self.instances(stage, family)

    @property
    def symmetric_bytes(self) -> int:
        """Bytes of symmetric memory the pools allocate (slots × slot size, summed over pools)."""
        keys = {(p.stage, p.family) for p in self.payloads}
        return sum(self.pool_slots(s, f) * self.slot_bytes[(s, f)] for s, f in keys)


def merge_plans(plans: list[LeasePlan]) -> LeasePlan:
    """The plans of several pipeline stages of one rank as one plan (stages keep their own pools)."""
    if len(plans) == 1:
        return plans[0]
    merged: dict = {"high_water": {}, "slot_bytes": {}, "in_flight": {}}
    for p in plans:
        for k in merged:
            merged[k].update(getattr(p, k))
    return LeasePlan(tuple(x for p in plans for x in p.payloads), max(p.schedule_len for p in plans),
                     all(p.sharing for p in plans), merged["high_water"], merged["slot_bytes"],
                     max(p.boundary for p in plans), merged["in_flight"])
