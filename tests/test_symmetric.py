"""Symmetric-memory transport and compile-time lease planning.

* transport="symmetric" (host shared memory, one-sided PUT/GET) equals transport="all_to_all"
  bitwise, forward and backward, fp32 and bf16, 3 MoE layers, 2 and 4 ranks;
* the plan's high-water equals what the runtime observes; sharing vs fixed per-block caches;
* a corrupted plan is rejected; injected reuse bugs are caught by the runtime guards;
* the runtime frees its own shared-memory segments, also for a rank killed mid-step: the launcher's
  after-the-fact cleanup finds nothing; it removes (and reports) only what a rank killed inside an
  allocation leaves.
"""

from __future__ import annotations

import copy
import os
import signal
import uuid

import pytest
import torch

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import IRError, RuntimeFault
from moe_compile.leases import LeasePlan, Payload
from moe_compile.passes.plan_leases import verify_lease_plan
from moe_compile.runtime.lease_runtime import LeaseFault
from moe_compile.runtime.symmetric import futex

from .common import build_model, dense_reference, make_batches, rel_err
from .harness import RankFailure, run_ranks


def _model(name: str, dtype: torch.dtype):
    m = build_model(name, n_layers=3) if name == "tiny" else build_model(name, layers=3)
    return m.to(dtype)


def _steps(cm, batch, steps=2):
    """Two training steps without zeroing grads (accumulating through the reducer) + one no-grad forward."""
    losses = []
    for _ in range(steps):
        out = cm(input_ids=batch, labels=batch)
        out.loss.backward()
        losses.append(out.loss.detach())
    with torch.no_grad():
        infer = cm(input_ids=batch, labels=batch).logits
    return torch.stack(losses), cm.full_grads(), infer


def parity_worker(rank, world, cases):
    res = {}
    for name, dtype in cases:
        model = _model(name, dtype)
        batches = make_batches(world, seed=11)
        ref_grads = dense_reference(model, batches)[1] if dtype == torch.float32 else None
        out = {}
        for transport in ("all_to_all", "symmetric"):
            cm = moe_compile(copy.deepcopy(model), MeshSpec(ep_mp=world), transport=transport)
            losses, grads, infer = _steps(cm, batches[rank])
            out[transport] = (losses, grads, infer, cm)
        (la, ga, ia, _), (ls, gs, is_, cms) = out["all_to_all"], out["symmetric"]
        plan, rt = cms.lease_plan(), cms.lease_runtime()
        res[name] = {
            "transport": cms.program.transport,
            "bitwise": torch.equal(la, ls) and all(torch.equal(ga[k], gs[k]) for k in ga) and torch.equal(ia, is_),
            "ref_err": max(rel_err(gs[k] / 2, ref_grads[k]) for k in gs) if ref_grads is not None else None,
            "plan_high_water": dict(plan.high_water),
            "observed_high_water": dict(rt.observed_high_water),
            "leased": sorted(p.name for p in plan.payloads if p.leased),
            "inference_leased": [p.name for p in cms.lease_plan("inference").payloads if p.leased],
            "a2a_plan_empty": not out["all_to_all"][3].lease_plan().payloads,
            "peer_bytes": cms.stats()["bytes_sent"].get("ep_mp", 0),
        }
    return res


def _check_parity(results, layers=3):
    assert any(r["ref_err"] is not None for per_rank in results for r in per_rank.values())  # an fp32 case ran
    for per_rank in results:
        for name, r in per_rank.items():
            assert r["transport"] == "symmetric"
            assert r["bitwise"], (name, r)
            assert r["ref_err"] is None or r["ref_err"] <= 1e-5, (name, r)  # None: bf16, bitwise vs a2a only
            assert r["plan_high_water"] == r["observed_high_water"], (name, r)
            assert r["plan_high_water"][(0, "lease")] == layers  # every layer's receive rows wait for backward
            assert len(r["leased"]) == layers and all(n.endswith("/dispatch.recv") for n in r["leased"])
            assert r["inference_leased"] == []  # without backward nothing outlives its reader
            assert r["a2a_plan_empty"] and r["peer_bytes"] > 0


@pytest.mark.slow
def test_symmetric_equals_all_to_all_two_ranks_fp32_and_bf16():
    _check_parity(run_ranks(parity_worker, 2, (("qwen2_moe", torch.float32), ("mixtral", torch.bfloat16))))


