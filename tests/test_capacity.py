"""Capacity rounding: one exact rule for the receive buffer, shared by the dispatch pass and the ledger.

The capacity of a destination rank is ⌈cf·T·K⌉ rows for the decimal capacity factor the user wrote —
1.1·90 = 99 exactly — not the ceiling of the binary double product (1.1 * 90 = 99.00000000000001 → 100).
The expected numbers below are worked out by hand.
"""

from __future__ import annotations

import pytest
import sympy as sp
import torch

from moe_compile import MeshSpec, ledger, moe_compile
from moe_compile.ir import MOE_META, Role
from moe_compile.ledger import evaluate
from moe_compile.ledger.symbols import SYMBOLS
from moe_compile.runtime import get_context
from moe_compile.runtime.route_plan import capacity_rows

from .common import build_model, make_batches

# (capacity factor, T·K rows, receive rows by hand). The float product lands just above an integer for
# 1.1·90 (99.00000000000001), 1.1·50 (55.00000000000001) and 2.2·45 (99.00000000000001): a float
# ceiling gives one row more than the decimal value there.
HAND = [
    (1.1, 90, 99),    # 11/10 · 90 = 99
    (1.1, 50, 55),    # 11/10 · 50 = 55
    (2.2, 45, 99),    # 11/5 · 45 = 99
    (1.1, 91, 101),   # 1001/10 = 100.1 → 101
    (1.25, 8, 10),    # 5/4 · 8 = 10
    (0.5, 7, 4),      # 7/2 = 3.5 → 4
    (0.3, 11, 4),     # 33/10 = 3.3 → 4
    (1.0, 90, 90),    # cf = 1 keeps T·K
    (1.0, 7, 7),
]


@pytest.mark.parametrize("cf,rows,expect", HAND)
def test_capacity_rows_is_the_exact_ceiling(cf, rows, expect):
    assert capacity_rows(rows, 1, cf) == expect
    assert capacity_rows(rows, 4, cf) == expect  # with a capacity factor, the group size does not enter


def test_dropless_capacity_is_ep_times_rows():
    assert capacity_rows(90, 1, None) == 90 and capacity_rows(64, 4, None) == 256


@pytest.mark.parametrize("cf,rows,expect", HAND)
def test_ledger_capacity_figure_agrees(cf, rows, expect):
    """The symbolic figure C = ceiling(c_f·T·K), evaluated the way the ledger substitutes a capacity
    factor, gives the same rows for T·K = rows (as T = rows, K = 1 and as T = rows/2, K = 2)."""
    assert ledger.formula("C") == sp.ceiling(SYMBOLS["c_f"].symbol * SYMBOLS["T"].symbol * SYMBOLS["K"].symbol)
    assert evaluate({"T": rows, "K": 1, "c_f": cf})["C"] == expect
    if rows % 2 == 0:
        assert evaluate({"T": rows // 2, "K": 2, "c_f": cf})["C"] == expect



def test_ledger_reads_the_factor_as_the_pass_does():
    """A factor whose shortest decimal is not a simple fraction (0.1·3 = 0.30000000000000004): both read
    that decimal, so 10 rows need ⌈3.0000000000000004⌉ = 4 (sympy.nsimplify would round it to 3/10 → 3)."""
    cf = 0.1 * 3
    assert repr(cf) == "0.30000000000000004"
    assert capacity_rows(10, 1, cf) == 4 == evaluate({"T": 10, "K": 1, "c_f": cf})["C"]

def test_compiled_receive_buffer_matches_ledger_and_hand_count():
    """cf = 1.1, one rank, T = 45 tokens, K = 2: T·K = 90 routed rows, so the receive buffer has
    ⌈11/10 · 90⌉ = 99 rows — in the partitioned graph's dispatch nodes (capacity argument and fake
    value), in the buffer the runtime really allocates, and in the ledger's figure C."""
    model = build_model("tiny", lb_coef=0.0, z_coef=0.0)
    cm = moe_compile(model, MeshSpec(), capacity_factor=1.1)
    try:
        transport = get_context(cm.program.ctx_id).transport
        seen: list[int] = []
        orig = transport.dispatch_rows

        def dispatch_rows(xs, plan, capacity, what, block="", **kw):
            recv = orig(xs, plan, capacity, what, block, **kw)
            seen.append(recv.shape[0])
            return recv

        transport.dispatch_rows = dispatch_rows
        ids = make_batches(1, batch=1, seq=45)[0]
        cm(input_ids=ids, labels=ids).loss.backward()

        dispatch = [n for n in cm.graphs()["partitioned"].graph.nodes
                    if getattr(n.meta.get(MOE_META), "role", None) == Role.DISPATCH
                    and n.target is torch.ops.moe.dispatch.default]
        assert len(dispatch) == 2  # one per MoE layer
        for n in dispatch:
            spec = n.meta[MOE_META].dispatch
            assert (spec.num_tokens, spec.top_k) == (45, 2)
            assert spec.capacity == 99
            assert n.args[4] == 99  # moe::dispatch(xs, counts, ctx, block, capacity, ep_size)
            assert n.meta["val"][0].shape[0] == 99  # the static receive buffer
        assert seen and set(seen) == {99}  # forward dispatches (and backward mirrors, if any) at runtime
        assert cm.ledger()["C"] == 99
    finally:
        cm.close()
