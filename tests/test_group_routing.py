"""Group-limited routing (DeepSeek-V3 / GLM-4-MoE noaux_tc, DeepSeek-V2 group_limited_greedy):
recognised from the router's own attributes, settled by the probe, exact against the dense model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moe_compile import MeshSpec, moe_compile
from moe_compile.errors import UnsupportedFeatureError
from moe_compile.ops.routing import group_mask

from .common import grads_of, make_batches, rel_err
from .harness import run_ranks


def test_group_mask_hand_computed():
    # one token, 6 experts in 3 groups of 2: group top-2 sums 0.9+0.1=1.0, 0.5+0.4=0.9, 0.8+0.3=1.1
    # → the best 2 groups are 2 and 0; group max scores 0.9, 0.5, 0.8 → again groups 0 and 2
    sel = torch.tensor([[0.9, 0.1, 0.5, 0.4, 0.8, 0.3]])
    inf = float("-inf")
    want = torch.tensor([[0.9, 0.1, inf, inf, 0.8, 0.3]])
    assert torch.equal(group_mask(sel, 3, 2, "top2_sum"), want)
    assert torch.equal(group_mask(sel, 3, 2, "max"), want)
    # where the two scores disagree: top-2 sums 0.6+0.59=1.19 vs 0.61+0.0=0.61; max prefers group 1
    sel = torch.tensor([[0.6, 0.59, 0.61, 0.0]])
    assert torch.equal(group_mask(sel, 2, 1, "top2_sum"), torch.tensor([[0.6, 0.59, inf, inf]]))
    assert torch.equal(group_mask(sel, 2, 1, "max"), torch.tensor([[inf, inf, 0.61, 0.0]]))


def deepseek(version: int, seed: int = 0, **kw):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=0, kv_lora_rank=16,
                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                  max_position_embeddings=64, routed_scaling_factor=2.5)
    common.update(kw)
    if version == 3:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(n_routed_experts=8, **common))
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(n_routed_experts=8, topk_method="group_limited_greedy",
                                                       **common))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # spread the routers so that group limits change which experts win
        for mod in model.modules():
            if type(mod).__name__.endswith("TopkRouter"):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * 0.5)
                if hasattr(mod, "e_score_correction_bias"):
                    mod.e_score_correction_bias.copy_(torch.randn(mod.e_score_correction_bias.shape, generator=g) * 0.1)
    return model.float()


def _ungrouped_differs(model, batch) -> bool:
    """The group limit matters for this batch: routing without it picks other experts somewhere."""
    picked = {}
    for groups in (True, False):
        m = copy.deepcopy(model)
        for mod in m.modules():
            if type(mod).__name__.endswith("TopkRouter"):
                if not groups:
                    mod.num_group, mod.topk_group = 1, 1
                mod.register_forward_hook(lambda _m, _i, out, g=groups: picked.setdefault(g, []).append(out[2]))
        with torch.no_grad():
            m(input_ids=batch)
    return any(not torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(picked[True], picked[False]))


# V2 with topk_group=1: with max-scored groups, top-k within the best k groups equals plain top-k
@pytest.mark.parametrize("version, score, topk_group", [(3, "top2_sum", 2), (2, "max", 1)])
def test_group_limited_routing_one_rank_parity(version, score, topk_group):
    model = deepseek(version, topk_group=topk_group)
    batch = make_batches(1, batch=2, seq=16, seed=3)[0]
    assert _ungrouped_differs(model, batch)
    ref = copy.deepcopy(model)
    ref_loss = ref(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    cm = moe_compile(model)
    r = next(iter(cm.blocks.values())).router
    assert (r.n_group, r.topk_group, r.group_score) == (4, topk_group, score)
    loss = cm(input_ids=batch, labels=batch).loss
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    got, want = cm.full_grads(), grads_of(ref)
    assert max(rel_err(got[n], want[n]) for n in want) <= 1e-5


def grouped_ep_worker(rank, world):
    model = deepseek(3)
    batches = make_batches(world, batch=2, seq=16, seed=4)
    ref = copy.deepcopy(model)
    losses = [ref(input_ids=b, labels=b).loss for b in batches]
    torch.stack(losses).mean().backward()
    cm = moe_compile(model, MeshSpec(ep_mp=world))
    loss = cm(input_ids=batches[rank], labels=batches[rank]).loss
    loss.backward()
    got, want = cm.full_grads(), grads_of(ref)
    out = {"loss_err": abs(loss.item() - losses[rank].item()) / abs(losses[rank].item()),
           "grad_err": max(rel_err(got[n], want[n]) for n in want)}
    dist.barrier()
    return out


@pytest.mark.slow
def test_group_limited_routing_ep2_parity():
    for r in run_ranks(grouped_ep_worker, 2):
        assert r["loss_err"] <= 1e-5 and r["grad_err"] <= 1e-5, r


def test_bad_group_settings_are_clear_errors():
    model = deepseek(3)
    router = model.model.layers[0].mlp.gate
    router.topk_group = 5
    with pytest.raises(UnsupportedFeatureError, match=r"model\.layers\.0\.mlp: group-limited routing with num_group=4 "
                                                      r"needs topk_group in 1\.\.4"):
        moe_compile(model)


def test_probe_rejects_a_misread_group_rule(monkeypatch):
    import importlib

    from moe_compile.errors import RecognitionError

    recognize = importlib.import_module("moe_compile.frontend.recognize")
    monkeypatch.setattr(recognize, "group_routing", lambda *a: (4, 2, "max"))  # V3 scores groups by top-2 sums
    with pytest.raises(RecognitionError, match=r"model\.layers\.0\.mlp"):
        moe_compile(deepseek(3))


def test_published_deepseek_v3_plan_uses_its_group_limited_routing():
    from moe_compile.explain import meta_model
    from moe_compile.frontend import recognize

    model, _ = meta_model(hf="deepseek-v3")
    specs = [s for s, _ in recognize(model)]
    assert len(specs) == 58  # 61 layers, the first 3 dense
    assert {(s.router.n_group, s.router.topk_group, s.router.group_score) for s in specs} == {(8, 4, "top2_sum")}
