"""Pipeline schedules as action orders, and lease plans checked against them.

Glossary: P / PP, B / m, lease, high-water. The schedules are torch.distributed.pipelining's own
(GPipe, 1F1B, Interleaved1F1B); their per-rank action orders — what ``schedule.pipeline_order`` holds
on a running pipeline — are computed here from the same generators, without process groups, so the
lease plan can be sized and proven safe at compile time:

    H_s       = max over rank(s)'s order of (forwards of stage s − backwards of stage s done)
    lease slots of stage s = H_s × one forward's slots            (1F1B: H_s = pp − s)
    verify    = walk every rank's order; each forward of stage s takes the lowest free instance of
                its lease slots, its backward frees it; a forward that finds none is rejected,
                naming the stage, a payload and the schedule step

Zero-bubble and DualPipeV schedules split backward into dI/dW and refuse compiled stages in
torch 2.13: asking for one is a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from torch.distributed.pipelining import schedules as pps

from .errors import IRError, OptionError
from .leases import LEASE_FAMILY, LeasePlan

SCHEDULES = {"gpipe": pps.ScheduleGPipe, "1f1b": pps.Schedule1F1B, "interleaved_1f1b": pps.ScheduleInterleaved1F1B}
REFUSED = {"zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
           "zbv_zero_bubble": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV",
           "looped_bfs": "ScheduleLoopedBFS"}
FORWARD = pps._ComputationType.FORWARD
BACKWARDS = (pps._ComputationType.FULL_BACKWARD, pps._ComputationType.BACKWARD_INPUT)


@dataclass(frozen=True)
class ScheduleOrder:
    """One pipeline schedule as the compiler sees it: every rank's action order and H_s per stage."""

    name: str
    pp: int
    microbatches: int
    stages_per_rank: int
    order: dict  # rank → [torch _Action | None]
    in_flight: dict  # stage → H_s

    @classmethod
    def build(cls, name: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> ScheduleOrder:
        order = action_order(name, pp, microbatches, stages_per_rank)
        return cls(name, pp, microbatches, stages_per_rank, order, forwards_in_flight(order))

    def bubble_fraction(self) -> float:
        """Idle share of a rank's step time with equal-cost stages: (pp−1)/(v·m + pp−1) (GPipe and
        1F1B: v = 1; interleaving v stages per rank shrinks the bubble v-fold)."""
        p, v, m = self.pp, self.stages_per_rank, self.microbatches
        return (p - 1) / (v * m + p - 1)


def check_schedule(name: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> None:
    if name in REFUSED:
        raise OptionError(f"schedule={name!r} ({REFUSED[name]}) splits backward into dI/dW and does not accept "
                          f"compiled stage modules in torch 2.13; supported: {sorted(SCHEDULES)}")
    if name not in SCHEDULES:
        raise OptionError(f"schedule={name!r}: supported values are {sorted(SCHEDULES)}")
    if pp < 1 or microbatches < 1 or stages_per_rank < 1:
        raise OptionError(f"schedule {name}: pp={pp}, microbatches={microbatches}, stages per rank="
                          f"{stages_per_rank} must all be positive")
    if name != "interleaved_1f1b" and stages_per_rank != 1:
        raise OptionError(f"schedule={name!r} runs one stage per rank, not {stages_per_rank}")
    if name == "interleaved_1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise OptionError(f"schedule='interleaved_1f1b' needs microbatches ({microbatches}) to be a multiple "
                              f"of its rounds max(1, m // pp) = {rounds}")


def action_order(name: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> dict[int, list]:
    """rank → its actions (torch's ``_Action`` or None for an idle step), as the schedule runs them."""
    check_schedule(name, pp, microbatches, stages_per_rank)
    cls = SCHEDULES[name]
    if name != "interleaved_1f1b":
        order = cls._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=microbatches))
    else:
        rounds = max(1, microbatches // pp)
        ns = SimpleNamespace(pp_group_size=pp, n_local_stages=stages_per_rank, _n_microbatches=microbatches,
                             number_of_rounds=rounds, microbatches_per_round=microbatches // rounds)
        order = {r: cls._calculate_single_rank_operations(ns, r) for r in range(pp)}
    return {r: _in_microbatch_order(actions) for r, actions in order.items()}


def _in_microbatch_order(actions: list) -> list:
    """Number each stage's forwards, and its backwards, 0, 1, … in the order they run: these schedules
    run every stage's microbatches in order (torch's descriptive 1F1B order labels the last stage's
    forwards from 1, so its labels are not used)."""
    seen: dict[tuple[int, bool], int] = {}
    out = []
    for a in actions:
        if a is not None and (a.computation_type == FORWARD or a.computation_type in BACKWARDS):
            key = (a.stage_index, a.computation_type == FORWARD)
            a = a._replace(microbatch_index=seen.get(key, 0))
            seen[key] = a.microbatch_index + 1
        out.append(a)
    return out


def _walk(order: dict[int, list]):
    """(rank, step, action) of every forward/backward in each rank's order."""
    for rank, actions in sorted(order.items()):
        for step, a in enumerate(actions):
            if a is not None and (a.computation_type == FORWARD or a.computation_type in BACKWARDS):
                yield rank, step, a


def forwards_in_flight(order: dict[int, list]) -> dict[int, int]:
    """H_s per stage: the most forwards of stage s whose backward has not run yet."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for _, _, a in _walk(order):
        s = a.stage_index
        live[s] = live.get(s, 0) + (1 if a.computation_type == FORWARD else -1)
        peak[s] = max(peak.get(s, 0), live[s])
    return peak


def verify_schedule(plans: dict[int, LeasePlan], order: dict[int, list], name: str = "") -> None:
    """Prove that no lease slot of any stage is written while a lease on it is live under ``order``:
    each stage's plan must hold an instance for every forward in flight. ``plans``: stage → plan."""
    for rank, actions in sorted(order.items()):
        taken: dict[tuple[int, int], int] = {}  # (stage, microbatch) → instance
        for step, a in enumerate(actions):
            if a is None or a.stage_index not in plans:
                continue
            s, mb = a.stage_index, a.microbatch_index
            plan = plans[s]
            leased = [p for p in plan.payloads if p.family == LEASE_FAMILY and p.stage == s]
            if not leased:
                continue
            if a.computation_type == FORWARD:
                busy = {i for (st, _), i in taken.items() if st == s}
                n = plan.instances(s, LEASE_FAMILY)
                free = next((i for i in range(n) if i not in busy), None)
                if free is None:
                    raise IRError(
                        f"lease plan rejected for schedule {name or '?'}: at step {step} of rank {rank} "
                        f"({a}), forward of microbatch {mb} on stage {s} would write payload {leased[0].name} "
                        f"into a slot whose lease is live: {len(busy)} forwards of stage {s} are in flight but "
                        f"the plan provisions {n} instance(s) of its lease slots")
                taken[(s, mb)] = free
            elif a.computation_type in BACKWARDS:
                taken.pop((s, mb), None)
