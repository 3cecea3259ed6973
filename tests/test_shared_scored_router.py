"""A router that also scores the shared experts (Inkling): its [N + S, d] weight's last S rows score the
S shared experts; selection is among the N routed ones, the weights are renormalised over the K chosen
and the S shared scores, scaled by route_scale and a learned global_scale, and the shared scores weight
the shared experts. The canonical block (eager, no compile) reproduces the block's output and every
gradient (fp32, 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_compile.frontend.canonical import install
from moe_compile.frontend.probe import settle
from moe_compile.frontend.recognize import read_block


@pytest.fixture(scope="module")
def inkling_block():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "InklingTextConfig"):
        pytest.skip("this transformers has no Inkling")
    from moe_compile.models.hf import tiny_family_model

    torch.manual_seed(0)
    block = tiny_family_model("inkling_text").model.layers[0].mlp
    with torch.no_grad():  # values the defaults would hide: bias on the selection, a global scale ≠ 1
        block.gate.weight.normal_(0, 0.3)
        block.gate.e_score_correction_bias.normal_(0, 0.5)
        block.gate.global_scale.fill_(1.3)
    return block


def test_router_spec_reads_the_shared_scores(inkling_block):
    c = read_block("mlp", inkling_block, "experts")
    spec = settle(c)
    s = inkling_block.gate.n_shared_experts
    assert spec.mode == "block" and spec.checked
    assert spec.router.num_experts == inkling_block.gate.weight.shape[0] - s == spec.experts.num_experts
    assert spec.router.shared_scored == s and spec.router.weight_scale_attr == "global_scale"
    assert spec.router.score_func == "sigmoid" and spec.router.renormalize
    assert f"scores {s} shared experts" in spec.describe()


def test_canonical_block_matches_output_and_gradients(inkling_block):
    ref = copy.deepcopy(inkling_block)
    block = copy.deepcopy(inkling_block)
    c = read_block("mlp", block, "experts")
    spec = settle(c)
    install(block, spec, *c.full_weights(), 0)
    g = torch.Generator().manual_seed(3)
    d = spec.experts.d_model
    x = torch.randn(2, 12, d, generator=g)
    probe = torch.randn(2, 12, d, generator=g)
    outs = []
    for m in (ref, block):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * probe).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = outs

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    assert rel(y1, y0) < 1e-5 and rel(gx1, gx0) < 1e-5
    assert set(g0) == set(g1)
    for n in g0:
        assert g1[n] is not None, n
        assert rel(g1[n], g0[n]) < 1e-5, (n, rel(g1[n], g0[n]))