@pytest.mark.slow
def test_symmetric_equals_all_to_all_four_ranks():
    _check_parity(run_ranks(parity_worker, 4, (("tiny", torch.float32),)))


# -- sharing, guards, faults ----------------------------------------------------------------------


def lease_worker(rank, world):
    out = {}
    batches = make_batches(world, seed=5)
    model = build_model("tiny", n_layers=3)
    ref = dense_reference(model, batches)[1]
    for sharing in (True, False):
        cm = moe_compile(copy.deepcopy(model), MeshSpec(ep_mp=world), transport="symmetric", lease_sharing=sharing)
        cm(input_ids=batches[rank], labels=batches[rank]).loss.backward()
        plan, rt = cm.lease_plan(), cm.lease_runtime()
        recv = next(p for p in plan.payloads if p.name.endswith("dispatch.recv"))
        out[sharing] = {"bytes": rt.symmetric_bytes, "plan_bytes": plan.symmetric_bytes,
                        "high_water": dict(plan.high_water), "observed": dict(rt.observed_high_water),
                        "recv_bytes": recv.nbytes, "payloads": len(plan.payloads),
                        "grad_err": max(rel_err(g, ref[k]) for k, g in cm.full_grads().items())}

    def run(fault=None, forward_only=False):
        cm = moe_compile(copy.deepcopy(model), MeshSpec(ep_mp=world), transport="symmetric")
        cm(input_ids=batches[rank], labels=batches[rank]).loss.backward()  # builds and activates the plan
        cm.zero_grad(set_to_none=False)
        cm.lease_runtime().fault = fault
        try:
            loss = cm(input_ids=batches[rank], labels=batches[rank]).loss
            if forward_only:
                cm(input_ids=batches[rank], labels=batches[rank])
            loss.backward()
        except RuntimeFault as e:
            return "fault", str(e)
        return "ok", max(rel_err(g, ref[k]) for k, g in cm.full_grads().items())

    l0, l1 = "layers.0.mlp/dispatch.recv", "layers.1.mlp/dispatch.recv"
    out["steal"] = run(LeaseFault("steal", l1, victim=l0))
    out["steal_unguarded"] = run(LeaseFault("steal", l1, victim=l0, unguarded=True))
    out["release_early"] = run(LeaseFault("release_early", l0))
    out["no_backward"] = run(forward_only=True)
    out["clean"] = run()
    return out


@pytest.mark.slow
def test_lease_sharing_guards_and_faults():
    r = run_ranks(lease_worker, 2)[0]
    shared, fixed = r[True], r[False]
    layers = 3
    print(f"\nsymmetric bytes with sharing: {shared['bytes']} (high-water {shared['high_water']}); "
          f"without sharing: {fixed['bytes']} ({fixed['payloads']} fixed per-block caches)")
    assert shared["grad_err"] <= 1e-5 and fixed["grad_err"] <= 1e-5
    assert shared["high_water"] == shared["observed"] and fixed["observed"] == shared["observed"]
    # sharing: each family pool holds exactly its high-water, so the receive payloads cost
    # high-water × payload; without sharing every layer keeps its own copy of every payload
    assert shared["bytes"] == shared["plan_bytes"] <= sum(shared["high_water"].values()) * 64 * 1024
    assert shared["high_water"][(0, "lease")] * shared["recv_bytes"] <= shared["bytes"]
    assert fixed["bytes"] >= layers * 4 * shared["recv_bytes"]  # 4 [cap, d] payloads per layer
    assert shared["bytes"] < fixed["bytes"]
    kind, msg = r["steal"]
    assert kind == "fault" and "layers.1.mlp/dispatch.recv (MoE layer layers.1.mlp) would overwrite slot" in msg
    assert "while the lease of layers.0.mlp/dispatch.recv" in msg
    kind, err = r["steal_unguarded"]
    assert kind == "ok" and err > 1e-3, "without the guard the reuse silently corrupts gradients"
    kind, msg = r["release_early"]
    assert kind == "fault" and "read of payload layers.0.mlp/dispatch.recv" in msg and "after its lease was released" in msg
    kind, msg = r["no_backward"]
    assert kind == "fault" and "2 forwards in flight" in msg and "forwards_in_flight=2" in msg
    assert r["clean"][0] == "ok" and r["clean"][1] <= 1e-5


