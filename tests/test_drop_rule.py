"""The capacity tail drop, and the scenario the parity tests check it in.

1. The runtime's drop rule (moe::permute's expert order, the exchanged requested counts, keep_counts,
   each source's RoutePlan) keeps exactly the rows the glossary's order says — (source rank, local
   expert, token, k), tail dropped — on a case worked out by hand and against the loop-form reference
   of tests/common.py, and the kept (token, expert) rows do not depend on the order in which the
   router lists a token's K experts.
2. The skewed scenario of tests/test_parity.py (every token routed to rank 0's experts, so capacity
   drops rows) is well conditioned: its top-k choices are no near-ties (fp64 makes the same ones) and
   its reference gradients carry at most half the parity tolerance of fp32 rounding. Otherwise the
   parity check at 1e-5 measures which CPU kernels summed the reference, not the compiler.
"""

from __future__ import annotations

import pytest
import torch

import moe_compile  # noqa: F401  (registers the moe:: ops)
from moe_compile.frontend.recognize import find_candidates
from moe_compile.runtime.route_plan import RoutePlan, keep_counts

from .common import (
    build_model,
    dense_reference,
    make_batches,
    reference_keep,
    rel_err,
    routers,
    skew_to_first_experts,
)
from .test_parity import TOL, capacity_reference

# -- 1. the drop rule ----------------------------------------------------------------------------


