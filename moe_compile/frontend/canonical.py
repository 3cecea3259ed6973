"""Canonical MoE forwards, installed on the user's modules, and the probe that checks them.

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

Before anything is sharded, the probe runs the block's own forward and the canonical one on the same
random batch; semantics that attributes leave open (score function, renormalisation, fp32 weights)
are settled by which candidate reproduces the block, and no match is an error naming the block.
"""

from __future__ import annotations

import contextlib
import itertools
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops  # noqa: F401  (registers torch.ops.moe)
from ..errors import MoECompileError, RecognitionError, UnsupportedFeatureError
from ..models.aux_losses import router_aux_loss
from .recognize import Candidate
from .spec import MoEBlockSpec, RouterSpec

PROBE_TOKENS = 48
PROBE_LOGIT_STD = 2.0  # spread of the router logits on the probe batch


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


def _bias(owner: nn.Module, attr: str | None) -> torch.Tensor | None:
    if attr is None:
        return None
    obj = owner
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def route(router: nn.Module, spec: MoEBlockSpec, x2: torch.Tensor, bias: torch.Tensor | None):
    """(logits, weights, idx) of the canonical router for flattened tokens ``x2 [T, d]``."""
    r = spec.router
    if spec.mode == "block" and isinstance(router, nn.Linear):
        logits = router(x2)
    else:  # the router's own weight, or the Linear one level down (router.gate, gate.wg, …)
        logits = F.linear(x2, _bias(router, r.weight_attr))
    weights, idx = torch.ops.moe.router(
        logits, bias, r.top_k, r.score_func, r.renormalize, r.scaling, r.fp32_weights, spec.path,
        r.n_group, r.topk_group, r.group_score,
    )
    return logits, weights, idx


def routed(experts: nn.Module, spec: MoEBlockSpec, ctx: int, x2, idx, weights) -> torch.Tensor:
    w_in, w_out = expert_tensors(experts, spec)
    e = spec.experts
    return torch.ops.moe.routed_experts(
        x2, idx, weights, w_in, w_out, e.activation, e.gated, e.num_experts, ctx, spec.path
    )


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
    out = dict(zip(("logits", "weights", "indices"), route(self, spec, x2, bias), strict=True))
    return tuple(out[k] for k in spec.router.outputs)


def _experts_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    return routed(self, self._moe_spec, self._moe_ctx, hidden, top_k_index, top_k_weights)


def _block_forward(self: nn.Module, hidden: torch.Tensor):
    spec: MoEBlockSpec = self._moe_spec
    shape = hidden.shape
    x2 = hidden.reshape(-1, spec.experts.d_model)
    logits, weights, idx = route(getattr(self, spec.router_attr), spec, x2, _bias(self, spec.router.bias_attr))
    y = routed(getattr(self, spec.experts_attr), spec, self._moe_ctx, x2, idx, weights)
    if spec.shared_attr:
        s = getattr(self, spec.shared_attr)(x2)
        if spec.shared_gate_attr:
            s = torch.sigmoid(getattr(self, spec.shared_gate_attr)(x2)) * s
        y = y + s
    y = y.reshape(shape)
    if spec.returns_aux:
        return y, router_aux_loss(logits, idx, spec.router.score_func, spec.router.lb_coef, spec.router.z_coef)
    return y


def install(block: nn.Module, spec: MoEBlockSpec, w_in: torch.Tensor, w_out: torch.Tensor, ctx: int) -> object:
    """Install the canonical forward on ``block`` with expert tensors (w_in, w_out); returns a token
    for :func:`uninstall`. For the fused layout the tensors replace the experts module's own."""
    experts = getattr(block, spec.experts_attr)
    if spec.experts.layout == "fused":
        saved = expert_tensors(experts, spec)
        experts.gate_up_proj = _as_param(w_in, saved[0])
        experts.down_proj = _as_param(w_out, saved[1])
        token = ("fused", saved)
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


def _as_param(t: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=like.requires_grad)