def test_verifier_rejects_slot_reuse_while_leased():
    def p(name, a, b, slot):
        return Payload(name, name.split("/")[0], "lease", (4, 8), "torch.float32", 128, a, b, True, slot)

    ok = LeasePlan((p("a/dispatch.recv", 0, 10, 0), p("b/dispatch.recv", 10, 20, 0)), 20, True,
                   slot_bytes={(0, "lease"): 128})
    verify_lease_plan(ok)
    bad = LeasePlan((p("a/dispatch.recv", 0, 10, 0), p("b/dispatch.recv", 5, 20, 0)), 20, True,
                    slot_bytes={(0, "lease"): 128})
    with pytest.raises(IRError, match=r"slot 0 of pool lease@0 is written by b/dispatch.recv at position 5 while "
                                      r"the lease of a/dispatch.recv \(MoE layer a\) is live \[0, 10\)"):
        verify_lease_plan(bad)


# -- runtime guards without a model -------------------------------------------------------------


def guard_worker(rank, world):
    from moe_compile.runtime.lease_runtime import LeaseRuntime
    from moe_compile.runtime.symmetric import HostShmHeap, job_prefix

    heap = HostShmHeap(torch.distributed.group.WORLD)
    mine = [f for f in os.listdir("/dev/shm") if f.startswith(heap.prefix)]
    rt = LeaseRuntime(heap, None)
    pay = Payload("blk/dispatch.recv", "blk", "lease", (4, 8), "torch.float32", 128, 0, 5, True, 0)
    plan = LeasePlan((pay,), 6, True, {(0, "lease"): 1}, {(0, "lease"): 128})
    rt.activate(rt.install(plan))
    lease = rt.acquire(pay.name)
    lease.local.fill_(1.0)
    errors = {}
    rt.release(pay.name)
    for what, call in {"double_release": lambda: rt.release(pay.name),
                       "read_released": lambda: rt.check(pay.name)}.items():
        try:
            call()
        except RuntimeFault as e:
            errors[what] = str(e)
    # a plan that asks the frozen pool for a slot it was not created with
    bigger = LeasePlan((Payload("blk/dispatch.recv", "blk", "lease", (4, 8), "torch.float32", 128, 0, 5, True, 3),),
                       6, True, {(0, "lease"): 4}, {(0, "lease"): 128})
    rt.plans[rt.active], rt._by_name[rt.active] = bigger, {p.name: p for p in bigger.payloads}  # test-only swap
    try:
        rt.acquire(pay.name)
    except RuntimeFault as e:
        errors["growth"] = str(e)
    rt_poison = LeaseRuntime(heap, None, poison=True)
    rt_poison.activate(rt_poison.install(plan))
    lz = rt_poison.acquire(pay.name)
    view = lz.local
    view.fill_(2.0)
    rt_poison.release(pay.name)
    return {"names_left": mine, "errors": errors, "poisoned": bool(torch.isnan(view).all()), "prefix": job_prefix()}


@pytest.mark.slow
def test_runtime_guards_and_unlinked_segments():
    r = run_ranks(guard_worker, 1)[0]
    assert r["names_left"] == []  # segment names are unlinked as soon as every member mapped them
    assert "double release of payload blk/dispatch.recv (MoE layer blk)" in r["errors"]["double_release"]
    assert "read of payload blk/dispatch.recv (MoE layer blk) after its lease was released" in r["errors"]["read_released"]
    assert "pool lease@0 is frozen at 1 slots" in r["errors"]["growth"]
    assert r["poisoned"]


def kill_worker(rank, world):
    model = build_model("tiny")
    cm = moe_compile(model, MeshSpec(ep_mp=world), transport="symmetric")
    b = make_batches(world)[rank]
    cm(input_ids=b, labels=b).loss.backward()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies between steps, holding mapped segments
    cm(input_ids=b, labels=b).loss.backward()  # rank 0 waits for a peer that never comes


def _job_segments(job: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"moe_compile_{job}_"))


