"""Dropless dispatch whose receive memory follows the load (moe_compile.runtime.dropless).

The receive buffer starts at ⌈h·T·K⌉ rows (h = 1.5), not ep_mp·T·K. A skewed load (every token routed to
rank 0's experts: ρ = ep_mp) overflows it; every rank sees the same all-gathered counts, so all grow the
capacity together, recompile once (recorded) and rerun the forward — no token is dropped and parity with
the dense model stays exact.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import OptionError
from moe_compile.options import CompileOptions
from moe_compile.runtime.dropless import (
    DROPLESS_HEADROOM,
    dropless_rows,
    factor_for_imbalance,
    find_dropless_state,
    grown_factor,
)

from .common import build_model, dense_reference, make_batches, rel_err, skew_to_first_experts
from .harness import run_ranks
from .test_parity import TOL, model_experts


def dropless_worker(rank: int, world: int, mesh: str, scenario: str, steps: int, options: dict | None = None) -> dict:
    spec = MeshSpec.parse(mesh).resolve(world)
    model = build_model("tiny")
    batches = make_batches(world, 2, 16, seed=7)
    if scenario == "skewed":
        skew_to_first_experts(model, model_experts(model) // spec.ep_mp)
    ref_losses, ref_grads = dense_reference(model, batches)
    cm = moe_compile(model, spec, **(options or {}))
    out = {"losses": [], "kept": [], "requested": [], "recv_rows": []}
    for _ in range(steps):
        for p in cm.parameters():
            p.grad = None
        res = cm(input_ids=batches[rank], labels=batches[rank])
        res.loss.backward()
        counts = cm.expert_counts()
        out["losses"].append(res.loss.item())
        out["kept"].append(sum(int(c["kept"].sum()) for c in counts.values()))
        out["requested"].append(sum(int(c["requested"].sum()) for c in counts.values()))
    grads = cm.full_grads() if steps == 1 else {}
    state = find_dropless_state(cm.program.ctx_id)
    recv = [n.meta["val"][0] for n in cm.graphs()["partitioned"].graph.nodes
            if n.op == "call_function" and "dispatch" in str(n.target) and isinstance(n.meta.get("val"), tuple)]
    out.update(
        ref_loss=ref_losses[rank],
        grad_err=max((rel_err(grads[n], ref_grads[n]) for n in grads), default=0.0),
        growths=[(g.factor_before, g.factor_after, g.need_rows) for g in state.growths],
        factor=state.factor, high_water=state.high_water, rows=next(iter(state.blocks.values()))[0],
        capacity=recv[0].shape[0], compiles=cm.program.compiles,
    )
    cm.close()
    return out


def _check_exact(results: list[dict]) -> None:
    for r in results:
        assert all(k == q for k, q in zip(r["kept"], r["requested"])), r  # a dropped token fails here
        assert abs(r["losses"][0] - r["ref_loss"]) <= TOL * max(1.0, abs(r["ref_loss"])), r
        assert r["grad_err"] <= TOL, r
    assert len({(tuple(r["growths"]), r["factor"], r["capacity"]) for r in results}) == 1  # same decisions


def test_uniform_load_keeps_the_headroom_capacity():
    results = run_ranks(dropless_worker, 2, "ep_mp=2", "random", 1)
    _check_exact(results)
    r = results[0]
    assert r["growths"] == [] and r["factor"] == DROPLESS_HEADROOM
    assert r["capacity"] == dropless_rows(r["rows"], 2, DROPLESS_HEADROOM) < 2 * r["rows"]


def test_headroom_option_sets_the_first_capacity():
    """dropless_headroom=1.25 on a skewed load: the first buffer holds ⌈1.25·T·K⌉ rows, and the growth
    starts from 1.25 (1.25 → 2.5, capped at ep_mp = 2)."""
    with pytest.raises(OptionError, match="dropless_headroom=0.5"):
        CompileOptions(dropless_headroom=0.5)
    results = run_ranks(dropless_worker, 2, "ep_mp=2", "skewed", 1, {"dropless_headroom": 1.25})
    _check_exact(results)
    r = results[0]
    assert r["growths"] == [(Fraction(5, 4), 2, 2 * r["rows"])], r["growths"]


@pytest.mark.parametrize("world", [2, 4])
def test_skewed_load_takes_the_overflow_path_exactly(world):
    """Every token to rank 0's experts: rank 0 would receive ep_mp·T·K rows > ⌈1.5·T·K⌉. The overflow
    path must run (one recorded growth to ep_mp, i.e. the bound) and drop nothing."""
    results = run_ranks(dropless_worker, world, f"ep_mp={world}", "skewed", 1)
    _check_exact(results)
    r = results[0]
    assert len(r["growths"]) == 1, r["growths"]
    before, after, need = r["growths"][0]
    assert before == DROPLESS_HEADROOM and after == world and need == world * r["rows"]
    assert r["capacity"] == world * r["rows"] and r["high_water"] == need


def test_growth_is_recorded_once_not_every_step():
    results = run_ranks(dropless_worker, 2, "ep_mp=2", "skewed", 3)
    for r in results:
        assert len(r["growths"]) == 1 and r["kept"] == r["requested"]
        assert r["losses"][0] == r["losses"][1] == r["losses"][2]  # same batch, same weights (no step)


def test_growth_rule():
    h = Fraction(3, 2)
    assert dropless_rows(100, 1, h) == 100  # one rank: the buffer is the input
    assert dropless_rows(100, 8, h) == 150 and dropless_rows(100, 64, h) == 150  # independent of ep_mp
    assert grown_factor(h, h, need=200, rows=100, ep=8) == 3  # one doubling holds ρ = 2
    assert grown_factor(h, h, need=500, rows=100, ep=8) == 6  # 1.5 → 3 → 6 ≥ 5
    assert grown_factor(h, h, need=800, rows=100, ep=8) == 8  # capped at the bound ep_mp
    for rho in (1, 1.2, 2, 3.5, 8):
        f = factor_for_imbalance(h, rho, 8)
        assert f >= min(rho, 8) and (f == h or f / 2 < rho or f == 8)
        need = int(rho * 100)
        assert f == h if need <= 150 else f == grown_factor(h, h, need, 100, 8)


def test_meta_forward_settles_without_host_read():
    from moe_compile.runtime.dropless import DroplessState

    s = DroplessState(ep=4)
    s.blocks["b"] = (8, 12)
    s.observe(torch.zeros(4, 4, 2, dtype=torch.int64, device="meta"), 12)
    assert s.settle() is False and s.growths == []