def uninstall(block: nn.Module, spec: MoEBlockSpec, token: object) -> None:
    kind, saved = token
    experts = getattr(block, spec.experts_attr)
    for mod in (block, getattr(block, spec.router_attr), experts):
        mod.__dict__.pop("forward", None)
    if kind == "fused":
        experts.gate_up_proj, experts.down_proj = saved
    else:
        setattr(block, spec.experts_attr, saved)


def set_context(block: nn.Module, spec: MoEBlockSpec, ctx: int) -> None:
    (getattr(block, spec.experts_attr) if spec.mode == "components" else block)._moe_ctx = ctx


# -- probe -------------------------------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    if a.shape != b.shape:
        return False, float("inf")
    tol = 1e-4 if a.dtype == torch.float32 and b.dtype == torch.float32 else 3e-2
    scale = b.abs().max().item() + 1e-12
    err = (a.float() - b.float()).abs().max().item() / scale
    return err <= tol, err


def _split(out: object, where: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out) and out[1].dim() == 0:
        return out[0], out[1]
    raise RecognitionError(
        f"{where}: forward returns {type(out).__name__}; a MoE block must return a tensor or (tensor, aux_loss scalar)"
    )


@contextlib.contextmanager
def _probe_router(c: Candidate, gen: torch.Generator):
    """Random router weights (logits of spread PROBE_LOGIT_STD) and score-correction bias for the probe,
    the model's own restored afterwards. Near-zero logits (a zero-initialised router, as AFMoE's) would
    let routings that differ only away from 0 pass: softmax and sigmoid renormalised over the top-2 agree
    at 0 and differ 2x in gradient; a zero bias would hide where the bias is added."""
    router = getattr(c.block, c.router_attr)
    w = _bias(router, c.weight_attr)
    tensors = [w] + ([_bias(c.block, c.bias_attr)] if c.bias_attr else [])
    saved = [t.detach().clone() for t in tensors]
    try:
        with torch.no_grad():
            n, d = w.shape
            w.copy_(torch.randn(n, d, generator=gen).to(w) * (PROBE_LOGIT_STD / d**0.5))
            if c.bias_attr:
                tensors[1].copy_(torch.randn(n, generator=gen).to(tensors[1]) * 0.5)
        yield
    finally:
        with torch.no_grad():
            for t, v in zip(tensors, saved, strict=True):
                t.copy_(v)


def _reference(c: Candidate, x: torch.Tensor, mode: str):
    """The block's own output on the probe batch, and (components mode) the order of its router's tuple,
    read from what the router returned: indices are the integer tensor, logits the float [T, N] one,
    weights the float [T, K] one."""
    router = getattr(c.block, c.router_attr)
    seen: list[object] = []
    saved = router.__dict__.get("forward")
    if mode == "components":
        own = router.forward
        router.forward = lambda *a, **k: seen.append(own(*a, **k)) or seen[-1]
    try:
        ref, ref_aux = _split(c.block(x), c.path)
    except MoECompileError:
        raise
    except Exception as e:  # noqa: BLE001 - the block's own forward needs more than hidden states
        raise RecognitionError(
            f"{c.path}: the block's own forward fails on a probe batch of hidden states alone "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); a MoE block must compute "
            f"forward(hidden_states) (blocks that also need token ids or other inputs are not supported)") from e
    finally:
        router.__dict__.pop("forward", None)
        if saved is not None:
            router.forward = saved
    return ref, ref_aux, _router_order(c, seen[0]) if seen else ("logits", "weights", "indices")


