"""Reading MoE structure from modules: routers, expert FFNs, activations, attributes.

Recognition reads module structure (which children and parameters exist, their shapes) and
attributes (top_k, score function, renormalisation, bias, loss coefficients); it never relies on
class names of the blocks themselves. Every failure names the module path and what was not understood.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import RecognitionError, UnsupportedFeatureError

ROUTER_NAMES = ("gate", "router", "gating", "wg")
EXPERTS_NAMES = ("experts",)
SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
SHARED_GATE_NAMES = ("shared_expert_gate", "shared_gate")
TOPK_ATTRS = ("top_k", "num_experts_per_tok", "topk", "k")
SCORE_ATTRS = ("score_func", "scoring_func", "score_function")
RENORM_ATTRS = ("norm_topk_prob", "renormalize", "normalize_topk")
BIAS_ATTRS = ("e_score_correction_bias", "expert_bias", "score_correction_bias")
SCALING_ATTRS = ("routed_scaling_factor", "route_scale")
LB_ATTRS = ("lb_coef", "load_balancing_coef", "aux_loss_coef")
Z_ATTRS = ("z_coef", "z_loss_coef", "router_z_loss_coef")
ACT_ATTRS = ("act_fn", "act", "activation", "activation_fn")
GATED_TRIPLES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("wi_0", "wi_1", "wo"))
PLAIN_PAIRS = (("up_proj", "down_proj"), ("fc1", "fc2"), ("w1", "w2"), ("c_fc", "c_proj"), ("wi", "wo"))


def first_attr(mods: tuple[nn.Module, ...], names: tuple[str, ...]) -> tuple[str | None, object]:
    """(name, value) of the first attribute in ``names`` set on any of ``mods`` (not None)."""
    for m in mods:
        for n in names:
            v = getattr(m, n, None)
            if v is not None and not isinstance(v, nn.Module | nn.ModuleList):
                return n, v
    return None, None


def activation_name(act: object, where: str) -> str:
    """Canonical name of an activation module or function."""
    if isinstance(act, nn.SiLU) or act in (F.silu, torch.nn.functional.silu):
        return "silu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if isinstance(act, nn.ReLU) or act in (F.relu, torch.relu):
        return "relu"
    if act is F.gelu:
        return "gelu"
    cls = type(act).__name__
    known = {
        "SiLUActivation": "silu",
        "GELUActivation": "gelu",
        "GELUTanh": "gelu_tanh",
        "PytorchGELUTanh": "gelu_tanh",
        "NewGELUActivation": "gelu_tanh",
    }
    if cls in known and not getattr(act, "use_gelu_python", False):
        return known[cls]
    raise UnsupportedFeatureError(
        f"{where}: activation {act!r} is not supported for routed experts (supported: SiLU, GELU, GELU-tanh, ReLU)"
    )


def find_activation(mods: tuple[nn.Module, ...], where: str) -> str:
    name, act = None, None
    for m in mods:
        for n in ACT_ATTRS:
            a = getattr(m, n, None)
            if a is not None and not isinstance(a, str | bool | int | float):
                name, act = n, a
                break
        if act is not None:
            break
    if act is None:
        raise RecognitionError(f"{where}: no expert activation found (looked for attributes {ACT_ATTRS})")
    return activation_name(act, f"{where}.{name}")


@dataclass
class FFNShape:
    """A dense FFN: Linear names in order (gate, up, down) or (up, down), hidden width, activation."""

    names: tuple[str, ...]
    hidden: int
    activation: str

    @property
    def gated(self) -> bool:
        return len(self.names) == 3


def ffn_shape(mod: nn.Module, d: int, where: str) -> FFNShape | None:
    """Recognise a SwiGLU-style or two-layer FFN made of bias-free Linears; None if not an FFN."""
    children = dict(mod.named_children())
    for group in GATED_TRIPLES + PLAIN_PAIRS:
        if not all(isinstance(children.get(n), nn.Linear) for n in group):
            continue
        lins = [children[n] for n in group]
        if any(lin.bias is not None for lin in lins):
            raise UnsupportedFeatureError(f"{where}: expert Linear layers with bias are not supported")
        h = lins[0].out_features
        if lins[0].in_features != d or lins[-1].in_features != h or lins[-1].out_features != d:
            raise RecognitionError(
                f"{where}: FFN Linears {group} have shapes that do not chain d={d} → h={h} → d "
                f"({[tuple(lin.weight.shape) for lin in lins]})"
            )
        if len(group) == 3 and (lins[1].in_features, lins[1].out_features) != (d, h):
            raise RecognitionError(f"{where}: gate and up projections differ in shape")
        return FFNShape(group, h, find_activation((mod,), where))
    return None


INNER_ROUTER_NAMES = ("gate", "layer", "wg", "classifier", "linear", "proj")


def _weight_2d(m: object) -> bool:
    return isinstance(m, nn.Module) and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2


def router_of(block: nn.Module, path: str, name: str | None = None) -> tuple[str, nn.Module, str]:
    """(child name, router module, path of its [N, d] weight inside it): the weight is the router's own
    (``gate.weight``) or one level down, in a Linear inside the router module (``router.gate``,
    ``router.layer``, ``gate.wg``, ``router.classifier``)."""
    names = (name,) if name else ROUTER_NAMES
    for n in names:
        r = getattr(block, n, None)
        if _weight_2d(r):
            return n, r, "weight"
    for n in names:
        r = getattr(block, n, None)
        if not isinstance(r, nn.Module):
            continue
        inner = next((i for i in INNER_ROUTER_NAMES if _weight_2d(getattr(r, i, None))), None)
        if inner is not None:
            if getattr(getattr(r, inner), "bias", None) is not None:
                raise UnsupportedFeatureError(f"{path}.{n}.{inner}: router bias is not supported")
            return n, r, f"{inner}.weight"
        kids = [k for k, _ in r.named_children()]
        if kids:
            raise UnsupportedFeatureError(
                f"{path}.{n}: the router is a small network (children {kids}), not one Linear [num_experts, "
                f"d_model]; MLP routers are not supported (looked for a Linear named {INNER_ROUTER_NAMES})"
            )
    raise RecognitionError(
        f"{path}: has experts but no router: expected a child {names} with a 2-D weight [num_experts, d_model] "
        f"(its own, or in a Linear child {INNER_ROUTER_NAMES})"
    )


def router_inputs(router: nn.Module, path: str) -> None:
    """A router must route from the hidden states alone (plus, at most, a score-correction bias the block
    passes in); one that reads token ids (hash routing) is refused."""
    if isinstance(router, nn.Linear) and type(router).forward is nn.Linear.forward:
        return
    params = list(inspect.signature(router.forward).parameters.values())
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any("ids" in n for n in names):
        raise UnsupportedFeatureError(
            f"{path}: the router's forward takes {names}: routing by token ids (hash routing) is not supported"
        )


GROUP_ATTRS = ("num_group", "n_group", "num_expert_group")
TOPK_GROUP_ATTRS = ("topk_group",)


def group_routing(block: nn.Module, router: nn.Module, n: int, k: int, path: str) -> tuple[int, int, str]:
    """(n_group, topk_group, group score) of group-limited routing, (1, 1, ...) when ungrouped. The
    group score follows the router's method: max for DeepSeek-V2's group_limited_greedy, the sum of
    each group's top-2 otherwise (DeepSeek-V3 noaux_tc, GLM-4-MoE); the probe checks the choice."""
    mods = (block, router)
    _, method = first_attr(mods, ("topk_method",))
    name, g = first_attr(mods, GROUP_ATTRS)
    if method == "greedy" or not isinstance(g, int) or g <= 1:
        return (1, 1, "top2_sum")
    _, tg = first_attr(mods, TOPK_GROUP_ATTRS)
    if n % g:
        raise UnsupportedFeatureError(f"{path}: {name}={g} groups do not split {n} experts evenly")
    if not isinstance(tg, int) or not 1 <= tg <= g or tg * (n // g) < k:
        raise UnsupportedFeatureError(f"{path}: group-limited routing with {name}={g} needs topk_group in "
                                      f"1..{g} leaving at least top_k={k} experts, got topk_group={tg!r}")
    score = "max" if method == "group_limited_greedy" else "top2_sum"
    if score == "top2_sum" and n // g < 2:
        raise UnsupportedFeatureError(f"{path}: top-2 group scores need at least 2 experts per group ({name}={g})")
    return (g, tg, score)


def unsupported_router_features(block: nn.Module, router: nn.Module, path: str) -> None:
    """Raise for router features that change routing in ways the canonical router does not model."""
    mods = (block, router)
    name, jitter = first_attr(mods, ("jitter_noise", "router_jitter_noise"))
    if isinstance(jitter, float | int) and jitter > 0:
        raise UnsupportedFeatureError(
            f"{path}: router jitter noise ({name}={jitter}) is not supported: set it to 0 before compiling"
        )
    name, cf = first_attr(mods, ("capacity_factor",))
    if cf is not None:
        raise UnsupportedFeatureError(
            f"{path}: the block implements its own capacity ({name}={cf}); remove it and pass "
            "moe_compile(..., capacity_factor=...) instead"
        )
    if not isinstance(router, nn.Linear) and isinstance(getattr(router, "bias", None), torch.Tensor):
        raise UnsupportedFeatureError(f"{path}: router bias on a non-Linear router is not supported")
