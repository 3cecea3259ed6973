"""Canonical MoE forwards, installed on the user's modules (checked against them by :mod:`.probe`).

Capture form of one MoE block (what the FX graph will hold)::

    logits          = x @ W_routerᵀ                         (ordinary dense op)
    weights, idx    = moe::router(logits, bias, K, …)       (one node, role router)
    y               = moe::routed_experts(x, idx, weights, W_in, W_out, …)   (one node)
    y               = y + [sigmoid(x W_g)] · shared(x)      (ordinary dense ops)

Two ways to install it: "components" keeps the block's own forward (transformers 5.x blocks call
``gate(x)`` → ``(logits, weights, idx)`` then ``experts(x, idx, weights)``) and replaces the router's
and experts' forwards; "block" replaces the block's forward (user MoEs whose forward loops over
experts). Installation is per instance (``module.forward``), so the modules keep their classes and
hooks, and parameter names stay those of the original model except for re-stacked experts.

"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops  # noqa: F401  (registers torch.ops.moe)
from ..errors import RecognitionError, UnsupportedFeatureError
from ..models.aux_losses import router_aux_loss
from .router_input import expert_scaled, router_input, shared_scored_weights
from .spec import MoEBlockSpec


class ExpertWeights(nn.Module):
    """Canonical routed-expert weights of one block: w_in [L, F, d] (gate_up_proj or up_proj) and
    w_out [L, d, h] (down_proj), L = num_local_experts."""

    def __init__(self, w_in: torch.Tensor, w_out: torch.Tensor, gated: bool, requires_grad: bool = True) -> None:
        super().__init__()
        setattr(self, "gate_up_proj" if gated else "up_proj", nn.Parameter(w_in, requires_grad=requires_grad))
        self.down_proj = nn.Parameter(w_out, requires_grad=requires_grad)


def _frozen_flag(experts: nn.Module, where: str) -> bool:
    """requires_grad of the weights being stacked: one flag, since a stacked tensor has one."""
    flags = {p.requires_grad for p in experts.parameters()}
    if len(flags) > 1:
        raise UnsupportedFeatureError(f"{where}: some routed-expert weights are frozen (requires_grad=False) and "
                                      "others are not; stacking them into one tensor needs one setting")
    return flags.pop() if flags else True


def expert_tensors(experts: nn.Module, spec: MoEBlockSpec) -> tuple[torch.Tensor, torch.Tensor]:
    return getattr(experts, "gate_up_proj" if spec.experts.gated else "up_proj"), experts.down_proj


def expert_biases(experts: nn.Module, spec: MoEBlockSpec) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
    """(b_in, b_out) of experts with biases, () without."""
    if not spec.experts.bias:
        return ()
    return getattr(experts, f"{'gate_up_proj' if spec.experts.gated else 'up_proj'}_bias"), experts.down_proj_bias


def _bias(owner: nn.Module, attr: str | None) -> torch.Tensor | None:
    if attr is None:
        return None
    obj = owner
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def route(router: nn.Module, spec: MoEBlockSpec, x2: torch.Tensor, bias: torch.Tensor | None,
          logits: torch.Tensor | None = None, hash_idx: torch.Tensor | None = None):
    """(logits, weights, idx) of the canonical router for flattened tokens ``x2 [T, d]`` (or for ``logits``
    a router network computed; ``hash_idx`` [T, K]: the experts a hash router's table gives them); a router
    that also scores the shared experts (``shared_scored``) returns (routed logits, weights, idx, gammas)."""
    r = spec.router
    if logits is None and r.logits_from_forward:
        raise UnsupportedFeatureError(
            f"{spec.path}.{spec.router_attr}: a router network's logits come from its own forward, which its block "
            "must call (the block's forward calls router then experts); this block computes top-k itself")
    # a router kept in another dtype than the model (fp32 in a bf16 model) reads its input in its own dtype,
    # as the block's forward must have cast it (gate(x.float())) for the plain model to run at all
    if logits is None and spec.mode == "block" and isinstance(router, nn.Linear) and type(router).forward is nn.Linear.forward:
        logits = router(x2.to(router.weight.dtype))
    elif logits is None and r.call_router:  # called, not read: hooks on it see its logits (output_router_logits)
        logits = router(x2).reshape(x2.shape[0], -1)
    elif logits is None:  # the router's own weight, or the Linear one level down (router.gate, gate.wg, …)
        w = _bias(router, r.weight_attr)
        logits = F.linear(router_input(router, r, x2).to(w.dtype), w, _bias(router, r.logit_bias_attr))
    if r.shared_scored:  # select among the routed N; renormalise and scale with the shared scores (dense)
        logits, shared_logits = logits[:, : r.num_experts], logits[:, r.num_experts:]
        raw, idx = torch.ops.moe.router(
            logits, bias, r.top_k, r.score_func, False, 1.0, True, spec.path,
            r.n_group, r.topk_group, r.group_score, r.bias_on,
        )
        weights, gammas = shared_scored_weights(router, r, shared_logits, raw)
        return logits, expert_scaled(router, r, weights, idx), idx, gammas
    weights, idx = torch.ops.moe.router(
        logits, bias, r.top_k, r.score_func, r.renormalize, r.scaling, r.fp32_weights, spec.path,
        r.n_group, r.topk_group, r.group_score, r.bias_on, hash_idx,
    )
    return logits, expert_scaled(router, r, weights, idx), idx


def _hash_idx(router: nn.Module, spec: MoEBlockSpec, args: tuple, kwargs: dict) -> torch.Tensor:
    """[T, K] expert indices of a hash router: its table's rows at the token ids the block passes it."""
    ids = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
    if ids is None:
        raise UnsupportedFeatureError(
            f"{spec.path}.{spec.router_attr}: a hash router (routing by token id) was called without token ids: "
            "its block must pass the model's input_ids (a model run from inputs_embeds has none to route by)")
    return _bias(router, spec.router.hash_table_attr)[ids.reshape(-1)]


def routed(experts: nn.Module, spec: MoEBlockSpec, ctx: int, x2, idx, weights) -> torch.Tensor:
    """Σ_k w_k·expert_{idx_k}(x). With Z identity experts (indices N..N+Z-1) a row routed to one adds
    w·x as dense ops and is dispatched to expert idx mod N with weight 0 (an exact no-op contribution)."""
    w_in, w_out = expert_tensors(experts, spec)
    e = spec.experts
    identity = None
    if spec.router.identity_experts or spec.router.null_experts:  # null (skip) experts add nothing
        zero = idx >= e.num_experts
        if spec.router.identity_experts:
            identity = x2 * weights.masked_fill(~zero, 0).sum(-1, keepdim=True).to(x2.dtype)
        idx, weights = idx.remainder(e.num_experts), weights.masked_fill(zero, 0)
    y = torch.ops.moe.routed_experts(
        x2, idx, weights, w_in, w_out, e.op_activation, e.gated, e.num_experts, ctx, spec.path,
        *expert_biases(experts, spec),
    )
    return y if identity is None else y + identity


# -- installed forwards --------------------------------------------------------------------------


def _router_forward(self: nn.Module, hidden: torch.Tensor, *args, **kwargs):
    spec: MoEBlockSpec = self._moe_spec
    x2 = hidden.reshape(-1, spec.experts.d_model)
    if spec.router.bias_attr and not spec.router.bias_in_router:  # the block passes its own bias in
        bias = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if bias is None:
            raise RecognitionError(f"{spec.path}.{spec.router_attr}: the block holds the score-correction bias "
                                   f"{spec.router.bias_attr} but does not pass it to its router")
    else:
        bias = _bias(self, self._moe_bias_attr)
    logits, extra = None, ()
    hash_idx = _hash_idx(self, spec, args, kwargs) if spec.router.hash_table_attr else None
    if spec.router.logits_from_forward:  # the router network's own forward, as dense graph code
        own = type(self).forward(self, hidden, *args, **kwargs)
        logits = own[spec.router.outputs.index("logits")].reshape(x2.shape[0], -1)
        extra = tuple(own[len(spec.router.outputs):])  # what it returns after its three (Zaya: the next layer's state)
    out = dict(zip(("logits", "weights", "indices"), route(self, spec, x2, bias, logits, hash_idx), strict=True))
    return (*(out[k] for k in spec.router.outputs), *extra)


def _experts_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    return routed(self, self._moe_spec, self._moe_ctx, hidden, top_k_index, top_k_weights)


def _block_forward(self: nn.Module, hidden: torch.Tensor, *extra, **named):
    spec: MoEBlockSpec = self._moe_spec
    given = [f"argument {i + 2}" for i, a in enumerate(extra) if a is not None]
    given += [k for k, a in named.items() if a is not None]
    if given:  # the canonical form reads the hidden states only: a mask or the like would be ignored
        raise UnsupportedFeatureError(
            f"{spec.path}: the block is called with {given} besides the hidden states; its compiled form reads "
            "only the hidden states (an MoE block taking a mask or other inputs is not supported)")
    shape = hidden.shape
    x2 = hidden.reshape(-1, spec.experts.d_model)
    logits, weights, idx, *gammas = route(getattr(self, spec.router_attr), spec, x2, _bias(self, spec.router.bias_attr))
    if spec.router.weights_on_input:  # y = Σ_k expert_k(w_k·x): each (token, k) pair is a top-1 row of weight 1
        t, k = idx.shape
        xk = x2.unsqueeze(1) * weights.unsqueeze(-1).to(x2.dtype)
        yk = routed(getattr(self, spec.experts_attr), spec, self._moe_ctx, xk.reshape(t * k, -1),
                    idx.reshape(t * k, 1), torch.ones_like(weights).reshape(t * k, 1))
        y = yk.view(t, k, -1).sum(1)
    else:
        y = routed(getattr(self, spec.experts_attr), spec, self._moe_ctx, x2, idx, weights)
    if spec.shared_attr:
        s = getattr(self, spec.shared_attr)(x2, *gammas)  # gammas: the shared experts' route weights, if scored
        if spec.shared_gate_attr:
            s = torch.sigmoid(getattr(self, spec.shared_gate_attr)(x2)) * s
        y = y + s
    y = y.reshape(shape)
    if spec.returns_logits:
        return y, logits
    if spec.returns_aux:
        return y, _block_aux_loss(logits, idx, spec, self._moe_ctx)
    return y


def _block_aux_loss(logits: torch.Tensor, idx: torch.Tensor, spec: MoEBlockSpec, ctx: int) -> torch.Tensor:
    """The block's own load-balancing / z loss. Under context parallelism over the whole sequences, as
    runtime/cp_balance_loss.py does for transformers' loss: the CP group's router logits and routes
    all-gathered (the logits' gradients reduce-scattered back), each rank adding aux/cp to its part at
    pp = 1 and the whole aux at pp > 1 (the context's cp_aux_divisor; that module's docstring says why)."""
    import torch.distributed as dist

    from ..runtime import get_context

    r = spec.router
    rc = get_context(ctx)
    group = rc.cp_group if (r.lb_coef or r.z_coef) else None
    cp = dist.get_world_size(group) if group is not None else 1
    if cp == 1:
        return router_aux_loss(logits, idx, r.score_func, r.lb_coef, r.z_coef)
    logits = torch.ops.moe_cp.all_gather(logits.reshape(-1, logits.shape[-1]), 0, ctx, cp)
    idx = torch.ops.moe_cp.all_gather(idx.reshape(-1, idx.shape[-1]), 0, ctx, cp)
    return router_aux_loss(logits, idx, r.score_func, r.lb_coef, r.z_coef) / rc.cp_aux_divisor


def install(block: nn.Module, spec: MoEBlockSpec, w_in: torch.Tensor, w_out: torch.Tensor, ctx: int,
            biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> object:
    """Install the canonical forward on ``block`` with expert tensors (w_in, w_out) and, for experts
    with biases, (b_in, b_out); returns a token for :func:`uninstall`. For the fused layout the tensors
    replace the experts module's own (same names, canonical layout)."""
    experts = getattr(block, spec.experts_attr)
    if spec.experts.layout == "fused":
        names = ("gate_up_proj" if spec.experts.gated else "up_proj", "down_proj")
        if spec.experts.bias:
            names += (f"{names[0]}_bias", "down_proj_bias")
        saved = tuple(getattr(experts, n) for n in names)
        for n, t, old in zip(names, (w_in, w_out, *(biases or ())), saved, strict=True):
            setattr(experts, n, _as_param(t, old))
        token = ("fused", tuple(zip(names, saved, strict=True)))
    else:
        token = ("module", experts)
        experts = ExpertWeights(w_in, w_out, spec.experts.gated, _frozen_flag(experts, f"{spec.path}.{spec.experts_attr}"))
        setattr(block, spec.experts_attr, experts)
    if spec.mode == "components":
        router = getattr(block, spec.router_attr)
        router._moe_spec = spec
        router._moe_bias_attr = spec.router.bias_attr.split(".", 1)[1] if spec.router.bias_in_router else None
        router.forward = types.MethodType(_router_forward, router)
        experts._moe_spec, experts._moe_ctx = spec, ctx
        experts.forward = types.MethodType(_experts_forward, experts)
    else:
        block._moe_spec, block._moe_ctx = spec, ctx
        block.forward = types.MethodType(_block_forward, block)
    return token


def installed(module: nn.Module) -> bool:
    """Whether ``module`` runs an installed canonical forward (a model moe_compile already took over)."""
    fwd = module.__dict__.get("forward")
    return getattr(fwd, "__func__", None) in (_router_forward, _experts_forward, _block_forward)


def _as_param(t: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=like.requires_grad)


def uninstall(block: nn.Module, spec: MoEBlockSpec, token: object) -> None:
    kind, saved = token
    experts = getattr(block, spec.experts_attr)
    for mod in (block, getattr(block, spec.router_attr), experts):
        mod.__dict__.pop("forward", None)
    if kind == "fused":
        for n, t in saved:
            setattr(experts, n, t)
    else:
        setattr(block, spec.experts_attr, saved)


def set_context(block: nn.Module, spec: MoEBlockSpec, ctx: int) -> None:
    (getattr(block, spec.experts_attr) if spec.mode == "components" else block)._moe_ctx = ctx

