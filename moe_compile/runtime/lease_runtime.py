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

Forwards in flight: each forward graph claims a free *instance* of its plan's lease pool (the lowest
whose leases have ended on every rank of the EP group, agreed by an all-reduce: a PUT addresses the
peer's slots of the sender's instance) and writes its leased payloads into that instance's slots;
more forwards than the plan's H raise. A backward graph finds its forward's instance from the saved payloads it
receives (their addresses lie in that instance's slots). A lease ends at its release node, or when
its autograd graph is freed without a backward (evaluation without ``no_grad``, a dropped loss): the
payload backward would read is a tensor with a storage of its own, whose finalizer queues the lease,
and the next graph start ends it (finalizers run at any allocation, so they only queue). A graph that raised leaves transient leases
held; the next graph of the plan reclaims them (graphs never interleave, so none can be live then).
"""

from __future__ import annotations

import gc
import hashlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import RuntimeFault
from ..leases import LEASE_FAMILY, LeasePlan, Payload
from .symmetric import SymmetricBuffer, SymmetricHeap

ALIGN = 64


def _collect() -> None:
    """gc.collect() from inside a running compiled graph: with dynamo's frame hook off, so that the
    Python frames collection runs (a generator closed by the collector) are not taken for code to
    compile — under fullgraph that would raise an "Attempt to trace generator" error instead."""
    torch._dynamo.disable(gc.collect)()
FORWARD, BACKWARD = 0, 1  # phase of the graph that activates a plan


def plan_signature(plan: LeasePlan) -> str:
    text = repr(sorted((p.name, p.family, p.shape, p.dtype, p.slot, p.acquire, p.release) for p in plan.payloads))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class Pool:
    """Frozen slots of one (stage, family): one symmetric allocation [slots, slot_bytes]."""

    family: str
    stage: int
    slots: int  # base_slots × instances
    slot_bytes: int
    buf: SymmetricBuffer  # [slots, slot_bytes] uint8
    base_slots: int = 0  # slots of one forward's colouring; instance i owns [i·base, (i+1)·base)
    owner: list[str | None] = field(default_factory=list)
    generation: list[int] = field(default_factory=list)

    def instance_at(self, t: torch.Tensor) -> int | None:
        """The instance whose slots hold ``t`` (by address in this rank's pool), or None."""
        local = self.buf.views[self.buf.rank]
        if t.device != local.device or not self.base_slots:
            return None
        off = t.data_ptr() - local.data_ptr()
        if not 0 <= off < self.slots * self.slot_bytes:
            return None
        return off // self.slot_bytes // self.base_slots

    def view(self, slot: int, p: Payload, member: int) -> torch.Tensor:
        dtype = getattr(torch, p.dtype.replace("torch.", ""))
        raw = self.buf.views[member][slot, : p.nbytes]
        return raw.view(dtype).view(p.shape)


@dataclass(eq=False)
class Lease:
    payload: Payload
    pool: Pool
    slot: int
    generation: int
    key: tuple[int, int, str] = (0, 0, "")  # (plan, instance, payload)

    @property
    def local(self) -> torch.Tensor:
        return self.pool.view(self.slot, self.payload, self.pool.buf.rank)

    def peer(self, member: int) -> torch.Tensor:
        return self.pool.view(self.slot, self.payload, member)


class _Region:
    """One payload's bytes exposed through the array interface, so that a tensor made from it has a
    storage of its own that keeps this object alive: its finalizer runs when the last tensor on that
    storage is freed (a Python-level tensor object can die before its saved aliases do)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._base = t  # keeps the pool's memory mapped while any alias lives
        iface = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1", "data": (t.data_ptr(), False),
                 "strides": None, "version": 3}
        setattr(self, "__cuda_array_interface__" if t.is_cuda else "__array_interface__", iface)

    def tensor(self) -> torch.Tensor:
        if self._base.is_cuda:
            return torch.as_tensor(self, device=self._base.device)
        import numpy as np

        return torch.from_numpy(np.asarray(self))


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
        self.held: dict[tuple[int, int, str], Lease] = {}  # (plan, instance, payload) → live lease
        self.current: dict[int, int] = {}  # plan → instance of the graph running now
        self.live: dict[tuple[int, str], int] = {}  # (stage, family) → live leases now
        self.observed_high_water: dict[tuple[int, str], int] = {}
        self.fault: LeaseFault | None = None
        self._orphans: list[Lease] = []  # leases whose autograd graph was freed unrun (ended at _drain)

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

    def activate(self, plan_id: int, phase: int = FORWARD, saved: list[torch.Tensor] | None = None) -> None:
        """Make ``plan_id`` the plan the following acquires use; allocate its pools on first use. A
        forward claims a free instance; a backward takes the instance its ``saved`` payloads lie in."""
        if plan_id not in self.plans:
            raise RuntimeFault(f"lease plan {plan_id} was never installed in this runtime")
        self.active = plan_id
        plan = self.plans[plan_id]
        self._drain()
        if not plan.payloads:
            return
        if not any(k[0] == plan_id for k in self.pools):
            self._allocate(plan_id, plan)
        self._reclaim_transient(plan_id)
        self.current[plan_id] = self._claim(plan_id, plan) if phase == FORWARD else self._instance_of(plan_id, saved or [])

    def _allocate(self, plan_id: int, plan: LeasePlan) -> None:
        if self.heap is None:
            raise RuntimeFault("a lease plan with symmetric payloads needs a symmetric heap (transport='symmetric')")
        self._check_identical(plan)
        pools = {key: (plan.pool_slots(*key), -(-plan.slot_bytes[key] // ALIGN) * ALIGN)
                 for key in sorted({(p.stage, p.family) for p in plan.payloads})}
        self.heap.reserve(sum(slots * nbytes for slots, nbytes in pools.values()))  # fixed-size heaps check it
        for (stage, family), (slots, nbytes) in pools.items():
            buf = self.heap.alloc(f"{family}@{stage}", (slots, nbytes), torch.uint8)
            self.pools[(plan_id, stage, family)] = Pool(family, stage, slots, nbytes, buf,
                                                        plan.base_slots(stage, family), [None] * slots, [0] * slots)

    def _reclaim_transient(self, plan_id: int) -> None:
        """Transient leases of ``plan_id`` still held belong to a graph that raised mid-way."""
        for key, lease in list(self.held.items()):
            if key[0] == plan_id and lease.payload.family != LEASE_FAMILY:
                self._end(key, lease)

    def _busy(self, plan_id: int) -> set[int]:
        return {k[1] for k, lease in self.held.items() if k[0] == plan_id and lease.payload.family == LEASE_FAMILY}

    def _claim(self, plan_id: int, plan: LeasePlan) -> int:
        if not any(p.family == LEASE_FAMILY for p in plan.payloads):
            return 0
        stages = {p.stage for p in plan.payloads if p.family == LEASE_FAMILY}
        n = min(plan.instances(s, LEASE_FAMILY) for s in stages)
        for attempt in range(2):
            busy = self._agreed_busy(plan_id, n)
            free = [i for i in range(n) if i not in busy]
            if free:
                return free[0]
            if attempt == 0:
                _collect()  # a freed autograd graph caught in a reference cycle ends its leases here
                self._drain()
        raise RuntimeFault(
            f"{n + 1} forwards in flight, but the lease plan provisions {n} (forwards_in_flight={n}): "
            f"{n} earlier forward(s) still hold their leases (on this rank or an EP-group peer) because their autograd graphs are alive and "
            "their backward has not run. Call backward first, run evaluation under torch.no_grad(), drop "
            f"the earlier outputs, or compile with forwards_in_flight={n + 1}")

    def _agreed_busy(self, plan_id: int, n: int) -> set[int]:
        """Instances busy on *any* rank of the EP group. A PUT writes the sender's instance of the peer's
        pool, so every rank must claim the same one; the busy sets can differ (one rank still holds an
        earlier forward's graph that another dropped), and the lowest local free instance then wrote
        other slots than the peer read (loss off by 1e-4 relative). One all-reduce (MAX) of n flags and
        one host read per forward, only with more than one instance (n = 1 leaves no choice)."""
        busy = self._busy(plan_id)
        if n == 1 or self.group is None or dist.get_world_size(self.group) == 1:
            return busy
        pool = next(p for (pid, _, fam), p in self.pools.items() if pid == plan_id and fam == LEASE_FAMILY)
        device = pool.buf.views[pool.buf.rank].device  # the group's backend carries the heap's device
        flags = torch.tensor([i in busy for i in range(n)], dtype=torch.int32).to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return {i for i, b in enumerate(flags.tolist()) if b}  # host read: the claim is a host decision

    def _instance_of(self, plan_id: int, saved: list[torch.Tensor]) -> int:
        pools = [pool for (pid, _, fam), pool in self.pools.items() if pid == plan_id and fam == LEASE_FAMILY]
        if not pools:
            return 0
        for t in saved:
            for pool in pools:
                inst = pool.instance_at(t)
                if inst is not None:
                    return inst
        raise RuntimeFault(f"backward of lease plan {plan_id}: none of the tensors it saved lies in its lease "
                           "pool, so the forward it belongs to cannot be found")

    def _check_identical(self, plan: LeasePlan) -> None:
        if self.group is None or dist.get_world_size(self.group) == 1:
            return
        sigs = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(sigs, plan_signature(plan), group=self.group)
        if len(set(sigs)) != 1:
            raise RuntimeFault(
                f"lease plans differ between the ranks of the EP group (signatures by rank: {sigs}): the ranks "
                "compiled different programs, most often because their batches differ in shape or in which "
                "inputs they pass (labels on one rank only); every rank of an EP group must pass batches of one "
                "shape with the same inputs, since symmetric allocation is collective and needs one plan (the "
                "all_to_all transport, transport='all_to_all', takes batches of different shapes)")

    def _payload(self, name: str) -> tuple[int, Payload]:
        if self.active is None:
            raise RuntimeFault(f"payload {name}: no lease plan is active")
        p = self._by_name[self.active].get(name)
        if p is not None:
            return self.active, p
        raise RuntimeFault(f"payload {name} is not in the active lease plan {self.active}")

    # -- leases ------------------------------------------------------------------------------
    def _key(self, pid: int, p: Payload) -> tuple[int, int, str]:
        return (pid, self.current.get(pid, 0) if p.family == LEASE_FAMILY else 0, p.name)

    def acquire(self, name: str) -> Lease:
        pid, p = self._payload(name)
        pool = self.pools[(pid, p.stage, p.family)]
        guarded = not (self.fault and self.fault.unguarded)
        key = self._key(pid, p)
        slot = p.slot
        if self.fault and self.fault.kind == "steal" and self.fault.payload == name:
            slot = self._payload(self.fault.victim)[1].slot if self.fault.victim else slot
        slot += key[1] * pool.base_slots
        if slot >= pool.slots or p.nbytes > pool.slot_bytes:
            raise RuntimeFault(
                f"payload {name} (MoE layer {p.block}) needs slot {slot} / {p.nbytes} bytes, but pool "
                f"{p.family}@{p.stage} is frozen at {pool.slots} slots of {pool.slot_bytes} bytes")
        if guarded and key in self.held:
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
        lease = Lease(p, pool, slot, pool.generation[slot], key)
        self.held[key] = lease
        fam = (p.stage, p.family)
        self.live[fam] = self.live.get(fam, 0) + 1
        self.observed_high_water[fam] = max(self.observed_high_water.get(fam, 0), self.live[fam])
        if self.fault and self.fault.kind == "release_early" and self.fault.payload == name:
            self.release(name)
        return lease

    def bind(self, lease: Lease, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the payload's memory) as a tensor of its own storage, and the lease ends when the last
        tensor on that storage is freed — every view and alias the autograd graph saved included: the
        graph was dropped without a backward. After an explicit release this is a no-op."""
        region = _Region(t)
        weakref.finalize(region, self._orphaned, lease)
        return region.tensor().view(t.dtype).view(t.shape)

    def _orphaned(self, lease: Lease) -> None:
        self._orphans.append(lease)

    def _drain(self) -> None:
        while self._orphans:
            lease = self._orphans.pop()
            if self.held.get(lease.key) is lease:  # not released explicitly (nor re-acquired) since
                self._end(lease.key, lease)

    def check(self, name: str) -> Lease:
        """Guard a read: the payload's lease is live and its slot still holds this generation."""
        pid, p = self._payload(name)
        lease = self.held.get(self._key(pid, p))
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
        key = self._key(pid, p)
        lease = self.held.get(key)
        if lease is None:
            raise RuntimeFault(f"double release of payload {name} (MoE layer {p.block}): it holds no lease")
        self._end(key, lease)

    def _end(self, key: tuple[int, int, str], lease: Lease) -> None:
        del self.held[key]
        pool, name = lease.pool, lease.payload.name
        if pool.owner[lease.slot] == name:
            pool.owner[lease.slot] = None
            if self.poison:
                lease.local.view(torch.uint8).fill_(0xFF)  # NaN in every float format
        self.live[(lease.payload.stage, lease.payload.family)] -= 1

    def in_flight(self, plan_id: int | None = None) -> int:
        """Forwards whose leases are still held (of ``plan_id``, or of the active plan)."""
        self._drain()
        return len(self._busy(self.active if plan_id is None else plan_id))

    # -- inspection ----------------------------------------------------------------------------
    @property
    def symmetric_bytes(self) -> int:
        return sum(p.slots * p.slot_bytes for p in self.pools.values())
