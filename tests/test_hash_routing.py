"""DeepSeek-V4's routing: sqrt-softplus scores and hash routing by token id (its first layers pick each
token's experts from a [vocab, K] table, the scores still weight them), with its clamped SwiGLU experts.

The router op is checked against eager autograd of the formula written with torch ops; the family
against its dense model (loss and every gradient) on ep_mp=2, with a SwiGLU limit small enough that the
clamp acts on every row (the one-rank family sweep checks it at the config's own limit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_compile.ops  # noqa: F401  (registers torch.ops.moe)
from moe_compile import moe_compile
from moe_compile.errors import UnsupportedFeatureError
from moe_compile.models.hf import tiny_family_model

from .harness import run_ranks


def _reference_weights(logits, bias, k, scaling, idx=None):
    scores = F.softplus(logits).sqrt()
    if idx is None:
        idx = torch.topk(scores + bias, k, dim=-1).indices
    w = scores.gather(-1, idx)
    return w / w.sum(-1, keepdim=True) * scaling, idx


@pytest.mark.parametrize("hashed", [False, True])
def test_sqrt_softplus_router_matches_eager_autograd(hashed):
    g = torch.Generator().manual_seed(0)
    t, n, k = 24, 8, 3
    logits = (torch.randn(t, n, generator=g) * 3).requires_grad_(True)
    bias = torch.randn(n, generator=g)
    cot = torch.randn(t, k, generator=g)
    table_idx = torch.rand(t, n, generator=g).argsort(-1)[:, :k]  # K distinct experts per token
    ref_w, ref_idx = _reference_weights(logits, bias, k, 1.5, table_idx if hashed else None)
    (ref_w * cot).sum().backward()
    ref_grad, logits.grad = logits.grad.clone(), None

    w, idx = torch.ops.moe.router(logits, bias, k, "sqrtsoftplus", True, 1.5, True, "blk", 1, 1, "top2_sum",
                                  "scores", table_idx if hashed else None)
    (w * cot).sum().backward()
    assert torch.equal(idx, ref_idx)
    if hashed:  # the table's experts, not the scores' top-k (the bias would move those)
        assert not torch.equal(idx.sort(-1).values, torch.topk(F.softplus(logits).sqrt() + bias, k).indices.sort(-1).values)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(logits.grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_deepseek_v4_blocks_are_read_as_hash_and_score_routed():
    model = tiny_family_model("deepseek_v4")
    cm = moe_compile(model, "ep_mp=1")  # recognition and the probe only: nothing is compiled before a call
    try:
        hashed, scored = (cm.program.blocks[f"model.layers.{i}.mlp"] for i in (0, 1))
        assert hashed.router.hash_table_attr == "tid2eid" and scored.router.hash_table_attr is None
        for spec in (hashed, scored):
            assert spec.router.score_func == "sqrtsoftplus"
            assert spec.experts.activation == "clamped_swiglu"
            assert dict(spec.experts.act_params) == {"alpha": 1.0, "limit": model.config.swiglu_limit, "up_offset": 0.0}
    finally:
        cm.close()


@pytest.mark.parametrize("break_it", ["no_table", "out_of_range", "score_fn"])
def test_hash_and_score_routers_outside_the_rules_are_named(break_it):
    model = tiny_family_model("deepseek_v4")
    gate = model.model.layers[0].mlp.gate
    if break_it == "no_table":
        del gate._buffers["tid2eid"]
        match = r"model\.layers\.0\.mlp\.gate: the router's forward takes .*input_ids.* no integer \[vocab, K\]"
    elif break_it == "out_of_range":
        with torch.no_grad():
            gate.tid2eid[3, 1] = 8
        match = r"model\.layers\.0\.mlp\.gate\.tid2eid: hash-routing table holds expert indices 0\.\.8, outside the router's 8"
    else:
        gate.score_fn = nn.Tanh()
        match = r"model\.layers\.0\.mlp: router score function score_fn = Tanh computes none of the supported"
    with pytest.raises(UnsupportedFeatureError, match=match):
        moe_compile(model, "ep_mp=1")


def _ep2_clamped(rank: int, world: int):
    from moe_compile.families import check_family

    r = check_family("deepseek_v4", "ep_mp=2", rank, world, swiglu_limit=0.05)
    model = tiny_family_model("deepseek_v4")
    cm = moe_compile(model, "ep_mp=2")
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    try:
        cm(inputs_embeds=model.model.embed_tokens(x).detach(), labels=x)
        embeds = "ran"
    except UnsupportedFeatureError as e:
        embeds = str(e)
    finally:
        cm.close()
    return r.status, r.message, embeds


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_deepseek_v4_matches_the_dense_model_on_ep_mp_2_with_its_clamp_acting():
    """Limit 0.05: every expert's gate and up values are clamped, so plain SwiGLU would not match; the
    first layer routes by its token-id table. From inputs_embeds there are no ids to route by: an error."""
    for status, message, embeds in run_ranks(_ep2_clamped, 2, timeout=380):
        assert status == "compiled", message
        assert embeds.startswith("model.layers.0.mlp.gate: a hash router (routing by token id) was called "
                                 "without token ids"), embeds
