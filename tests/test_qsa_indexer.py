"""Qwen4-Exp's QSA token indexer in its static form (models/hf_qsa.py) against the indexer's own per-query
loop, and the family against its dense model on two expert-parallel ranks (the one-rank family sweep
checks it on one)."""

from __future__ import annotations

import pytest
import torch

from moe_compile import moe_compile
from moe_compile.errors import UnsupportedFeatureError
from moe_compile.families import sweep_worker
from moe_compile.models.hf import tiny_family_model
from moe_compile.models.hf_qsa import _select, _tied_at_cut, qsa_indexers

from .harness import run_ranks


def _masks(kind: str, b: int, s: int, g: torch.Generator) -> torch.Tensor:
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    if kind == "left_padded":
        m = causal.expand(b, 1, s, s).clone()
        m[1:, :, :, : s // 3] = False
        return m
    if kind == "sliding":
        return (causal & ~torch.ones(s, s, dtype=torch.bool).tril(-9)).expand(b, 1, s, s)
    if kind == "documents":
        doc = torch.randint(0, 3, (s,), generator=g).sort().values
        return ((doc[:, None] == doc[None, :]) & causal).expand(b, 1, s, s)
    return torch.rand(b, 1, s, s, generator=g) < 0.6  # any visibility at all


@pytest.mark.parametrize("kind", ["left_padded", "sliding", "documents", "random"])
def test_static_qsa_selects_the_keys_of_the_indexers_own_loop(kind):
    """Bool and float (0 / min) masks, lengths from under one block to several: the same selection mask,
    except at a query whose k-th and (k+1)-th best blocks tie (the loop's top-k breaks those ties by its
    selection algorithm, the static form toward the lower block)."""
    _, ix = qsa_indexers(tiny_family_model("qwen4_exp_text"))[0]
    g = torch.Generator().manual_seed(0)
    compared = 0
    for s in (3, 17, 40, 61):
        x = torch.randn(3, s, ix.index_qk_proj.in_features, generator=g)
        ang = torch.randn(3, s, ix.index_head_dim // 2, generator=g)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        mask = _masks(kind, 3, s, g)
        for m in (mask, torch.where(mask, 0.0, torch.finfo(torch.float32).min)):
            with torch.no_grad():
                want = type(ix).forward(ix, x, (cos, sin), m, None)
                got, scores = _select(ix, x, (cos, sin), m, None)
            tied = _tied_at_cut(scores, ix.block_topk)[:, None, :, None]
            assert got.shape == want.shape and got.dtype == torch.bool
            assert torch.equal(got & ~tied, want & ~tied), (kind, s)
            compared += int((~tied).sum())
    assert compared > 0.9 * 2 * 3 * (3 + 17 + 40 + 61)


def test_qsa_indexers_outside_the_static_form_are_named():
    model = tiny_family_model("qwen4_exp_text")
    path, ix = qsa_indexers(model)[0]

    class AllVisible(type(ix)):  # the same attributes, another selection: the install-time check refuses it
        def forward(self, hidden_states, position_embeddings, attention_mask, cache=None):
            return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0

    ix.__class__ = AllVisible
    with pytest.raises(UnsupportedFeatureError, match=rf"{path}: the static form of its QSA indexer selects other keys"):
        moe_compile(model, "ep_mp=1")
    ix.__class__, ix.index_kv_heads = AllVisible.__bases__[0], 2
    with pytest.raises(UnsupportedFeatureError, match=rf"{path}: QSA indexer with 2 key heads"):
        moe_compile(model, "ep_mp=1")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_qwen4_exp_matches_the_dense_model_on_ep_mp_2():
    for per_rank in run_ranks(sweep_worker, 2, ["qwen4_exp_text"], "ep_mp=2", timeout=380):
        (r,) = per_rank
        assert r.status == "compiled", f"{r.status}: {r.message}"
