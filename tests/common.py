"""Shared test helpers: models, batches, comparisons, and independent references."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn as nn

from moe_compile.models import TinyMoEConfig, TinyMoELM, tiny_hf_model

VOCAB = 256


def core_and_rest(core, rest) -> list:
    """Two pytest params of one test's cases: ``core`` runs in the README's test command (CI), ``rest`` is
    marked slow and runs in the full suite (``pytest tests``) only. The core cases keep every feature the test
    names in CI; the rest repeat it on more families or combinations, which is most of a multi-rank test's time."""
    return [pytest.param(core, id="core"), pytest.param(rest, id="rest", marks=pytest.mark.slow)]


def build_model(name: str, seed: int = 0, **kw) -> nn.Module:
    """Deterministic fp32 model by name: tiny[_stacked|_sigmoid|_gelu|_shared] or an HF family."""
    torch.manual_seed(seed)
    if name.startswith("tiny"):
        cfg = dict(vocab_size=VOCAB)
        if "stacked" in name:
            cfg.update(expert_layout="stacked")
        if "sigmoid" in name:
            cfg.update(score_func="sigmoid", expert_bias=True)
        if "gelu" in name:
            cfg.update(activation="gelu", norm_topk_prob=False)
        if "shared" in name:
            cfg.update(shared_expert_hidden=32, shared_expert_gate=True)
        cfg.update(kw)
        m = TinyMoELM(TinyMoEConfig(**cfg))
        g = torch.Generator().manual_seed(seed + 1)
        for mod in m.modules():
            if getattr(mod, "expert_bias", None) is not None:
                mod.expert_bias.copy_(torch.randn(mod.expert_bias.shape, generator=g) * 0.05)
        return m
    if name == "llama4_tuned":  # Llama 4, NoPE layers with attention temperature tuning from position 3 on
        from moe_compile.models.hf import tiny_family_model

        return tiny_family_model("llama4_text", seed=seed, attention_chunk_size=None, no_rope_layers=[0, 0],
                                 layer_types=["full_attention", "full_attention"], floor_scale=4, **kw)
    if name.endswith("_eager"):  # transformers' per-expert loop instead of its default grouped_mm path
        model = build_model(name[: -len("_eager")], seed, **kw)
        model.config._experts_implementation = "eager"
        return model
    if name.endswith("_aux"):  # transformers' own load-balancing loss from recorded router logits
        kw.update(output_router_logits=True, router_aux_loss_coef=0.05)
        name = name[: -len("_aux")]
    return tiny_hf_model(name, seed=seed, vocab=VOCAB, **kw)


