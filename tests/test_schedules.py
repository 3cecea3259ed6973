"""Pipeline schedules' action orders and lease plans proven safe against them (compile-time only).

The tables of forwards in flight per stage are worked out by hand from each schedule's definition:
    GPipe:        every forward before any backward → H_s = m
    1F1B:         stage s warms up with pp−1−s forwards, then alternates F,B → H_s = pp − s
    Interleaved:  pp=2, v=2, m=4 (two rounds of 2 microbatches; rank r holds stages r and r+2):
                  rank 0 runs 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 … → stage 0 reaches 4, stage 2 reaches 2;
                  rank 1 runs 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 … → stage 1 reaches 3, stage 3 reaches 1.
"""

from __future__ import annotations

import pytest

from moe_compile.errors import IRError, OptionError
from moe_compile.leases import LeasePlan, Payload
from moe_compile.schedules import action_order, forwards_in_flight, verify_schedule


@pytest.mark.parametrize("name, pp, m, v, want", [
    ("gpipe", 2, 4, 1, {0: 4, 1: 4}),
    ("1f1b", 4, 8, 1, {0: 4, 1: 3, 2: 2, 3: 1}),
    ("1f1b", 2, 3, 1, {0: 2, 1: 1}),
    ("interleaved_1f1b", 2, 4, 2, {0: 4, 1: 3, 2: 2, 3: 1}),
])
def test_forwards_in_flight_match_hand_computed_tables(name, pp, m, v, want):
    assert forwards_in_flight(action_order(name, pp, m, v)) == want


def _plan(stage: int, instances: int) -> LeasePlan:
    pay = Payload(f"layers.{stage}.mlp/dispatch.recv", f"layers.{stage}.mlp", "lease", (4, 8), "torch.float32",
                  128, 0, 10, True, 0, stage=stage)
    return LeasePlan((pay,), 20, True, {(stage, "lease"): 1}, {(stage, "lease"): 128}, in_flight={stage: instances})


def test_verifier_accepts_the_schedule_sized_plan_and_rejects_one_slot_too_small():
    order = action_order("1f1b", 4, 8)
    verify_schedule({s: _plan(s, 4 - s) for s in range(4)}, order, "1f1b")
    too_small = {s: _plan(s, 4 - s) for s in range(4)}
    too_small[1] = _plan(1, 2)  # stage 1 needs pp − 1 = 3 forwards in flight
    with pytest.raises(IRError, match=r"schedule 1f1b: at step \d+ of rank 1 \(1F2\), forward of microbatch 2 on "
                                      r"stage 1 would write payload layers\.1\.mlp/dispatch\.recv .* 2 forwards of "
                                      r"stage 1 are in flight but the plan provisions 2"):
        verify_schedule(too_small, order, "1f1b")


def test_verifier_covers_interleaved_stages():
    order = action_order("interleaved_1f1b", 2, 4, 2)
    verify_schedule({0: _plan(0, 4), 1: _plan(1, 3), 2: _plan(2, 2), 3: _plan(3, 1)}, order, "interleaved_1f1b")
    with pytest.raises(IRError, match="stage 2"):
        verify_schedule({0: _plan(0, 4), 1: _plan(1, 3), 2: _plan(2, 1), 3: _plan(3, 1)}, order, "interleaved_1f1b")


def test_refused_and_malformed_schedules_are_clear_errors():
    with pytest.raises(OptionError, match="ScheduleZBVZeroBubble.*compiled stage"):
        action_order("zbv", 2, 4)
    with pytest.raises(OptionError, match="supported values"):
        action_order("pipedream", 2, 4)
    with pytest.raises(OptionError, match="one stage per rank"):
        action_order("1f1b", 2, 4, 2)
    with pytest.raises(OptionError, match="multiple of its rounds"):
        action_order("interleaved_1f1b", 2, 5, 2)
