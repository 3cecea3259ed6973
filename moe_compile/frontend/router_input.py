"""Router variants read from the router module's own parameters, as data for the router spec.

Gemma 4's router normalises and scales its input before the projection, and scales each chosen
expert's weight by a learned per-expert factor; its top-k is read from its config:

    logits    = (norm(x) ⊙ scale · c) Wᵀ                 norm: the router's child; scale [d]; c constant
    weights_k = router(logits)_k · expert_scale[idx_k]     expert_scale [N]

Both stay ordinary dense ops around ``moe::router`` (their gradients are autograd's).
"""

from __future__ import annotations

import torch
import torch.nn as nn

INPUT_NORM_NAMES = ("norm",)  # a child module the router applies to its input
INPUT_SCALE_NAMES = ("scale",)  # a [d] parameter multiplying the normalised input
INPUT_CONST_ATTRS = ("scalar_root_size",)  # a constant multiplying it (Gemma 4: d^-1/2)
EXPERT_SCALE_NAMES = ("per_expert_scale",)  # an [N] parameter multiplying each chosen expert's weight
CONFIG_TOPK_FIELDS = ("num_experts_per_tok", "top_k_experts", "moe_topk", "moe_top_k")


def router_extras(router: nn.Module, n: int, d: int) -> dict:
    """RouterSpec fields for the input norm/scale and per-expert scale the router module holds (none: {})."""
    out: dict = {}
    norm = next((a for a in INPUT_NORM_NAMES if isinstance(getattr(router, a, None), nn.Module)), None)
    scale = next((a for a in INPUT_SCALE_NAMES if _vector(router, a, d)), None)
    if norm or scale:
        const = next((getattr(router, a) for a in INPUT_CONST_ATTRS if isinstance(getattr(router, a, None), float)), 1.0)
        out.update(input_norm_attr=norm, input_scale_attr=scale, input_scaling=const)
    expert_scale = next((a for a in EXPERT_SCALE_NAMES if _vector(router, a, n)), None)
    if expert_scale:
        out["expert_scale_attr"] = expert_scale
    return out


def config_top_k(*mods: nn.Module) -> int | None:
    """top-k from a module's config (Gemma 4's router reads ``config.top_k_experts``), None if absent."""
    for m in mods:
        cfg = getattr(m, "config", None)
        for f in CONFIG_TOPK_FIELDS:
            k = getattr(cfg, f, None) if cfg is not None else None
            if isinstance(k, int):
                return k
    return None


def _vector(router: nn.Module, name: str, size: int) -> bool:
    t = getattr(router, name, None)
    return isinstance(t, torch.Tensor) and tuple(t.shape) == (size,)


def router_input(router: nn.Module, spec, x2: torch.Tensor) -> torch.Tensor:
    """The router's projection input: x2, or its normalised and scaled form (spec: RouterSpec)."""
    if spec.input_norm_attr:
        x2 = getattr(router, spec.input_norm_attr)(x2)
    if spec.input_scale_attr:
        x2 = x2 * getattr(router, spec.input_scale_attr)
    if spec.input_scaling != 1.0:
        x2 = x2 * spec.input_scaling
    return x2


def expert_scaled(router: nn.Module, spec, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The route weights times the chosen experts' learned scales (if the router holds them)."""
    if not spec.expert_scale_attr:
        return weights
    return weights * getattr(router, spec.expert_scale_attr)[idx]


def custom_backward(router: nn.Module, d: int) -> str | None:
    """The name of a custom autograd Function the router's weights are computed through (PhiMoE's
    sparsemixer: ``PhimoeMultiplier``, a gradient estimator with a backward of its own), None if there is
    none. Runs the router once on random tokens, with grad, leaving the RNG state as it was."""
    p = next(router.parameters(), None)
    if p is None:
        return None
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        try:
            out = router(torch.randn(4, d, dtype=p.dtype, device=p.device))
        except Exception:  # noqa: BLE001 - a router this cannot call: no verdict
            return None
    stack = [t.grad_fn for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return type(node).__name__.removesuffix("Backward")
        stack.extend(n for n, _ in node.next_functions)
    return None


# -- a router that also scores the shared experts (Inkling) ---------------------------------------
#
#   logits [T, N + S] = x Wᵀ                              the last S rows score the S shared experts
#   idx               = topk(σ(logits[:, :N]) + bias, K)  (moe::router, selection among the routed only)
#   p                 = σ(logits[:, :N])[idx] ‖ σ(logits[:, N:])
#   p                 = p / Σ p                            (renormalised over the K chosen and the S shared)
#   weights ‖ gammas  = p · scaling · global_scale         gammas weight the shared experts (dense ops)

SHARED_COUNT_ATTRS = ("n_shared_experts", "num_shared_experts")
WEIGHT_SCALE_NAMES = ("global_scale",)  # a [1] parameter of the router multiplying every route weight


def _held_experts(ex: nn.Module) -> int | None:
    """How many routed experts the experts module holds (fused or stacked leading dim, list length)."""
    if isinstance(ex, nn.ModuleList):
        return len(ex)
    for name in ("gate_up_proj", "up_proj", "w1", "gate_proj"):
        t = getattr(ex, name, None)
        if isinstance(t, torch.Tensor) and t.dim() == 3:
            return t.shape[0]
    return None


def shared_scored(block: nn.Module, router: nn.Module, ex: nn.Module, shared: nn.Module | None, rows: int) -> dict:
    """RouterSpec fields of a router whose weight also scores the shared experts ({} for any other):
    its [N + S, d] weight has S = n_shared_experts rows more than the N experts held, and the block has
    a shared-experts module."""
    held = _held_experts(ex)
    if shared is None or held is None or held >= rows:
        return {}
    s = next((getattr(m, a) for m in (router, block) for a in SHARED_COUNT_ATTRS
              if isinstance(getattr(m, a, None), int)), None)
    if s != rows - held:
        return {}
    out: dict = {"shared_scored": s}
    scale = next((a for a in WEIGHT_SCALE_NAMES if _vector(router, a, 1)), None)
    if scale:
        out["weight_scale_attr"] = scale
    return out


def shared_scored_weights(router: nn.Module, spec, shared_logits: torch.Tensor, w: torch.Tensor):
    """(weights [T, K], gammas [T, S]) from the chosen experts' raw fp32 scores ``w`` (moe::router, not
    renormalised nor scaled) and the shared experts' logits, as dense ops (spec: RouterSpec)."""
    g = torch.sigmoid(shared_logits.float())
    if spec.renormalize:
        total = w.sum(dim=-1, keepdim=True) + g.sum(dim=-1, keepdim=True)
        w, g = w / total, g / total
    if spec.scaling != 1.0:
        w, g = w * spec.scaling, g * spec.scaling
    if spec.weight_scale_attr:
        scale = getattr(router, spec.weight_scale_attr).float()
        w, g = w * scale, g * scale
    dt = torch.float32 if spec.fp32_weights else shared_logits.dtype
    return w.to(dt), g.to(dt)
