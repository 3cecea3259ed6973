"""OLMoDDPOptimizer against torch's AdamW on the dense model, and checkpoints moved between topologies.

One 4-rank world (ep_dp=2, ep_mp=2, gradients reduce-scattered) trains 20 steps and saves at step 10 (a save at step 12 is made to
fail mid-way); two more worlds load the step-10 checkpoint under (ep_mp=4) and under (ep_mp=2, ep_dp=1,
2 ranks with m=2 microbatches, the same global batch) and train on to step 20.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import CheckpointError
from moe_compile.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from moe_compile.train.loop import train_step
from moe_compile.train.optimizer import OLMoDDPOptimizer

from .common import build_model, make_batches, rel_err
from .harness import run_ranks

STEPS, SAVE_AT, WORLD = 20, 10, 4
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
MAX_NORM = 1.0


def global_batches(step: int) -> list[torch.Tensor]:
    """The step's global batch: 4 microbatches (one per rank of the 4-rank world)."""
    return make_batches(WORLD, seed=step)


def my_microbatches(step: int, dp_rank: int, m: int) -> list[torch.Tensor]:
    return global_batches(step)[dp_rank * m: (dp_rank + 1) * m]


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ per tensor. Parameters are compared this way rather than element by element:
    Adam divides by √v, so an element whose gradient is near zero turns fp32 rounding differences
    between the compiled and the dense backward into lr-sized steps (max-element error ≈ 4e-5 of the
    tensor's max after 20 steps, while ‖a − b‖/‖b‖ ≈ 2e-6). A real fault — a wrong ZeRO slice, a norm
    counted ep_dp times, a missed reduction — is off by orders of magnitude more."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def mean_loss(local: torch.Tensor, world: int) -> float:
    t = local.detach().clone()
    torch.distributed.all_reduce(t)
    return (t / world).item()


def full_state(cm, opt) -> dict:
    return {"params": cm.full_state_dict(), "optim": opt.full_state()}


def packed(obj) -> bytes:
    """Tensors leave a rank as bytes (shared-memory handles die with the rank process)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpacked(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def train_worker(rank, world, mesh, ckpt, start, m, saved):
    """Train steps [start, STEPS) on ``mesh``; from scratch (start 0, saving at SAVE_AT) or after loading
    the checkpoint in ``ckpt``. Returns per-step losses and grad norms and full states."""
    cm = moe_compile(build_model("tiny"), MeshSpec.parse(mesh))
    # the first world reduce-scatters its buckets into the ZeRO-1 ranges (the default off gloo); the
    # resumed worlds all-reduce (gloo's default): steps 0–10 check the one, 10–20 the other
    opt = OLMoDDPOptimizer(cm, max_grad_norm=MAX_NORM, reduce_scatter=not start, **HYPER)
    dp_rank = cm.program.mesh.dense_coords(rank)[1]
    out = {"losses": {}, "norms": {}}
    if start:
        fresh = full_state(cm, opt)
        state = load_checkpoint(ckpt, cm, opt)
        out["loaded_step"] = (state.step, state.data_position, state.optimizer_step)
        out["loaded"] = full_state(cm, opt)
        out["was_different"] = any(not torch.equal(fresh["params"][n], saved["params"][n]) for n in saved["params"])
    else:
        dense = sum(s.width for s in opt.families[0].slots)
        expert = sum(s.width for s in opt.families[1].slots)
        local = sum(p.numel() for p in cm.model.parameters())
        out["state_fraction"] = (dense + expert) / local
    for step in range(start, STEPS):
        local, res = train_step(cm, opt, my_microbatches(step, dp_rank, m))
        out["losses"][step] = mean_loss(local, world)
        out["norms"][step] = res.grad_norm
        if step + 1 == SAVE_AT and not start:
            save_checkpoint(ckpt, cm, opt, step=SAVE_AT, data_position=SAVE_AT * WORLD)
            out["saved"] = full_state(cm, opt)
        if step + 1 == SAVE_AT + 2 and not start:
            def fail(stage):
                if stage == "manifest":  # rank 0 only: after the data and the manifest, before the rename
                    raise RuntimeError(f"injected crash at {stage}")
            try:
                save_checkpoint(ckpt, cm, opt, step=step + 1, data_position=0, _fault=fail)
                out["crash_save"] = "no error"
            except CheckpointError as e:
                out["crash_save"] = str(e)
            out["latest_after_crash"] = str(latest_checkpoint(ckpt))
    out["final"] = full_state(cm, opt)["params"]
    return packed(out) if rank == 0 else None


def dense_adamw_reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """torch.optim.AdamW on the single-process dense model, loss = mean of the 4 ranks' losses."""
    ref = copy.deepcopy(build_model("tiny"))
    opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    losses, norms = [], []
    for step in range(STEPS):
        loss = torch.stack([ref(input_ids=b, labels=b).loss for b in global_batches(step)]).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach().clone() for n, p in ref.named_parameters()}


