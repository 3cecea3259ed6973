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


def refused_batch_worker(rank, world):
    """ep_mp=2 without a pipeline: rank 1 alone passes a batch it refuses (a token id beyond the vocabulary,
    then 3 sequences for 2 microbatches); rank 0's batch is good. Both raise before the step runs (rank 0
    used to wait in the first dispatch until the collective timeout), and the next step on every rank
    equals the dense model's."""
    from moe_compile.errors import OptionError

    model = build_model("tiny")
    good, later = make_batches(world, 4, 16, seed=3), make_batches(world, 4, 16, seed=4)
    ref = copy.deepcopy(model)  # per microbatch, as train_step (the router's aux loss is each microbatch's)
    ref_losses = [sum(ref(input_ids=x, labels=x).loss for x in b.chunk(2)) / 2 for b in later]
    torch.stack(ref_losses).mean().backward()
    ref_grads = grads_of(ref)
    cm = moe_compile(model, MeshSpec.parse("ep_mp=2"), microbatches=2)
    cm.train_step(input_ids=good[rank], labels=good[rank])
    bad = good[rank].clone()
    bad[2, 5] = 10_000
    msgs = []
    for kw in (dict(input_ids=bad, labels=good[rank]), dict(input_ids=good[rank][:3], labels=good[rank][:3])):
        try:
            cm.train_step(**(kw if rank == 1 else dict(input_ids=good[rank], labels=good[rank])))
            msgs.append("no error")
        except OptionError as e:
            msgs.append(str(e))
    cm.ddp.zero_grad()
    for p in cm.model.parameters():
        p.grad = None
    loss = cm.train_step(input_ids=later[rank], labels=later[rank])
    grads = cm.full_grads()
    cm.close()
    return {"msgs": msgs, "loss_err": rel_err(loss.detach(), ref_losses[rank].detach()),
            "grad_err": max(rel_err(grads[n], ref_grads[n]) for n in ref_grads)}


def test_a_batch_refused_on_one_rank_is_refused_on_every_rank():
    for rank, r in enumerate(run_ranks(refused_batch_worker, 2, timeout=120)):
        ids, split = r["msgs"]
        if rank == 1:
            assert "input_ids hold token id 10000, outside the model's vocabulary [0, 256)" in ids, r
            assert "a batch of 3 sequences does not split into microbatches=2" in split, r
        else:
            assert "rank 1's input_ids fall outside the model's vocabulary [0, 256)" in ids, r
            assert "rank 1 refused its batch" in split, r
        assert all("no rank started the step" in m for m in r["msgs"]), r
        assert r["loss_err"] <= 1e-5 and r["grad_err"] <= 1e-5, (rank, r)


def test_train_step_refuses_bad_arguments_before_running():
    """At pp = 1: microbatches that is not an int >= 1 (-1 crashed in a reshape, 2.0 in a TypeError, 0 fell
    back to the compiled default), no labels (an AttributeError after a whole forward) and
    return_dict=False are OptionErrors naming the argument; the next good step matches the dense model."""
    from moe_compile.errors import OptionError

    model = build_model("tiny")
    ref = copy.deepcopy(model)
    batch = make_batches(1, 4, 16, seed=2)[0]
    cm = moe_compile(model, microbatches=2)
    cases = ((dict(microbatches=-1), "microbatches=-1"), (dict(microbatches=0), "microbatches=0"),
             (dict(microbatches=2.0), "microbatches=2.0"), (dict(microbatches=True), "microbatches=True"),
             (dict(labels=None), "needs labels"), (dict(return_dict=False), "return_dict=False"))
    for kw, match in cases:
        with pytest.raises(OptionError, match=match):
            cm.train_step(**{"input_ids": batch, "labels": batch, **kw})
    assert all(p.grad is None for p in cm.parameters())  # nothing ran
    loss = cm.train_step(input_ids=batch, labels=batch)
    want = sum(ref(input_ids=x, labels=x).loss for x in batch.chunk(2)) / 2
    assert rel_err(loss.detach(), want.detach()) <= 1e-5
    shifted = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], 1)  # transformers' own shift
    shifted[0, :9] = -100  # microbatches with different loss-token counts: weighted by them
    as_shift = cm.train_step(input_ids=batch, shift_labels=shifted)  # a loss without labels= is still a step
    masked = batch.clone()
    masked[0, 1:10] = -100
    # microbatches of 2 sequences: 6 + 15 and 15 + 15 loss tokens
    want = (ref(input_ids=batch[:2], labels=masked[:2]).loss * 21 + ref(input_ids=batch[2:], labels=batch[2:]).loss * 30) / 51
    assert rel_err(as_shift.detach(), want.detach()) <= 1e-5
    cm.close()
