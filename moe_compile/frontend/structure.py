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
BIAS_ATTRS = ("e_score_correction_bias", "expert_bias", "score_correction_bias", "balancing_biases")
SCALING_ATTRS = ("routed_scaling_factor", "route_scale", "router_scaling_factor")
LB_ATTRS = ("lb_coef", "load_balancing_coef", "aux_loss_coef")
Z_ATTRS = ("z_coef", "z_loss_coef", "router_z_loss_coef")
ZERO_EXPERT_ATTRS = ("zero_expert_num", "num_zero_experts", "n_zero_experts")
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
        "ReLUSquaredActivation": "relu2",
    }
    if cls in known and not getattr(act, "use_gelu_python", False):
        return known[cls]
    raise UnsupportedFeatureError(
        f"{where}: activation {act!r} is not supported for routed experts (supported: SiLU, GELU, GELU-tanh, ReLU, ReLU², "
        "clamped and softcapped SwiGLU)"
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


LIMIT_ATTRS = ("limit", "swiglu_limit")
ALPHA_ATTRS = ("alpha", "swiglu_alpha")
Activation = tuple[str, tuple[tuple[str, float], ...]]  # (name, parameters) as in ExpertsSpec


def fused_activations(ex: nn.Module, where: str) -> list[Activation]:
    """The candidate activations of fused 3-D experts, most likely first (the probe picks):

    * an ``act_fn`` module with ``gate_softcap``/``up_softcap`` children (Inkling 2): softcapped SwiGLU;
    * no ``act_fn`` but a SwiGLU limit attribute (gpt-oss, MiniMax-M3, HY-V4): clamped SwiGLU
      (u + offset)·g·σ(α·g); the attributes give α (1 if absent) and the limit, not the offset;
    * otherwise the activation module/function, as for any FFN."""
    act = getattr(ex, "act_fn", None)
    caps = [getattr(getattr(act, n, None), "softcap", None) for n in ("gate_softcap", "up_softcap")]
    if isinstance(act, nn.Module) and all(isinstance(c, int | float) for c in caps):
        return [("softcap_swiglu", (("gate_cap", float(caps[0])), ("up_cap", float(caps[1]))))]
    _, limit = first_attr((ex,), LIMIT_ATTRS)
    _, alpha = first_attr((ex,), ALPHA_ATTRS)
    if act is None and isinstance(limit, int | float):
        offsets = (1.0, 0.0) if alpha is not None else (0.0, 1.0)
        alpha = float(alpha) if isinstance(alpha, int | float) else 1.0
        return [("clamped_swiglu", (("alpha", alpha), ("limit", float(limit)), ("up_offset", o))) for o in offsets]
    name = find_activation((ex,), where)
    if name == "silu" and isinstance(limit, int | float) and alpha is None:
        # a SiLU act_fn beside a SwiGLU limit (DeepSeek-V4): silu(min(g, limit))·clamp(u, ±limit), the clamped
        # form with α = 1 and no offset. (The probe's pre-activations stay far below a limit, so it cannot tell a
        # clamp from none: the attribute is taken at its word, as gpt-oss's is.)
        return [("clamped_swiglu", (("alpha", 1.0), ("limit", float(limit)), ("up_offset", 0.0)))]
    return [(name, ())]


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
        # the compiled FFN reads only these weights: anything else (an adapter, a scale) would be dropped
        custom = [f"{n} ({type(lin).__name__})" for n, lin in zip(group, lins) if type(lin).forward is not nn.Linear.forward]
        if custom:
            raise UnsupportedFeatureError(f"{where}: Linear layers with their own forward are not supported: {custom}")
        extra = [p for p, _ in mod.named_parameters() if p not in {f"{n}.weight" for n in group}]
        if extra:
            raise UnsupportedFeatureError(f"{where}: FFN parameters {extra} besides the Linears' weights are not supported")
        return FFNShape(group, h, find_activation((mod,), where))
    return None


INNER_ROUTER_NAMES = ("gate", "layer", "wg", "classifier", "linear", "proj")


def _weight_2d(m: object) -> bool:
    return isinstance(m, nn.Module) and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2


def router_network(weight_attr: str) -> bool:
    """The router weight path names the last Linear of a small network (Zaya's router: a projection, an MLP),
    not the router's own weight or one Linear one level down: the router's own forward gives the logits."""
    return weight_attr.count(".") >= 2 or (weight_attr != "weight" and weight_attr.split(".")[0] not in INNER_ROUTER_NAMES)


def null_experts(ex: nn.Module, n: int, path: str) -> int:
    """Z skip classes a router scores after the experts' own ``num_experts`` (Zaya's skip expert: rows routed to
    one add nothing); 0 when the router scores as many as the experts hold."""
    k = getattr(ex, "num_experts", None)
    return n - k if isinstance(k, int) and 0 < k < n else 0


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
        if inner is not None:  # a bias of that Linear is read by router_logit_bias
            return n, r, f"{inner}.weight"
        kids = [k for k, _ in r.named_children()]
        linears = [k for k, m in r.named_modules() if k and isinstance(m, nn.Linear)]
        if kids and linears and type(r).forward is not nn.Module.forward:
            return n, r, f"{linears[-1]}.weight"  # a router network: its last Linear gives the logits
        if kids:
            extra = [p for p in list(inspect.signature(r.forward).parameters)[1:] if p not in ("args", "kwargs")]
            takes = f"; its forward also takes {extra} (state beyond the hidden states)" if extra else ""
            raise UnsupportedFeatureError(
                f"{path}.{n}: the router is a small network (children {kids}), not one Linear [num_experts, "
                f"d_model]; MLP routers are not supported (looked for a Linear named {INNER_ROUTER_NAMES}){takes}"
            )
    raise RecognitionError(
        f"{path}: has experts but no router: expected a child {names} with a 2-D weight [num_experts, d_model] "
        f"(its own, or in a Linear child {INNER_ROUTER_NAMES})"
    )


def router_logit_bias(router: nn.Module, weight_attr: str, n: int, path: str) -> str | None:
    """Path (inside the router) of a bias beside the router's [N, d] weight (``bias`` or ``gate.bias``):
    the logits are x Wᵀ + b."""
    attr = weight_attr.rsplit(".", 1)[0] + ".bias" if "." in weight_attr else "bias"
    obj = router
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, torch.Tensor):
        return None
    if tuple(obj.shape) != (n,):
        raise UnsupportedFeatureError(f"{path}.{attr}: router bias of shape {tuple(obj.shape)}, not [{n}]")
    return attr


