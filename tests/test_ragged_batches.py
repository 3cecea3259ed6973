"""Ranks of one EP-MP group passing batches of different shapes (all_to_all transport).

Each rank's receive buffer is ⌈φ·R⌉ for the R rows it routes, and every rank reads every rank's R off
the all-gathered counts, so all take the same drops and overflow decisions. Reference: the dense model,
gradients the mean over the ranks of each rank's own batch (as DDP averages them)."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest

from moe_compile import MeshSpec, moe_compile
from moe_compile.runtime.dropless import find_dropless_state

from .common import build_model, grads_of, make_batches, rel_err
from .harness import run_ranks


def ragged_worker(rank: int, world: int, schedule: list[tuple[int, ...]]) -> dict:
    model = build_model("tiny")
    dense = copy.deepcopy(model)
    full = make_batches(world, 4, 16, seed=7)
    cm = moe_compile(model, MeshSpec.parse(f"ep_mp={world}"), transport="all_to_all")
    out = {"steps": []}
    for sizes in schedule:
        batches = [full[r][: sizes[r]] for r in range(world)]
        for p in cm.parameters():
            p.grad = None
        ids = batches[rank]
        loss = cm(input_ids=ids, labels=ids).loss
        loss.backward()
        dense.zero_grad(set_to_none=True)
        ref = [dense(input_ids=b, labels=b).loss for b in batches]
        (sum(ref) / world).backward()  # DDP: the mean of the ranks' own mean losses
        got, want = cm.full_grads(), grads_of(dense)
        worst = max(want, key=lambda k: rel_err(got[k], want[k]))
        rows = sizes[rank] * 16 * 2  # T·K
        state = find_dropless_state(cm.program.ctx_id)
        led = cm.ledger()
        out["steps"].append({"loss_err": rel_err(loss.detach(), ref[rank].detach()), "worst": worst,
                             "grad_err": rel_err(got[worst], want[worst]), "factor": state.factor,
                             "capacity": {c for r, c in state.blocks.values() if r == rows},
                             "group_rows": sum(sizes) * 16 * 2, "rows": rows, "ledger": {k: led[k] for k in ("C", "C_bound")}})
    out["growths"] = len(state.growths)
    cm.close()
    return out


def test_ep_ranks_with_batches_of_different_shapes_match_the_dense_model():
    """Refused before (every rank sized its buffer and its drops from its own rows). Rank 0 routes a
    quarter of rank 1's rows and may receive 2.5× its own, past ep_mp = 2: the receive factor grows once,
    to 6 (1.5 doubled twice holds 100/32), each buffer bounded by the most rows the group routed (256, the
    first step's). Then the shapes swap: a rank runs a graph compiled for that shape before the growth (its
    capacity travels with its counts, so its peers take it as it is; taking every capacity from the
    factor, the ranks disagreed and gloo aborted). Every step matches the dense model, and the ledger's C
    is the buffer the rank holds (it counted min(ep_mp, f)·T·K: 64 for 192 rows); its bound C_bound is the
    most rows the group routed (it counted ep_mp·T·K: 64 rows for rank 0's 192-row buffer)."""
    for r in run_ranks(ragged_worker, 2, [(4, 4), (1, 4), (4, 1), (4, 4)], timeout=300):
        for step in r["steps"]:
            assert step["loss_err"] <= 1e-5 and step["grad_err"] <= 1e-5, r
        first, ragged = r["steps"][0], r["steps"][1]
        assert first["factor"] == Fraction(3, 2) and first["capacity"] == {192} == {first["ledger"]["C"]}, first
        want = min(6 * ragged["rows"], 256)  # rank 0: 192 rows; rank 1: 256 (6·128 = 768 unbounded)
        assert ragged["factor"] == 6 and ragged["capacity"] == {want} == {ragged["ledger"]["C"]}, ragged
        for step in r["steps"]:  # the bound: the most rows the group routed so far (256 from the first step)
            assert step["ledger"]["C_bound"] == 256 >= step["ledger"]["C"], step
        assert r["growths"] == 1, r  # none for the graphs compiled before it


@pytest.mark.slow
def test_four_ranks_with_batches_of_three_shapes():
    """ep_mp = 4, batches of 1, 2, 3 and 4 sequences, then another arrangement and one shape."""
    for r in run_ranks(ragged_worker, 4, [(1, 2, 3, 4), (4, 3, 2, 1), (2, 2, 2, 2)], timeout=300):
        for step in r["steps"]:
            assert step["loss_err"] <= 1e-5 and step["grad_err"] <= 1e-5, r


def ragged_pipeline_worker(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    model = build_model("tiny", lb_coef=0.0, z_coef=0.0)  # router losses of microbatches are not the batch's
    dense = copy.deepcopy(model)
    cm = moe_compile(model, MeshSpec.parse("pp=2,ep_mp=2,dp=2"), transport="all_to_all", microbatches=2)
    # the two pipelines (data-parallel replicas) pass 2 and 4 sequences; the ranks of one pipeline the same
    first = min(dist.get_process_group_ranks(cm.groups.pp))
    firsts = [None] * world
    dist.all_gather_object(firsts, first)
    rep = sorted(set(firsts)).index(first)
    ids = make_batches(2, 4, 32, seed=5)[rep][: (2, 4)[rep]]
    errs = []
    for _ in range(2):
        loss = cm.train_step(input_ids=ids, labels=ids)
        errs.append(rel_err(loss.detach(), dense(input_ids=ids, labels=ids).loss.detach()))
    cm.close()
    return errs


def test_pipelines_with_batches_of_different_shapes_match_the_dense_model():
    """pp=2 × ep_mp=2 on 4 ranks: each pipeline's own batch shape, the EP-MP groups span both."""
    for errs in run_ranks(ragged_pipeline_worker, 4, timeout=300):
        assert max(errs) <= 1e-5, errs
