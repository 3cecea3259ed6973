"""moe_cp::sink_attention against transformers' own eager forms of attention with sinks (fp64): GPT-OSS's
(a sink column in the softmax), GraniteMoE-SWA's (a sigmoid(lse − sink) scale of the output) and MiMo-V2-
Flash's (value heads of another size) — forward and the gradients of query, key, value and sinks."""

from __future__ import annotations

import types

import pytest
import torch

import moe_compile.ops  # noqa: F401  (registers moe_cp::sink_attention)


def _inputs(dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, s, d = 2, 4, 2, 9, 8
    q, k = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for n in (h, hkv))
    v = torch.randn(b, hkv, s, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    keep = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone()
    keep[1, :, :, :3] = False  # left padding of the second sequence: its first queries see only the sink
    keep[0] &= torch.ones(s, s, dtype=torch.bool).triu(-3)  # a sliding window of 4 on the first
    return q, k, v, sinks, keep


def _eager(family: str):
    import importlib

    return importlib.import_module(f"transformers.models.{family}.modeling_{family}").eager_attention_forward


def _grads(out, inputs, seed: int = 1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("family,dv", [("gpt_oss", 8), ("granitemoe_swa", 8), ("mimo_v2_flash", 6)])
@pytest.mark.parametrize("mask", ["bool", "additive", "causal"])
def test_sink_attention_matches_the_eager_forms(family, dv, mask):
    q, k, v, sinks, keep = _inputs(dv)
    inputs = [t.requires_grad_() for t in (q, k, v, sinks)]
    # transformers' additive masks hold fp32's lowest value (GraniteMoE-SWA's fp32 softmax of fp64's is NaN)
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float32).min)
    if mask == "causal":  # no mask: SDPA's is_causal (transformers' causal mask without padding)
        keep = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
        additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=2, training=False)
    want = _eager(family)(module, q, k, v, additive, scaling=0.3)[0].transpose(1, 2)
    given = {"bool": keep, "additive": additive, "causal": None}[mask]
    got = torch.ops.moe_cp.sink_attention(q, k, v, sinks, given, mask == "causal", 0.3)
    assert got.shape == want.shape == (2, 4, 9, dv)
    # GraniteMoE-SWA's form takes its softmax and sink scale in fp32 whatever the input: fp32's tolerance
    tol = dict(rtol=1e-4, atol=1e-6) if family == "granitemoe_swa" else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, want, **tol)
    ours, theirs = _grads(got, inputs), _grads(want, inputs)
    for name, a, b in zip(("query", "key", "value", "sinks"), ours, theirs):
        torch.testing.assert_close(a, b, **tol, msg=name)
    assert ours[3].abs().min() > 1e-4  # every head's sink has a gradient: the case tests it


def test_sink_attention_fp32_and_its_fake_kernel():
    """fp32 within fp32 rounding of the fp64 result; torch.library's checks of schema, fake kernel and
    autograd registration."""
    q, k, v, sinks, keep = _inputs(6)
    want = torch.ops.moe_cp.sink_attention(q, k, v, sinks, keep, False, 0.3)
    got = torch.ops.moe_cp.sink_attention(q.float(), k.float(), v.float(), sinks.float(), keep, False, 0.3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    args = tuple(t.float().requires_grad_() for t in (q, k, v, sinks)) + (keep, False, 0.3)
    torch.library.opcheck(torch.ops.moe_cp.sink_attention.default, args)