def score_function(mods: tuple[nn.Module, ...], path: str) -> str | None:
    """The router's score function: a name attribute (``scoring_func="sigmoid"``), or a module or function
    attribute (DeepSeek-V4's ``score_fn = ACT2FN["sqrtsoftplus"]``) told by its values on a few logits;
    None if neither is set (the probe tries softmax and sigmoid)."""
    from ..ops.routing import SCORE_FUNCS, route_scores

    name, sf = first_attr(mods, SCORE_ATTRS)
    if sf is None:  # (first_attr skips modules)
        name, sf = next(((n, getattr(m, n)) for m in mods for n in SCORE_ATTRS + ("score_fn", "scoring_fn")
                         if callable(getattr(m, n, None))), (None, None))
    if sf is None or isinstance(sf, str):
        if sf is not None and sf not in SCORE_FUNCS:
            raise UnsupportedFeatureError(f"{path}: router score function {sf!r} is not supported ({', '.join(SCORE_FUNCS)})")
        return sf
    logits = torch.linspace(-6.0, 6.0, 13).reshape(1, 13)
    try:
        with torch.no_grad():
            got = sf(logits)
    except Exception:  # noqa: BLE001 - not a function of the logits alone: named below
        got = None
    for known in SCORE_FUNCS:
        if isinstance(got, torch.Tensor) and got.shape == logits.shape and torch.allclose(got, route_scores(logits, known)):
            return known
    raise UnsupportedFeatureError(f"{path}: router score function {name} = {type(sf).__name__} computes none of the "
                                  f"supported ones ({', '.join(SCORE_FUNCS)})")


