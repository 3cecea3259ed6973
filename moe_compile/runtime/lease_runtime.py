"""Lease pools at run time: symmetric slots assigned by the compile-time lease plan, with guards.

Every payload of an active plan is acquired by the op that writes it and released right after its
last consumer (explicit ``moe::lease_release`` nodes, or inside the op for payloads that live within
one op). Pools are allocated on a plan's first activation — collectively over the EP group — and
frozen: they never grow.

Guards (each raises RuntimeFault naming the payload and its MoE layer):
* acquiring a slot while another payload's lease on it is live (a reuse bug);
* acquiring a payload twice, releasing it twice, or releasing one that was never acquired;
* a payload that needs a slot or bytes beyond its frozen pool;
* reading a payload after its lease ended (generation counters: every acquire bumps the slot's
  generation, and a read checks the generation its lease was granted).
With ``poison=True`` released slots are filled with NaN (0xFF bytes), so a stale read shows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import RuntimeFault
from ..leases import LeasePlan, Payload
from .symmetric import SymmetricBuffer, SymmetricHeap

ALIGN = 64


def plan_signature(plan: LeasePlan) -> str:
    text = repr(sorted((p.name, p.family, p.shape, p.dtype, p.slot, p.acquire, p.release) for p in plan.payloads))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class Pool:
    """Frozen slots of one (stage, family): one symmetric allocation [slots, slot_bytes]."""

    family: str
    stage: int
    slots: int
    slot_bytes: int
    buf: SymmetricBuffer
    owner: list[str | None] = field(default_factory=list)
    generation: list[int] = field(default_factory=list)

    def view(self, slot: int, p: Payload, member: int) -> torch.Tensor:
        dtype = getattr(torch, p.dtype.replace("torch.", ""))
        raw = self.buf.views[member][slot, : p.nbytes]
        return raw.view(dtype).view(p.shape)


@dataclass
class Lease:
    payload: Payload
    pool: Pool
    slot: int
    generation: int

    @property
    def local(self) -> torch.Tensor:
        return self.pool.view(self.slot, self.payload, self.pool.buf.rank)

    def peer(self, member: int) -> torch.Tensor:
        return self.pool.view(self.slot, self.payload, member)


@dataclass
class LeaseFault:
    """Test-only fault injection. ``steal``: when ``payload`` is acquired it takes ``victim``'s slot
    (a reuse bug); ``release_early``: ``payload`` is released right after it is acquired.
    ``unguarded`` disables the guards, to show what the bug would do without them."""

    kind: str
    payload: str
    victim: str | None = None
    unguarded: bool = False


class LeaseRuntime:
    def __init__(self, heap: SymmetricHeap | None, group: dist.ProcessGroup | None, poison: bool = False) -> None:
        self.heap = heap
        self.group = group
        self.poison = poison
        self.plans: dict[int, LeasePlan] = {}
        self._by_name: dict[int, dict[str, Payload]] = {}  # plan id → its payloads by name (per-op lookups)
        self.active: int | None = None
        self.pools: dict[tuple[int, int, str], Pool] = {}
        self.held: dict[tuple[int, str], Lease] = {}
        self.live: dict[tuple[int, str], int] = {}  # (stage, family) → live leases now
        self.observed_high_water: dict[tuple[int, str], int] = {}
        self.fault: LeaseFault | None = None

    # -- plans --------------------------------------------------------------------------------
    def install(self, plan: LeasePlan) -> int:
        sig = plan_signature(plan)
        for pid, p in self.plans.items():
            if plan_signature(p) == sig:
                return pid
        pid = len(self.plans)
        self.plans[pid] = plan
        self._by_name[pid] = {p.name: p for p in plan.payloads}
        return pid

    def activate(self, plan_id: int) -> None:
        """Make ``plan_id`` the plan the following acquires use; allocate its pools on first use."""
        if plan_id not in self.plans:
            raise RuntimeFault(f"lease plan {plan_id} was never installed in this runtime")
        self.active = plan_id
        plan = self.plans[plan_id]
        if any(k[0] == plan_id for k in self.pools) or not plan.payloads:
            return
        if self.heap is None:
            raise RuntimeFault("a lease plan with symmetric payloads needs a symmetric heap (transport='symmetric')")
        self._check_identical(plan)
        for stage, family in sorted({(p.stage, p.family) for p in plan.payloads}):
            slots = plan.pool_slots(stage, family)
            nbytes = -(-plan.slot_bytes[(stage, family)] // ALIGN) * ALIGN
            buf = self.heap.alloc(f"{family}@{stage}", (slots, nbytes), torch.uint8)
            self.pools[(plan_id, stage, family)] = Pool(family, stage, slots, nbytes, buf, [None] * slots, [0] * slots)

    def _check_identical(self, plan: LeasePlan) -> None:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        sigs = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(sigs, plan_signature(plan), group=self.group)
        if len(set(sigs)) != 1:
            raise RuntimeFault(f"lease plans differ between the ranks of the EP group ({sigs}); symmetric "
                               "allocation is collective and needs one plan")

    def _payload(self, name: str) -> tuple[int, Payload]:
        if self.active is None:
            raise RuntimeFault(f"payload {name}: no lease plan is active")
        p = self._by_name[self.active].get(name)
        if p is not None:
            return self.active, p
        raise RuntimeFault(f"payload {name} is not in the active lease plan {self.active}")

    # -- leases ------------------------------------------------------------------------------
    def acquire(self, name: str) -> Lease:
        pid, p = self._payload(name)
        pool = self.pools[(pid, p.stage, p.family)]
        guarded = not (self.fault and self.fault.unguarded)
        slot = p.slot
        if self.fault and self.fault.kind == "steal" and self.fault.payload == name:
            slot = self._payload(self.fault.victim)[1].slot if self.fault.victim else slot
        if slot >= pool.slots or p.nbytes > pool.slot_bytes:
            raise RuntimeFault(
                f"payload {name} (MoE layer {p.block}) needs slot {slot} / {p.nbytes} bytes, but pool "
                f"{p.family}@{p.stage} is frozen at {pool.slots} slots of {pool.slot_bytes} bytes")
        if guarded and (pid, name) in self.held:
            raise RuntimeFault(f"payload {name} (MoE layer {p.block}) acquired twice: its previous lease is still "
                               "live (did the previous step's backward run?)")
        owner = pool.owner[slot]
        if guarded and owner is not None:
            raise RuntimeFault(
                f"payload {name} (MoE layer {p.block}) would overwrite slot {slot} of pool {p.family}@{p.stage} "
                f"while the lease of {owner} on it is live; reusing it would corrupt what backward reads "
                "(if the previous step's backward did not run, call backward or run forward under no_grad)")
        pool.owner[slot] = name
        pool.generation[slot] += 1
        lease = Lease(p, pool, slot, pool.generation[slot])
        self.held[(pid, name)] = lease
        key = (p.stage, p.family)
        self.live[key] = self.live.get(key, 0) + 1
        self.observed_high_water[key] = max(self.observed_high_water.get(key, 0), self.live[key])
        if self.fault and self.fault.kind == "release_early" and self.fault.payload == name:
            self.release(name)
        return lease

    def check(self, name: str) -> Lease:
        """Guard a read: the payload's lease is live and its slot still holds this generation."""
        pid, p = self._payload(name)
        lease = self.held.get((pid, name))
        if self.fault and self.fault.unguarded and lease is not None:
            return lease
        if lease is None:
            raise RuntimeFault(f"read of payload {name} (MoE layer {p.block}) after its lease was released")
        if lease.pool.generation[lease.slot] != lease.generation or lease.pool.owner[lease.slot] != name:
            raise RuntimeFault(f"read of payload {name} (MoE layer {p.block}): its slot {lease.slot} was "
                               f"re-acquired by {lease.pool.owner[lease.slot]} while the lease was live")
        return lease

    def release(self, name: str) -> None:
        pid, p = self._payload(name)
        lease = self.held.pop((pid, name), None)
        if lease is None:
            raise RuntimeFault(f"double release of payload {name} (MoE layer {p.block}): it holds no lease")
        pool = lease.pool
        if pool.owner[lease.slot] == name:
            pool.owner[lease.slot] = None
            if self.poison:
                lease.local.view(torch.uint8).fill_(0xFF)  # NaN in every float format
        self.live[(p.stage, p.family)] -= 1

    # -- inspection ----------------------------------------------------------------------------
    @property
    def symmetric_bytes(self) -> int:
        return sum(p.slots * p.slot_bytes for p in self.pools.values())