@pytest.mark.slow
def test_no_segments_left_after_a_rank_is_killed():
    """The runtime itself leaves nothing to clean up, even for a rank killed by SIGKILL (no exit
    handler runs): the heap unlinks every name once all members mapped it. The launcher removes what
    the job's prefix still names after the ranks are gone and reports it; here it must find nothing."""
    from moe_compile.runtime.launcher import spawn_ranks

    job = f"killtest{os.getpid()}"
    cleaned: list[str] = []
    with pytest.raises(RankFailure) as e:
        spawn_ranks(kill_worker, 2, timeout=120, env={"MOE_COMPILE_JOB": job}, cleaned=cleaned)
    assert "without a report" in str(e.value)  # rank 1 was killed, not failed
    assert cleaned == [] and e.value.cleaned == []
    assert _job_segments(job) == []


def heap_worker(rank, world, kill_in_alloc):
    """Allocate on the host heap, exchange through a peer's segment; with ``kill_in_alloc`` rank 1 is
    SIGKILLed in its second allocation, after creating its segment and before anyone could unlink it."""
    from moe_compile.runtime.symmetric import HostShmHeap, host

    heap = HostShmHeap(torch.distributed.group.WORLD)  # its first allocation: the signal array
    if kill_in_alloc and rank == 1:
        original = host._map

        def map_then_die(path, nbytes, create, **kw):
            m = original(path, nbytes, create, **kw)
            if create:
                os.kill(os.getpid(), signal.SIGKILL)
            return m

        host._map = map_then_die
    buf = heap.alloc("rows", (world, 16), torch.float32)
    heap.barrier()  # every owner has zeroed its segment
    buf.views[(rank + 1) % world][rank].fill_(rank + 1.0)  # a PUT into the next rank's segment
    heap.barrier()
    got = buf.local.clone()
    left = [f for f in os.listdir("/dev/shm") if f.startswith(heap.prefix)]
    heap.close()
    return {"got": got, "names_left": left, "prefix": heap.prefix}


def mismatch_worker(rank, world):
    """Members that allocate different shapes (a collective mismatch): the one whose peer's segment is
    too small for it fails naming the allocation and both sizes, not inside mmap, and the others fail too
    (none goes on with a buffer its peers do not share)."""
    from moe_compile.runtime.symmetric import HostShmHeap

    heap = HostShmHeap(torch.distributed.group.WORLD)
    out = {}
    try:
        heap.alloc("rows", (2, 16 if rank == 0 else 8), torch.float32)
    except RuntimeFault as e:
        out["error"] = str(e)
    heap.close()
    return out


def test_a_shape_mismatch_between_members_is_named():
    r0, r1 = run_ranks(mismatch_worker, 2)
    assert "allocation 'rows' (2, 16) torch.float32, member 0 of 2: this rank allocates 128 bytes" in r0["error"], r0
    assert "every member must allocate the same shape" in r0["error"], r0
    assert "allocation 'rows' (2, 8) torch.float32, member 1 of 2: another member's segment has another size" \
        in r1["error"], r1


@pytest.mark.slow
def test_a_normal_run_leaves_the_launcher_nothing_to_clean():
    from moe_compile.runtime.launcher import spawn_ranks

    job = f"cleanrun{os.getpid()}"
    cleaned: list[str] = []
    out = spawn_ranks(heap_worker, 2, False, timeout=120, env={"MOE_COMPILE_JOB": job, "OMP_NUM_THREADS": "1"},
                      cleaned=cleaned)
    assert cleaned == [] and _job_segments(job) == []
    assert [r["names_left"] for r in out] == [[], []]  # unlinked while the ranks still run
    assert [float(r["got"][(i - 1) % 2, 0]) for i, r in enumerate(out)] == [2.0, 1.0]  # the peer's PUT landed


@pytest.mark.slow
def test_launcher_removes_and_reports_a_segment_of_a_rank_killed_mid_allocation():
    from moe_compile.runtime.launcher import spawn_ranks

    job = f"allockill{os.getpid()}"
    cleaned: list[str] = []
    with pytest.raises(RankFailure) as e:
        spawn_ranks(heap_worker, 2, True, timeout=120, env={"MOE_COMPILE_JOB": job, "OMP_NUM_THREADS": "1"},
                    cleaned=cleaned)
    assert e.value.cleaned == cleaned
    # segment names are <job prefix>_<heap token>_<allocation>_<rank>: rank 1's segment of allocation 1
    # (the signal array, allocation 0, was unlinked by the runtime before the kill)
    parts = [name.rsplit("_", 2) for name in cleaned]
    assert all(name.startswith(f"moe_compile_{job}_") for name in cleaned), cleaned
    assert ["1", "1"] in [p[1:] for p in parts] and all(p[1] == "1" for p in parts), cleaned
    assert _job_segments(job) == []


