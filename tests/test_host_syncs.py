"""No device→host sync in dispatch/combine: count value reads made by moe_compile's code in one training
step (forward + backward, after a warm-up step) on 2 CPU ranks, per transport.

Allowed (each necessary, and why):
* ``runtime/route_plan.py:from_layout`` / ``segment_rows`` — all_to_all transport only: a collective with
  uneven splits (gloo's and NCCL's ``all_to_all_single``) takes its split sizes as Python lists, so each
  movement (dispatch, combine and their backward mirrors) reads the send/receive splits (``tolist``) and
  the row totals (``int``) on the host. The symmetric transport (NVSHMEM on GPU) has none.
* ``runtime/dropless.py:settle`` — once per forward (not per layer): one ``tolist`` of whether any rank
  would receive more than its dropless capacity, how many rows, and the (need, rows) of the destination
  needing the largest factor. Recompiling for a grown capacity is a host decision; its inputs are read
  once, after the last MoE layer.
Everything else on the transport path (route maps, segment offsets, capacity decisions, byte counters)
stays tensors.

Outside the transport path (not counted here; this step runs neither):
* ``runtime/lease_runtime.py:_agreed_busy`` — forwards_in_flight > 1 only: once per forward, the EP
  group's all-reduced busy flags of the lease instances (``tolist``), so every rank claims the same one.
* ``runtime/batch_agreement.py:agree_on_batch`` — cm.train_step only (every mesh; not cm(...)): once per
  step, the world's all-reduced verdict on the batches (a rank's refusal, out-of-vocabulary token ids and
  labels; ``tolist``), before the step's first collective, so that every rank refuses together.
"""

from __future__ import annotations

import pytest

from moe_compile import MeshSpec, moe_compile
from moe_compile.runtime.host_syncs import count_host_syncs

from .common import build_model, make_batches
from .harness import run_ranks

TRANSPORT_FILES = ("runtime/transport.py", "runtime/symmetric_transport.py", "runtime/route_plan.py",
                   "ops/transport.py", "runtime/dropless.py", "codegen/kernels/route_map.py", "runtime/stats.py")
ALLOWED_A2A = {"runtime/route_plan.py:from_layout", "runtime/route_plan.py:segment_rows"}
ALLOWED = {"runtime/dropless.py:settle"}


def sync_worker(rank: int, world: int, transport: str) -> dict:
    model = build_model("tiny")
    batches = make_batches(world, 2, 16, seed=7)
    cm = moe_compile(model, MeshSpec.parse(f"ep_mp={world}").resolve(world), transport=transport)
    for step in range(2):  # the first step compiles; the second is counted
        if step:
            with count_host_syncs() as counts:
                cm(input_ids=batches[rank], labels=batches[rank]).loss.backward()
        else:
            cm(input_ids=batches[rank], labels=batches[rank]).loss.backward()
    cm.close()
    return {f"{site}/{m}": n for (site, m), n in counts.items()}


@pytest.mark.parametrize("transport", ["symmetric", "all_to_all"])
def test_transport_path_has_only_documented_host_syncs(transport):
    counts = run_ranks(sync_worker, 2, transport)[0]
    on_path = {k: n for k, n in counts.items() if k.startswith(TRANSPORT_FILES)}
    allowed = ALLOWED | (ALLOWED_A2A if transport == "all_to_all" else set())
    print(f"\n{transport}: host reads on the transport path per step: {on_path}")
    assert {k.rsplit("/", 1)[0] for k in on_path} <= allowed, on_path
    settle = sum(n for k, n in on_path.items() if k.startswith("runtime/dropless.py"))
    assert settle == 1  # one read per forward (the model has 2 MoE layers: not per layer)
