"""Find the MoE blocks of a model and read what each one is.

A MoE block is a module with an ``experts`` child and a router child (``gate``/``router``…) whose
weight is ``[num_experts, d_model]``; its experts are read by :mod:`.expert_readers`.

Which routing semantics apply (score function, renormalisation, fp32 weights) is read from
attributes; what attributes leave open is settled by the probe in :mod:`.probe`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import RecognitionError, UnsupportedFeatureError
from .expert_readers import ExpertVariant, Weights, _flat_stacked, _fused, _module_list, _stacked
from .router_input import config_top_k, router_extras, shared_scored
from .spec import ExpertsSpec, ParamView
from .structure import (
    BIAS_ATTRS,
    EXPERTS_NAMES,
    LB_ATTRS,
    RENORM_ATTRS,
    SCALING_ATTRS,
    SHARED_GATE_NAMES,
    SHARED_NAMES,
    TOPK_ATTRS,
    Z_ATTRS,
    ffn_shape,
    first_attr,
    group_routing,
    hash_table,
    identity_experts,
    null_experts,
    router_logit_bias,
    router_network,
    router_of,
    score_function,
    unsupported_router_features,
)


@dataclass
class Candidate:
    """A recognised block before its routing semantics are settled."""

    path: str
    block: nn.Module
    router_attr: str
    experts_attr: str
    router_kind: str  # "linear": nn.Linear giving logits; "hf": returns (logits, weights, idx) in some order
    experts: ExpertsSpec
    views: tuple[ParamView, ...]
    full_weights: Weights  # canonical (w_in [N, F, d], w_out [N, d, h]) from the original parameters
    top_k: int
    score_funcs: tuple[str, ...]
    renorms: tuple[bool, ...]
    fp32_options: tuple[bool, ...]
    bias_attr: str | None
    scaling: float
    lb_coef: float
    z_coef: float
    shared_attr: str | None = None
    shared_gate_attr: str | None = None
    shared_hidden: int = 0
    groups: tuple[int, int, str] = (1, 1, "top2_sum")  # (n_group, topk_group, group score)
    weight_attr: str = "weight"  # the router's [N, d] weight inside the router module
    logit_bias_attr: str | None = None  # the router Linear's own bias (inside the router module)
    router_extras: dict = field(default_factory=dict)  # RouterSpec input norm/scale, per-expert scale
    notes: list[str] = field(default_factory=list)
    full_biases: Weights | None = None  # canonical expert biases (b_in [N, F], b_out [N, d]), if any
    alternatives: tuple[ExpertVariant, ...] = ()  # other readings of the experts, for the probe to try

    def expert_variants(self) -> list[ExpertVariant]:
        return [ExpertVariant(self.experts, self.views, self.full_weights, self.full_biases), *self.alternatives]

    def use(self, v: ExpertVariant) -> None:
        """Keep the reading the probe settled on."""
        self.experts, self.views, self.full_weights, self.full_biases = v.experts, v.views, v.full_weights, v.full_biases


def read_block(path: str, block: nn.Module, experts_attr: str, router_attr: str | None = None) -> Candidate:
    """Read the MoE block at ``path``: its experts child ``experts_attr`` and its router (the child
    ``router_attr``, or found by name)."""
    where = path or "<root>"
    router_attr, router, weight_attr = router_of(block, where, router_attr)
    weight = router.get_parameter(weight_attr) if weight_attr != "weight" else router.weight
    n, d = weight.shape
    network = router_network(weight_attr)  # its own forward gives the logits; its input, the hidden states
    if network:
        d = next(m for m in router.modules() if isinstance(m, nn.Linear)).in_features
    ex = getattr(block, experts_attr)
    # a router whose last S rows score the shared experts (Inkling): the experts hold the first N
    scored = shared_scored(block, router, ex, next((getattr(block, s) for s in SHARED_NAMES
                                                    if isinstance(getattr(block, s, None), nn.Module)), None), n)
    n -= scored.get("shared_scored", 0)
    zero = identity_experts((ex, block, router), n, where)  # scored after the N routed ones (LongCat-Flash)
    n -= zero  # the experts hold the N routed ones; router-side shapes are N + zero
    null = 0 if zero or scored else null_experts(ex, n, where)  # skip classes after them (Zaya)
    n -= null
    zero_null = zero + null
    unsupported_router_features(block, router, where)
    table = hash_table(router, n + zero + null, f"{where}.{router_attr}")  # hash routing (DeepSeek-V4)
    fused = _fused(where, ex, n, d, experts_attr, zero)
    found = (_module_list(where, ex, n, d, experts_attr) or _stacked(where, ex, block, n, d, experts_attr)
             or _flat_stacked(where, ex, n, d, experts_attr) if fused is None else fused)
    if found is None:
        raise RecognitionError(
            f"{where}.{experts_attr}: expert weights not understood: expected fused 3-D gate_up_proj (or up_proj) "
            "/ down_proj, an nn.ModuleList of FFNs, or stacked 3-D w1/w3/w2 (or gate_proj/up_proj/down_proj) parameters"
        )
    variants = found if isinstance(found, list) else [ExpertVariant(*found)]
    experts, views, weights, biases = (variants[0].experts, variants[0].views, variants[0].full_weights,
                                       variants[0].full_biases)
    mods = (block, router)
    _, k = first_attr(mods, TOPK_ATTRS)
    k_in_config = k is None and config_top_k(router, block) is not None  # Gemma 4: router.config.top_k_experts
    k = config_top_k(router, block) if k_in_config else k
    if not isinstance(k, int) or not 1 <= k <= n + zero_null:
        raise RecognitionError(f"{where}: top-k not understood (attributes {TOPK_ATTRS} give {k!r}; need 1..{n + zero_null})")
    # a Linear subclass with its own forward (PhiMoE) returns more than logits: probe it as a module
    plain_linear = isinstance(router, nn.Linear) and type(router).forward is nn.Linear.forward
    router_kind = "linear" if plain_linear else "hf"
    if router_kind == "hf" and not k_in_config and not any(isinstance(getattr(m, "top_k", None), int) for m in mods):
        raise RecognitionError(f"{where}.{router_attr}: a non-Linear router (or its block) must expose top_k")
    sf = score_function(mods, where)
    if table is not None and getattr(router, table).shape[1] != k:
        raise UnsupportedFeatureError(f"{where}.{router_attr}.{table}: hash-routing table of shape "
                                      f"{tuple(getattr(router, table).shape)}, not [vocab, top_k={k}]")
    if scored and sf not in (None, "sigmoid"):
        raise UnsupportedFeatureError(f"{where}: a {sf} router that also scores the shared experts is not supported "
                                      "(sigmoid scores only)")
    _, rn = first_attr(mods, RENORM_ATTRS)
    bias_attr = None
    holders = [(block, ""), (router, f"{router_attr}.")]
    holders += [(m, f"{router_attr}.{c}.") for c, m in router.named_children()]  # Ernie 4.5: gate.moe_statics
    for m, prefix in holders:
        for b in BIAS_ATTRS:
            t = getattr(m, b, None)
            if isinstance(t, torch.Tensor):
                if t.shape not in ((n + zero_null,), (1, n + zero_null)):  # [1, N]: one expert group (Ernie 4.5)
                    raise UnsupportedFeatureError(f"{where}: score-correction bias {prefix}{b} has shape {tuple(t.shape)}, "
                                                  f"not [{n + zero_null}]")
                bias_attr = prefix + b
    _, scaling = first_attr(mods, SCALING_ATTRS)
    _, lb = first_attr((block,), LB_ATTRS)
    _, z = first_attr((block,), Z_ATTRS)
    shared_attr = next((s for s in SHARED_NAMES if isinstance(getattr(block, s, None), nn.Module)), None)
    shared_hidden = 0
    if shared_attr:
        sh = getattr(block, shared_attr)
        if isinstance(sh, nn.ModuleList):
            raise UnsupportedFeatureError(f"{where}.{shared_attr}: more than one shared expert module is not supported")
        fs = ffn_shape(sh, d, f"{where}.{shared_attr}")
        shared_hidden = fs.hidden if fs else sum(p.numel() for p in sh.parameters()) // (3 * d)
    gate_attr = next((g for g in SHARED_GATE_NAMES if isinstance(getattr(block, g, None), nn.Linear)), None)
    if gate_attr and not shared_attr:
        raise RecognitionError(f"{where}.{gate_attr}: a shared-expert gate without a shared expert")
    if gate_attr and getattr(block, gate_attr).out_features != 1:
        raise UnsupportedFeatureError(f"{where}.{gate_attr}: shared-expert gate must be Linear(d, 1)")
    return Candidate(
        path=where,
        block=block,
        router_attr=router_attr,
        experts_attr=experts_attr,
        router_kind=router_kind,
        experts=experts,
        views=views,
        full_weights=weights,
        top_k=k,
        score_funcs=(sf,) if sf else ("sigmoid",) if scored else ("softmax", "sigmoid"),
        renorms=(bool(rn),) if rn is not None else (False, True),
        fp32_options=(False, True) if router_kind == "hf" else (False,),
        bias_attr=bias_attr,
        groups=group_routing(block, router, n + zero_null, k, where),
        weight_attr=weight_attr,
        logit_bias_attr=None if network else router_logit_bias(router, weight_attr, n + zero_null, f"{where}.{router_attr}"),
        router_extras={**(router_extras(router, n + zero_null, d) if weight_attr != "weight" and not network else {}),
                       **scored, **({"identity_experts": zero} if zero else {}), **({"null_experts": null} if null else {}),
                       **({"logits_from_forward": True} if network else {}),
                       **({"hash_table_attr": table} if table else {})},
        scaling=float(scaling) if scaling is not None else 1.0,
        lb_coef=float(lb or 0.0),
        z_coef=float(z or 0.0),
        shared_attr=shared_attr,
        shared_gate_attr=gate_attr,
        shared_hidden=shared_hidden,
        full_biases=biases,
        alternatives=tuple(variants[1:]),
    )


Recognizer = Callable[[str, nn.Module], "Candidate | None"]
_RECOGNIZERS: list[Recognizer] = []


def register_recognizer(fn: Recognizer) -> Recognizer:
    """Register a recogniser for a family that the built-in one does not understand.

    ``fn(path, module)`` is called for every module of the model (outermost first), before the
    built-in recogniser; it returns a :class:`Candidate` for a MoE block (usually
    ``read_block(path, module, experts_attr=..., router_attr=...)`` naming the block's own children),
    or None to leave the module to the others. Registered recognisers are tried newest first. Usable as
    a decorator; :func:`unregister_recognizer` removes one."""
    if not callable(fn):
        raise TypeError(f"register_recognizer: {fn!r} is not callable")
    _RECOGNIZERS.insert(0, fn)
    return fn


def unregister_recognizer(fn: Recognizer) -> None:
    _RECOGNIZERS.remove(fn)


def _builtin(path: str, mod: nn.Module) -> Candidate | None:
    attr = next((n for n in EXPERTS_NAMES if isinstance(getattr(mod, n, None), nn.Module)), None)
    return None if attr is None else read_block(path, mod, attr)


def _expert_like(model: nn.Module) -> str | None:
    """The first module whose name says experts or MoE (to name in the error when nothing is found)."""
    for path, mod in model.named_modules():
        leaf = path.rsplit(".", 1)[-1].lower()
        if path and ("expert" in leaf or "moe" in leaf or "moe" in type(mod).__name__.lower()
                     or any("expert" in n for n, _ in mod.named_parameters(recurse=False))):
            return path
    return None


def find_candidates(model: nn.Module) -> list[Candidate]:
    """Every MoE block of ``model`` in module order; raises if there is none."""
    found: list[Candidate] = []
    for path, mod in model.named_modules():
        if any(path == c.path or path.startswith(c.path + ".") for c in found):
            continue
        for recognise in (*_RECOGNIZERS, _builtin):
            c = recognise(path, mod)
            if c is not None:
                found.append(c)
                break
    if not found:
        like = _expert_like(model)
        hint = (f"; {like} ({type(model.get_submodule(like)).__name__}) looks expert-related but has no `experts` "
                "child with a router beside it (e.g. product-key or attention experts are not supported)") if like else ""
        raise RecognitionError(
            f"no MoE block found in {type(model).__name__}: expected modules with an `experts` child "
            "(fused 3-D expert weights, an nn.ModuleList of FFNs, or stacked 3-D weights) and a router child "
            f"`gate`/`router`{hint}; moe_compile does not fall back to running the model densely, and a family "
            "nothing recognises is added with moe_compile.register_recognizer"
        )
    return found