def assert_same_state(got: dict, want: dict, what: str) -> None:
    for n in want["params"]:
        assert torch.equal(got["params"][n], want["params"][n]), f"{what}: parameter {n} differs after load"
    for n in want["optim"]:
        for k in want["optim"][n]:
            assert torch.equal(got["optim"][n][k], want["optim"][n][k]), f"{what}: optimizer {n}.{k} differs after load"


@pytest.mark.slow
def test_adamw_parity_and_checkpoint_portability(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    a = unpacked(run_ranks(train_worker, WORLD, "ep_mp=2", ckpt, 0, 1, None)[0])  # ep_dp=2, ep_mp=2

    # 1. 20 steps vs torch AdamW on the dense model (clipping active: norms start above MAX_NORM).
    ref_losses, ref_norms, ref_params = dense_adamw_reference()
    assert max(ref_norms) > MAX_NORM
    for s in range(STEPS):
        assert abs(a["losses"][s] - ref_losses[s]) <= 1e-5 * abs(ref_losses[s]), (s, a["losses"][s], ref_losses[s])
        assert abs(a["norms"][s] - ref_norms[s]) <= 1e-5 * ref_norms[s], (s, a["norms"][s], ref_norms[s])
    errs = {n: norm_rel(a["final"][n], ref_params[n]) for n in ref_params}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, (worst, errs[worst], rel_err(a["final"][worst], ref_params[worst]))
    moved = min(norm_rel(ref_params[n], build_model("tiny").state_dict()[n]) for n in ref_params)
    assert moved > 1e-3  # every parameter was really trained
    assert a["state_fraction"] < 0.6, a["state_fraction"]  # ZeRO-1: a rank holds a fraction of the state

    # 2. A crash mid-save leaves the step-10 checkpoint as the latest, loadable below.
    assert "injected crash at manifest" in a["crash_save"], a["crash_save"]
    assert a["latest_after_crash"].endswith("step_00000010"), a["latest_after_crash"]

    # 3. Load under other topologies: complete state, then training continues as the uninterrupted run.
    for mesh, world, m in (("ep_mp=4", 4, 1), ("ep_mp=2", 2, 2)):
        r = unpacked(run_ranks(train_worker, world, mesh, ckpt, SAVE_AT, m, a["saved"])[0])
        assert r["was_different"], mesh
        assert r["loaded_step"] == (SAVE_AT, SAVE_AT * WORLD, SAVE_AT), (mesh, r["loaded_step"])
        assert_same_state(r["loaded"], a["saved"], mesh)
        for s in range(SAVE_AT, STEPS):
            assert abs(r["losses"][s] - a["losses"][s]) <= 1e-5 * a["losses"][s], (mesh, s, r["losses"][s], a["losses"][s])
            assert abs(r["norms"][s] - a["norms"][s]) <= 1e-4 * a["norms"][s], (mesh, s, r["norms"][s], a["norms"][s])
        errs = {n: norm_rel(r["final"][n], a["final"][n]) for n in a["final"]}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-5, (mesh, worst, errs[worst])


def load_then_step_worker(rank, world):
    """An OLMoDDPOptimizer built, then other weights loaded through cm.load_state_dict (the checkpoint
    views): the step starts from the loaded weights. Before, the optimizer's FP32 main weights still
    held the old ones and the step's copy-back wrote them over the load."""
    src = build_model("tiny", seed=5)  # the weights loaded
    ref = copy.deepcopy(src)
    cm = moe_compile(build_model("tiny", seed=0), MeshSpec.parse("ep_mp=2"))
    opt = OLMoDDPOptimizer(cm, **HYPER)
    cm.load_state_dict(moe_compile(src, MeshSpec.parse("ep_mp=2")).state_dict())
    train_step(cm, opt, [global_batches(0)[rank]])
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    losses = [ref(input_ids=x, labels=x).loss for x in global_batches(0)[:world]]
    (sum(losses) / world).backward()
    ref_opt.step()
    got = cm.full_state_dict()
    return max(norm_rel(got[n], p.detach()) for n, p in ref.named_parameters())


def test_load_state_dict_then_step_starts_from_the_loaded_weights():
    for err in run_ranks(load_then_step_worker, 2):
        assert err <= 1e-5, err
