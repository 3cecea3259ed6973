"""CompiledMoE's training surface: no_sync gradient accumulation and checkpoint-view DTensors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from moe_compile import MeshSpec, moe_compile

from .common import build_model, grads_of, make_batches, rel_err
from .harness import run_ranks


def accumulation_worker(rank, world, ckpt_dir):
    model = build_model("tiny")
    a, b = make_batches(world, seed=1), make_batches(world, seed=2)
    ref = copy.deepcopy(model)
    (torch.stack([ref(x, labels=x).loss for x in a]).mean()
     + torch.stack([ref(x, labels=x).loss for x in b]).mean()).backward()
    ref_grads = grads_of(ref)

    cm = moe_compile(model, MeshSpec.parse("ep_mp=2"))
    with cm.no_sync():
        cm(a[rank], labels=a[rank]).loss.backward()
    local_after_first = {n: p.grad.clone() for n, p in cm.model.named_parameters()}
    cm(b[rank], labels=b[rank]).loss.backward()
    grads = cm.full_grads()
    out = {"grad_err": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads)}
    # inside no_sync nothing was reduced: the dense grads differ between ranks
    emb = [torch.empty_like(local_after_first["embed.weight"]) for _ in range(world)]
    torch.distributed.all_gather(emb, local_after_first["embed.weight"])
    out["no_sync_differs"] = any(not torch.equal(emb[0], e) for e in emb[1:])

    sd = cm.state_dict()
    ex = sd["layers.0.mlp.experts.gate_up_proj"]
    out["dtensor"] = isinstance(ex, DTensor) and isinstance(sd["embed.weight"], DTensor)
    out["expert_global_shape"] = tuple(ex.shape)
    out["expert_local_shape"] = tuple(ex.to_local().shape)
    dcp.save(sd, checkpoint_id=ckpt_dir)
    cm2 = moe_compile(build_model("tiny", seed=5), MeshSpec.parse("ep_mp=2"))
    before = cm2.full_state_dict()
    sd2 = cm2.state_dict()
    dcp.load(sd2, checkpoint_id=ckpt_dir)
    cm2.load_state_dict(sd2)
    full, full2 = cm.full_state_dict(), cm2.full_state_dict()
    out["restored"] = all(torch.equal(full[n], full2[n]) for n in full)
    out["was_different"] = any(not torch.equal(full[n], before[n]) for n in full)
    return out


@pytest.mark.slow
def test_no_sync_accumulation_and_checkpoint_views(tmp_path):
    for r in run_ranks(accumulation_worker, 4, str(tmp_path / "ckpt")):
        assert r["grad_err"] <= 1e-5, r
        assert r["no_sync_differs"], r
        assert r["dtensor"], r
        assert r["expert_global_shape"] == (8, 128, 64) and r["expert_local_shape"] == (4, 128, 64), r
        assert r["restored"] and r["was_different"], r