def integer_tables(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's own 2-D integer buffers (a hash router's [vocab, K] token-id → expert table)."""
    return [(a, b) for a, b in mod.named_buffers(recurse=False)
            if b.dim() == 2 and not b.is_floating_point() and not b.is_complex() and b.dtype != torch.bool]


def token_id_inputs(mod: nn.Module) -> list[str]:
    """The positional inputs of a module's forward, if one of them is token ids (its name holds "ids")."""
    params = list(inspect.signature(mod.forward).parameters.values())
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names if any("ids" in name for name in names) else []


def hash_table(router: nn.Module, n: int, path: str) -> str | None:
    """The token-id → experts table of a hash router, or None for a router that routes from the hidden
    states alone (plus, at most, a score-correction bias the block passes in). A hash router (DeepSeek-V4's
    first layers) takes the token ids in its forward and holds an integer buffer [vocab, K] of expert
    indices: each token's experts are its row, the router's scores still weight them. A router that takes
    token ids without such a table is refused."""
    if isinstance(router, nn.Linear) and type(router).forward is nn.Linear.forward:
        return None
    names = token_id_inputs(router)
    if not names:
        return None
    tables = integer_tables(router)
    if len(tables) != 1:
        raise UnsupportedFeatureError(
            f"{path}: the router's forward takes {names} (routing by token ids) but holds "
            f"{'no' if not tables else len(tables)} integer [vocab, K] buffers {[a for a, _ in tables]}, not one "
            "token-id → expert table: this hash routing is not supported")
    attr, table = tables[0]
    if not table.is_meta and table.numel() and not (0 <= int(table.min()) and int(table.max()) < n):
        raise UnsupportedFeatureError(
            f"{path}.{attr}: hash-routing table holds expert indices {int(table.min())}..{int(table.max())}, "
            f"outside the router's {n} experts")
    return attr


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


def identity_experts(mods: tuple[nn.Module, ...], n: int, path: str) -> int:
    """Z, the zero-computation (identity) experts the router scores after the routed ones (LongCat-Flash's
    ``zero_expert_num``): a row routed to one adds weight·x. 0 when the modules declare none."""
    name, z = first_attr(mods, ZERO_EXPERT_ATTRS)
    if z is None or z == 0:
        return 0
    if not isinstance(z, int) or not 0 < z < n:
        raise UnsupportedFeatureError(f"{path}: {name}={z!r} identity experts of the {n} the router scores "
                                      f"is not understood (need 1..{n - 1})")
    return z


def unsupported_router_features(block: nn.Module, router: nn.Module, path: str) -> None:
    """Raise for router features that change routing in ways the canonical router does not model."""
    mods = (block, router)
    name, jitter = first_attr(mods, ("jitter_noise", "router_jitter_noise", "moe_jitter_eps"))
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


def expert_codegen(specs, mxfp8: str | None, codegen: str, requested: str) -> str:
    """The codegen that carries every block's expert features ("torch" or "triton"), or a clear error.
    Expert biases run on the torch grouped FFN only (not in the MXFP8 path, not in Triton kernels);
    the Triton kernels implement the plain activations (silu, gelu, gelu_tanh, relu); the MXFP8 torch
    path takes every activation. codegen="auto" falls back to torch where Triton does not carry them."""
    from ..ops.activations import is_plain

    for s in specs:
        e = s.experts
        where = f"{s.path}.{s.experts_attr}"
        if e.bias and mxfp8:
            raise UnsupportedFeatureError(f"mxfp8={mxfp8!r} with expert biases is not supported: {where} "
                                          "(compile without mxfp8)")
        if codegen != "triton":
            continue
        feature = "expert biases" if e.bias else None if is_plain(e.op_activation) else \
            f"the expert activation {e.op_activation} (Triton kernels: silu, gelu, gelu_tanh, relu)"
        if feature and requested == "auto":
            return "torch"
        if feature:
            raise UnsupportedFeatureError(f"codegen='triton' with {feature} is not supported: {where} "
                                          "(use codegen='torch' or 'auto')")
    return codegen