def runtime_keep(idx_per_rank: list[torch.Tensor], num_experts: int, capacity: int | list[int]) -> list[torch.Tensor]:
    """keep[t, k] of each source rank of one EP-MP group as the runtime decides it (``capacity``: one for
    every destination, or each destination's own, as ranks exchange them on the all_to_all transport)."""
    ep = len(idx_per_rank)
    perms = [torch.ops.moe.permute(torch.zeros(idx.shape[0], 1), idx, num_experts, "b") for idx in idx_per_rank]
    requested = torch.stack([counts.view(ep, num_experts // ep) for _, _, counts in perms])  # [src, dst, e]
    if isinstance(capacity, list):
        capacity = torch.tensor(capacity)
    layout = torch.stack([requested, keep_counts(requested, capacity)])
    out = []
    for src, (idx, (_, order, _)) in enumerate(zip(idx_per_rank, perms)):
        keep = torch.zeros(idx.numel(), dtype=torch.bool)
        keep[order[RoutePlan.from_layout(layout, src).send_index]] = True  # rows that leave, as (t, k)
        out.append(keep.view_as(idx))
    return out


def kept_pairs(idx: torch.Tensor, keep: torch.Tensor) -> set[tuple[int, int]]:
    return {(t, int(idx[t, k])) for t, k in keep.nonzero().tolist()}


def test_hand_worked_tail_drop():
    """Two ranks, experts 0-1 on rank 0 and 2-3 on rank 1, K = 2, three tokens per rank, capacity 3.

    Destination 0 takes, in (source, expert, token) order: src 0 expert 0 tokens 0, 1; src 0 expert 1
    token 0 (capacity reached); it drops src 0 expert 1 token 2 and all of src 1 (experts 0, 1 of
    tokens 0, 2). Destination 1 takes src 0 expert 2 token 1, src 0 expert 3 token 2, src 1 expert 2
    token 1, and drops src 1 expert 3 token 1."""
    idx = [torch.tensor([[1, 0], [0, 2], [1, 3]]), torch.tensor([[0, 1], [2, 3], [1, 0]])]
    expect = [torch.tensor([[True, True], [True, True], [False, True]]),
              torch.tensor([[False, False], [True, False], [False, False]])]
    got = runtime_keep(idx, 4, 3)
    assert all(torch.equal(g, e) for g, e in zip(got, expect)), got
    assert torch.equal(reference_keep(torch.cat(idx), 2, 2, 4, 3), torch.cat(expect))
    # the router listing each token's experts the other way round changes nothing but the columns
    swapped = runtime_keep([i.flip(1) for i in idx], 4, 3)
    assert all(torch.equal(s, e.flip(1)) for s, e in zip(swapped, expect))


def test_hand_worked_tail_drop_with_batches_of_different_shapes():
    """Rank 0 routes one token, rank 1 three (K = 2, experts 0-1 on rank 0, 2-3 on rank 1), each with a
    receive buffer of its own rows (capacity factor 1): rank 0 takes at most 2 rows, rank 1 6, whichever
    rank decides. Destination 0 takes src 0 expert 0 token 0, then src 1 expert 0 token 0 (full); it drops
    src 1 expert 0 tokens 1, 2 and expert 1 tokens 0, 1. Destination 1 takes src 0 expert 2 token 0 and
    src 1 expert 3 token 2."""
    idx = [torch.tensor([[0, 2]]), torch.tensor([[0, 1], [1, 0], [0, 3]])]
    expect = [torch.tensor([[True, True]]), torch.tensor([[True, False], [False, False], [False, True]])]
    got = runtime_keep(idx, 4, [2, 6])
    assert all(torch.equal(g, e) for g, e in zip(got, expect)), got
    # factor 3/2: ⌈1.5·2⌉ = 3 rows for rank 0 keeps src 1 expert 0 token 1 too
    got = runtime_keep(idx, 4, [3, 9])
    assert torch.equal(got[1], torch.tensor([[True, False], [False, True], [False, True]])), got


@pytest.mark.parametrize("ep,experts,k,tokens,capacity", [(2, 4, 2, 8, 5), (4, 8, 3, 16, 9), (4, 8, 2, 12, 1),
                                                           (2, 8, 4, 10, 30), (4, 16, 4, 16, 1000)])
def test_tail_drop_ignores_the_order_of_top_k(ep, experts, k, tokens, capacity):
    """Random routes (K distinct experts per token), each token's K experts listed in a random order:
    the runtime keeps the same (token, expert) rows, the ones the loop-form reference keeps."""
    g = torch.Generator().manual_seed(ep * 1000 + experts * 10 + k)
    idx = [torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) for _ in range(ep)]
    shuffled = [torch.stack([row[torch.randperm(k, generator=g)] for row in i]) for i in idx]
    a, b = runtime_keep(idx, experts, capacity), runtime_keep(shuffled, experts, capacity)
    ref_a = reference_keep(torch.cat(idx), ep, ep, experts, capacity).split(tokens)
    ref_b = reference_keep(torch.cat(shuffled), ep, ep, experts, capacity).split(tokens)
    for r in range(ep):
        assert torch.equal(a[r], ref_a[r]) and torch.equal(b[r], ref_b[r])
        assert kept_pairs(idx[r], a[r]) == kept_pairs(shuffled[r], b[r])
    if capacity < tokens * k:
        assert sum(int(x.sum()) for x in a) < ep * tokens * k  # the case drops rows


# -- 2. the skewed parity scenario is well conditioned ---------------------------------------------

WORLD, EP_MP = 4, 2  # as test_capacity_drops_match_reference and test_routing_extremes run it


def skewed_reference(name: str, capacity_factor: float | None, dtype: torch.dtype):
    """The reference of the parity worker's "skewed" scenario in ``dtype``: gradients, router logits."""
    kw = {"lb_coef": 0.0, "z_coef": 0.0} if capacity_factor and name.startswith("tiny") else {}
    model = build_model(name, **kw)
    cand = find_candidates(model)[0]
    skew_to_first_experts(model, cand.experts.num_experts // EP_MP)
    model = model.to(dtype)
    if dtype == torch.float64 and not name.startswith("tiny"):
        model.config._experts_implementation = "eager"  # transformers' grouped_mm takes fp32/bf16 only
    logits: list[torch.Tensor] = []

    def record(mod, inp, out):
        logits.append((out if isinstance(out, torch.Tensor) else out[0]).detach())

    hooks = [r.register_forward_hook(record) for r in routers(model)]  # deep copies keep the hooks
    batches = make_batches(WORLD, 2, 16, seed=7)
    if capacity_factor is None:
        _, grads = dense_reference(model, batches)
    else:
        _, grads = capacity_reference(model, batches, WORLD, EP_MP, capacity_factor)
    for h in hooks:
        h.remove()
    return grads, torch.cat(logits), cand.top_k, cand.experts.num_experts // EP_MP


@pytest.mark.parametrize("name,cf", [("tiny", 1.0), ("tiny", 0.5), ("mixtral", 1.0), ("mixtral", 0.5),
                                     ("tiny", None), ("olmoe", None)])
def test_skewed_parity_scenario_is_well_conditioned(name, cf):
    g32, lg32, k, first = skewed_reference(name, cf, torch.float32)
    g64, lg64, _, _ = skewed_reference(name, cf, torch.float64)
    top32, top64 = lg32.topk(k, dim=-1).indices, lg64.topk(k, dim=-1).indices
    assert bool((top32 < first).all()), "the skew must route every token to rank 0's experts"
    flips = (top32.sort(-1).values != top64.sort(-1).values).any(-1)
    assert not bool(flips.any()), f"{int(flips.sum())} top-{k} choices flip between fp32 and fp64 (near-ties)"
    errs = {n: rel_err(g32[n].double(), g64[n]) for n in g64}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL / 2, (worst, errs[worst], g64[worst].abs().max().item())