def _router_order(c: Candidate, out: object) -> tuple[str, str, str]:
    where = f"{c.path}.{c.router_attr}"
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
        kind = type(out).__name__ if not isinstance(out, tuple) else f"a {len(out)}-tuple"
        raise UnsupportedFeatureError(
            f"{where}: the router returns {kind}; a router module must return (logits, weights, indices) in some "
            "order (a router returning logits only, with top-k in the block's forward, is not supported)")
    n, k = c.experts.num_experts, c.top_k
    ints = [i for i, t in enumerate(out) if not t.is_floating_point()]
    logits = [i for i, t in enumerate(out) if t.is_floating_point() and t.shape[-1] == n]
    weights = [i for i, t in enumerate(out) if t.is_floating_point() and t.shape[-1] == k]
    if len(ints) != 1:
        raise UnsupportedFeatureError(f"{where}: the router returns {[str(t.dtype) for t in out]}: no single "
                                      "integer tensor of expert indices")
    if n == k or len(logits) != 1 or len(weights) != 1:
        return ("logits", "weights", "indices")  # not distinguishable by shape: the transformers order
    order = {ints[0]: "indices", logits[0]: "logits", weights[0]: "weights"}
    return tuple(order[i] for i in range(3))


def settle(c: Candidate) -> MoEBlockSpec:
    """Fix the routing semantics of a candidate by the probe (or from attributes alone on meta)."""
    mode = "components" if c.router_kind == "hf" else "block"
    w_in, w_out = c.full_weights()
    base = dict(
        path=c.path, index=0, mode=mode, router_attr=c.router_attr, experts_attr=c.experts_attr,
        experts=c.experts, shared_attr=c.shared_attr, shared_gate_attr=c.shared_gate_attr,
        shared_hidden=c.shared_hidden, param_views=c.views,
    )

    outputs = ("logits", "weights", "indices")

    def spec_for(sf: str, rn: bool, fp: bool, returns_aux: bool, checked: bool) -> MoEBlockSpec:
        r = RouterSpec(c.experts.num_experts, c.top_k, sf, rn, c.scaling, fp, c.bias_attr, c.lb_coef, c.z_coef,
                       *c.groups, weight_attr=c.weight_attr, outputs=outputs)
        return MoEBlockSpec(router=r, returns_aux=returns_aux, checked=checked, **base)

    options = list(itertools.product(c.score_funcs, c.renorms, c.fp32_options))
    if w_in.is_meta:
        sf, rn, fp = options[0]
        return spec_for(sf, rn, fp, c.lb_coef > 0 or c.z_coef > 0, checked=False)
    block = c.block
    gen = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(1, PROBE_TOKENS, c.experts.d_model, generator=gen).to(w_in.device, w_in.dtype)
    with torch.no_grad(), _probe_router(c, gen):
        ref, ref_aux, outputs = _reference(c, x, mode)
        if ref_aux is None and (c.lb_coef or c.z_coef):
            raise RecognitionError(
                f"{c.path}: has auxiliary-loss coefficients (lb={c.lb_coef}, z={c.z_coef}) but its forward returns no "
                "aux loss; return (output, aux_loss) so the compiled block can reproduce it"
            )
        errors = []
        for sf, rn, fp in options:
            spec = spec_for(sf, rn, fp, ref_aux is not None, checked=True)
            token = install(block, spec, w_in, w_out, ctx=0)
            try:
                out, aux = _split(block(x), c.path)
            except MoECompileError:
                raise
            except Exception as e:  # the canonical form met an interface it does not model
                raise RecognitionError(
                    f"{c.path}: recognised as an MoE block ({spec.describe()}), but its canonical form fails on a "
                    f"probe batch ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); its router "
                    f"({type(getattr(block, c.router_attr)).__name__}) or experts use an interface the compiler does "
                    "not model (a router must return (logits, weights, indices) or be a Linear)") from e
            finally:
                uninstall(block, spec, token)
            ok, err = _close(out, ref)
            if ok and ref_aux is not None:
                ok, aerr = _close(aux, ref_aux)
                err = max(err, aerr)
            if ok:
                return spec
            errors.append((err, spec))
    err, best = min(errors, key=lambda e: e[0])
    raise RecognitionError(
        f"{c.path}: recognised as an MoE block ({best.describe()}), but no supported routing reproduces its "
        f"output on a probe batch (closest: relative error {err:.2e}); the block computes something the compiler "
        "does not understand"
    )