def test_route_map_matches_the_all_to_all_receive_layout():
    """The sync-free per-row route map (destination rank and row, −1 dropped) lands every row where
    the all_to_all transport's receiver puts it, including under capacity drops."""
    from moe_compile.runtime import RoutePlan, keep_counts
    from moe_compile.runtime.symmetric_transport import SymmetricTransport, route_map

    g = torch.Generator().manual_seed(0)
    ep, nl = 4, 3
    for capacity in (10**6, 40, 7):
        req = torch.randint(0, 9, (ep, ep, nl), generator=g)
        layout = torch.stack([req, keep_counts(req, capacity)])
        plans = [RoutePlan.from_layout(layout, r) for r in range(ep)]
        for me in range(ep):
            rows = int(req[me].sum())
            dst, dst_row = route_map(layout, me, rows)
            expect_rank = torch.full((rows,), -1)
            expect_row = torch.full((rows,), -1)
            sent = plans[me].send_index  # kept rows, in (dst, expert) order
            dests = torch.repeat_interleave(torch.arange(ep), torch.tensor(plans[me].send_splits))
            for r in range(ep):
                mine = sent[dests == r]
                start = sum(plans[r].recv_splits[:me])
                expect_rank[mine] = r
                expect_row[mine] = plans[r].recv_pos[start: start + mine.numel()]
            kept = expect_row >= 0
            assert torch.equal(dst_row, expect_row) and torch.equal(dst[kept], expect_rank[kept])
            segs = SymmetricTransport.segments(plans[me])
            assert sum(n for *_, n in segs) == int(kept.sum())
            for d, s0, d0, n in segs:
                assert torch.equal(dst_row[s0: s0 + n], torch.arange(d0, d0 + n)) and bool((dst[s0: s0 + n] == d).all())


def _raise_later(path: str, delay_s: float, stamp) -> None:
    import mmap
    import time

    from moe_compile.runtime.symmetric.host import raise_flag

    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 64)
    os.close(fd)
    flags = torch.frombuffer(m, dtype=torch.uint8, count=64).view(torch.int64)
    time.sleep(delay_s)
    stamp.value = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    raise_flag(flags, 3, 7)


@pytest.mark.skipif(not futex.available(), reason="futexes: Linux x86-64 only")
def test_flag_wait_sleeps_until_the_writer_wakes_it(monkeypatch, tmp_path):
    """A rank waiting for a peer's shared-memory flag sleeps in the kernel (no polling CPU: ranks may
    outnumber cores) and is woken by the write itself, not by its park timeout (raised to 5 s here)."""
    import mmap
    import multiprocessing as mp
    import time

    from moe_compile.runtime.symmetric import host

    path = f"/dev/shm/moe_compile_test_futex_{os.getpid()}_{uuid.uuid4().hex[:8]}"  # pids repeat across hosts' runs
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 64)
        m = mmap.mmap(fd, 64)
        flags = torch.frombuffer(m, dtype=torch.uint8, count=64).view(torch.int64)
        monkeypatch.setattr(host, "PARK_S", 5.0)
        ctx = mp.get_context("spawn")
        stamp = ctx.Value("d", 0.0)
        peer = ctx.Process(target=_raise_later, args=(path, 0.5, stamp))
        cpu0 = time.process_time()
        peer.start()
        host.spin_until(lambda: int(flags[3]) >= 7, lambda: "peer", timeout_s=60,
                        park=host.park_on([(flags, 3)], 7))
        woke, cpu = time.monotonic(), time.process_time() - cpu0
        peer.join(30)
        assert stamp.value > 0 and woke - stamp.value < 1.0, (woke - stamp.value)  # not the 5 s park timeout
        assert cpu < 0.1, f"the waiter used {cpu:.3f} s of CPU while sleeping"
        flags[5] = 0  # a flag nobody raises: the wait ends at its deadline with the late peer named
        monkeypatch.setattr(host, "PARK_S", 0.05)
        with pytest.raises(RuntimeFault, match="peer 5 did not arrive"):
            host.spin_until(lambda: int(flags[5]) >= 1, lambda: "peer 5", timeout_s=0.3,
                            park=host.park_on([(flags, 5)], 1))
    finally:
        os.close(fd)
        os.unlink(path)