def make_batches(world: int, batch: int = 2, seq: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(3, VOCAB, (batch, seq), generator=g) for _ in range(world)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| relative to max |b| (the tensor's own scale)."""
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def routers(model: nn.Module) -> list[nn.Module]:
    from moe_compile.frontend.recognize import find_candidates

    return [getattr(c.block, c.router_attr) for c in find_candidates(model)]


SKEW_COMPONENT = 0.1  # hidden dim 0 of every token embedding (the other entries: init std 0.02)
SKEW_PENALTY = 5.0  # router weight on that dim of every expert outside [0, num_first)


def skew_to_first_experts(model: nn.Module, num_first: int) -> None:
    """Make every token route to experts [0, num_first), keeping the problem well conditioned.

    Every token embedding gets the same moderate component on hidden dim 0 (SKEW_COMPONENT, a few times
    the other entries; after the RMS norm, dim 0 is ≈ 4 against ≈ 1 elsewhere), and the routers
    *penalise* the other experts on it (−SKEW_PENALTY) while giving experts [0, num_first) weight 0
    there. So the experts that win keep the model's own logits: their scores and score gaps stay at the
    model's scale, far from fp32 rounding, and the choice among them is not a near-tie.

    (The former construction — +20 on dim 0, router weight +5 for the winners — put every winning logit
    at ≈ 40 ± 10⁻³, where fp32's spacing is 3.8·10⁻⁶: exact top-k ties, and gradients made of cancelling
    terms, e.g. a layer-1 RMSNorm weight gradient of size 2·10⁻⁸ whose fp32 value differs from fp64 by
    1.6·10⁻³ relative. Whether a run passed the 10⁻⁵ parity tolerance then depended on which CPU
    kernels (AVX-512 or AVX2) summed the reference; tests/test_drop_rule.py checks the conditioning.)"""
    with torch.no_grad():
        emb = next(m for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings >= VOCAB)
        emb.weight[:, 0] = SKEW_COMPONENT
        for r in routers(model):
            r.weight[:num_first, 0] = 0.0
            r.weight[num_first:, 0] = -SKEW_PENALTY


def dense_reference(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-batch losses and the gradient of their mean, on a plain copy of the dense model."""
    ref = copy.deepcopy(model)
    losses = [ref(input_ids=b, labels=b).loss for b in batches]
    torch.stack(losses).mean().backward()
    return [x.item() for x in losses], grads_of(ref)


def assert_step_matches_dense(cm: nn.Module, dense: nn.Module, ids: torch.Tensor, tol: float = 1e-5) -> None:
    """One forward and backward of the compiled model and of its dense copy on ``ids``: loss and every
    gradient within ``tol`` (relative to the largest element)."""
    loss = cm(input_ids=ids, labels=ids).loss
    loss.backward()
    want = dense(input_ids=ids, labels=ids).loss
    want.backward()
    assert rel_err(loss.detach(), want.detach()) <= tol, (loss.item(), want.item())
    got, ref = cm.full_grads(), grads_of(dense)
    assert set(got) == set(ref)
    worst = max(ref, key=lambda k: rel_err(got[k], ref[k]))
    assert rel_err(got[worst], ref[worst]) <= tol, (worst, rel_err(got[worst], ref[worst]))


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by name; a parameter no token reached (an idle expert) has a zero gradient."""
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


# -- capacity: an independent, loop-form implementation of the drop rule ------------------------


def reference_keep(idx: torch.Tensor, world: int, ep_mp: int, num_experts: int, capacity: int) -> torch.Tensor:
    """keep[t, k] for routes idx [world·T, K] (rank-major tokens): destination rank r of each EP group
    takes its requested rows in (source rank, local expert, token, k) order, up to ``capacity``."""
    rows, k = idx.shape
    t = rows // world
    nl = num_experts // ep_mp
    keep = torch.ones_like(idx, dtype=torch.bool)
    for group in range(world // ep_mp):
        ranks = range(group * ep_mp, (group + 1) * ep_mp)
        for dst in range(ep_mp):
            used = 0
            for src in ranks:
                for e in range(nl):
                    for tok in range(src * t, (src + 1) * t):
                        for kk in range(k):
                            if int(idx[tok, kk]) == dst * nl + e:
                                if used < capacity:
                                    used += 1
                                else:
                                    keep[tok, kk] = False
    return keep


def apply_reference_drops(model: nn.Module, world: int, ep_mp: int, capacity_factor: float) -> None:
    """Patch the dense model so each MoE block drops what the compiled run drops. The model must be
    run on all ranks' batches at once (torch.cat along the batch dim, rank-major)."""
    import math
    from decimal import Decimal

    from moe_compile.frontend.recognize import find_candidates

    for c in find_candidates(model):
        block, experts, n = c.block, getattr(c.block, c.experts_attr), c.experts.num_experts

        def cap_for(idx):  # ⌈cf·T·K⌉ of the decimal cf as written (1.1·90 = 99), in decimal arithmetic
            return math.ceil(Decimal(repr(capacity_factor)) * (idx.shape[0] // world) * idx.shape[1])

        if c.router_kind == "hf":  # transformers block: experts(hidden, top_k_index, top_k_weights)
            orig = experts.forward

            def fwd(hidden, top_k_index, top_k_weights, _orig=orig, _n=n):
                keep = reference_keep(top_k_index, world, ep_mp, _n, cap_for(top_k_index))
                return _orig(hidden, top_k_index, top_k_weights * keep.to(top_k_weights.dtype))

            experts.forward = fwd
        else:  # the tiny reference block's expert loop
            orig_mix = block.expert_mix

            def mix(self, x, idx, weights, _orig=orig_mix, _n=n):
                keep = reference_keep(idx, world, ep_mp, _n, cap_for(idx))
                return _orig(x, idx, weights * keep.to(weights.dtype))

            block.expert_mix = types.MethodType(mix, block)


def cli_train(tmp, ranks: int, mesh: str, steps: int, metrics: str, *extra: str) -> str:
    """``moe-compile train`` in a subprocess (16-token sequences, per-step metrics to tmp/metrics); its stdout."""
    import subprocess
    import sys
    from pathlib import Path

    cmd = [sys.executable, "-m", "moe_compile.cli", "train", "--ranks", str(ranks), "--mesh", mesh, "--steps",
           str(steps), "--seq-len", "16", "--no-progress", "--metrics-jsonl", str(tmp / metrics), *extra]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def metric_rows(path) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of every row of a --metrics-jsonl file."""
    import json

    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines())]
