"""Expert features beyond plain SwiGLU: expert biases, parametrised activations (clamped / softcapped
SwiGLU, ReLU²), and the canonical views of input-major, interleaved and flattened expert weights.

The grouped FFN (forward and its autograd backward) is compared with a hand-written per-expert torch
reference differentiated by autograd (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_compile.errors import UnsupportedFeatureError
from moe_compile.frontend.spec import ExpertsSpec, MoEBlockSpec, ParamView, RouterSpec
from moe_compile.frontend.structure import expert_codegen
from moe_compile.ops import experts  # noqa: F401  (registers torch.ops.moe)

L, D, H = 3, 8, 5
COUNTS = [4, 0, 3]  # one expert receives no rows
CAP = 9  # capacity rows (valid prefix 7)


def _reference_act(name: str, g, u):
    if name == "clamped":  # gpt-oss
        g, u = g.clamp(max=0.7), u.clamp(min=-0.7, max=0.7)
        return (u + 1) * (g * torch.sigmoid(g * 1.702))
    if name == "softcap":  # Inkling 2
        return torch.tanh(g / 0.5) * 0.5 * torch.sigmoid(g) * torch.tanh(u / 0.8) * 0.8
    raise AssertionError(name)


OP_ACT = {"clamped": "clamped_swiglu(alpha=1.702,limit=0.7,up_offset=1.0)",
          "softcap": "softcap_swiglu(gate_cap=0.5,up_cap=0.8)", "relu2": "relu2"}


def _leaves(gated: bool, bias: bool):
    g = torch.Generator().manual_seed(0)
    f = 2 * H if gated else H

    def t(*s):
        return torch.randn(*s, generator=g, dtype=torch.float32).requires_grad_()

    return t(CAP, D), t(L, f, D), t(L, D, H), (t(L, f), t(L, D)) if bias else ()


def _reference(x, w_in, w_out, biases, act: str, gated: bool):
    rows, start = [], 0
    for e, c in enumerate(COUNTS):
        xe = x[start:start + c]
        pre = xe @ w_in[e].T + (biases[0][e] if biases else 0)
        a = _reference_act(act, *pre.chunk(2, -1)) if gated else torch.square(F.relu(pre))
        rows.append(a @ w_out[e].T + (biases[1][e] if biases else 0))
        start += c
    return torch.cat(rows)


@pytest.mark.parametrize("act,gated,bias", [("clamped", True, True), ("softcap", True, False), ("relu2", False, True)])
def test_grouped_ffn_matches_per_expert_reference(act, gated, bias):
    x, w_in, w_out, biases = _leaves(gated, bias)
    counts = torch.tensor(COUNTS)
    out, _ = torch.ops.moe.grouped_ffn(x, counts, w_in, w_out, OP_ACT[act], gated, "blk", *biases)
    valid = sum(COUNTS)
    ref = _reference(x, w_in, w_out, biases, act, gated)
    torch.testing.assert_close(out[:valid], ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(valid, D, dtype=torch.float32)
    leaves = (x, w_in, w_out, *biases)
    got = torch.autograd.grad(out[:valid], leaves, grad)
    want = torch.autograd.grad(ref, leaves, grad)
    got, want = (got[0][:valid], *got[1:]), (want[0][:valid], *want[1:])  # rows past the prefix: unspecified
    for name, a, b in zip(("recv", "w_in", "w_out", "b_in", "b_out"), got, want, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{act} {n}: {m}")


def test_param_views_give_back_the_original_layouts():
    g = torch.Generator().manual_seed(1)
    orig = torch.randn(2, D, 2 * H, generator=g)  # gpt-oss: input-major, gate/up columns interleaved
    canon = torch.cat([orig[..., 0::2], orig[..., 1::2]], -1).transpose(1, 2)  # [N, 2h, d] = [gate; up]
    assert torch.equal(ParamView("a", "a", None, transpose=True, interleaved=True).original_of(canon), orig)
    bias = torch.randn(2, 2 * H, generator=g)
    canon_b = torch.cat([bias[:, 0::2], bias[:, 1::2]], -1)
    assert torch.equal(ParamView("b", "b", None, interleaved=True).original_of(canon_b), bias)
    down = torch.randn(2 * H, D, generator=g)  # DBRX: experts flattened into rows, down input-major
    canon_d = down.view(2, H, D).transpose(1, 2)
    assert torch.equal(ParamView("c", "c", None, transpose=True, flat=True).original_of(canon_d), down)
    # LongCat-Flash: gate_up_proj [N + Z, 2h, d] holds Z unused rows for its identity experts (zero grads)
    full = ParamView("e", "e", None, dead_experts=2).original_of(canon)
    assert full.shape == (4, 2 * H, D) and torch.equal(full[:2], canon) and not full[2:].any()


def _spec(bias: bool, activation: str = "silu", params=()) -> MoEBlockSpec:
    return MoEBlockSpec(path="model.layers.0.mlp", index=0, mode="components", router_attr="router",
                        experts_attr="experts", router=RouterSpec(8, 2, "softmax", True),
                        experts=ExpertsSpec(8, D, H, activation, True, "fused", params, bias))


def test_kernels_that_do_not_carry_a_feature_say_so():
    with pytest.raises(UnsupportedFeatureError, match=r"mxfp8='experts' with expert biases .*model\.layers\.0\.mlp\.experts"):
        expert_codegen([_spec(True)], "experts", "torch", "torch")
    clamped = _spec(False, "clamped_swiglu", (("alpha", 1.702), ("limit", 7.0), ("up_offset", 1.0)))
    with pytest.raises(UnsupportedFeatureError, match=r"codegen='triton' with the expert activation clamped_swiglu"):
        expert_codegen([clamped], None, "triton", "triton")
    assert expert_codegen([clamped], "experts", "triton", "auto") == "torch"  # auto falls back
    assert expert_codegen([_spec(False)], None, "triton", "auto") == "triton"


def test_identity_experts_refuse_a_capacity():
    """LongCat-Flash's zero-computation experts: their rows are dispatched with weight 0, so under a
    capacity they would take rows from the real experts; refused, naming the block."""
    from moe_compile import moe_compile
    from moe_compile.errors import UnsupportedFeatureError
    from moe_compile.models.hf import tiny_family_model

    with pytest.raises(UnsupportedFeatureError, match=r"model\.layers\.0\.mlp: identity / null experts.*capacity_factor=1.25"):
        moe_compile(tiny_family_model("longcat_flash"), capacity_factor=1.25)
