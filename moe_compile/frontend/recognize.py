"""Find the MoE blocks of a model and read what each one is.

A MoE block is a module with an ``experts`` child and a router child (``gate``/``router``…) whose
weight is ``[num_experts, d_model]``. The experts are one of:

* fused 3-D tensors ``gate_up_proj [N, 2h, d]`` and ``down_proj [N, d, h]`` (transformers 5.x);
* an ``nn.ModuleList`` of N identical FFNs (SwiGLU: gate/up/down Linears; or two-layer up/down);
* stacked 3-D parameters ``w1/w3/w2`` or ``gate_proj/up_proj/down_proj`` shaped ``[N, out, in]``.

Which routing semantics apply (score function, renormalisation, fp32 weights) is read from
attributes; what attributes leave open is settled by the probe in :mod:`.canonical`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..errors import RecognitionError, UnsupportedFeatureError
from .spec import ExpertsSpec, ParamView
from .structure import (
    BIAS_ATTRS,
    EXPERTS_NAMES,
    GATED_TRIPLES,
    LB_ATTRS,
    RENORM_ATTRS,
    SCALING_ATTRS,
    SCORE_ATTRS,
    SHARED_GATE_NAMES,
    SHARED_NAMES,
    TOPK_ATTRS,
    Z_ATTRS,
    ffn_shape,
    find_activation,
    first_attr,
    group_routing,
    router_inputs,
    router_of,
    unsupported_router_features,
)

Weights = Callable[[], tuple[torch.Tensor, torch.Tensor]]


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
    notes: list[str] = field(default_factory=list)


def _fused(path: str, ex: nn.Module, n: int, d: int, ea: str = "experts") -> tuple[ExpertsSpec, tuple[ParamView, ...], Weights] | None:
    gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3):
        return None
    where = f"{path}.{ea}"
    extra = [name for name, _ in ex.named_parameters() if name not in ("gate_up_proj", "down_proj")]
    if extra:
        raise UnsupportedFeatureError(f"{where}: expert parameters {extra} (e.g. biases) are not supported")
    if gu.shape[0] != n or gu.shape[2] != d or gu.shape[1] % 2:
        if gu.shape[1] == d:
            raise UnsupportedFeatureError(
                f"{where}.gate_up_proj has shape {tuple(gu.shape)} ([N, d, 2h], input-major); only [N, 2h, d] is supported"
            )
        raise RecognitionError(f"{where}.gate_up_proj shape {tuple(gu.shape)} does not fit N={n}, d={d}")
    h = gu.shape[1] // 2
    if tuple(dn.shape) != (n, d, h):
        raise RecognitionError(f"{where}.down_proj shape {tuple(dn.shape)} is not [N={n}, d={d}, h={h}]")
    spec = ExpertsSpec(n, d, h, find_activation((ex,), where), True, "fused")
    views = (
        ParamView(f"{path}.{ea}.gate_up_proj", f"{path}.{ea}.gate_up_proj", None),
        ParamView(f"{path}.{ea}.down_proj", f"{path}.{ea}.down_proj", None),
    )
    return spec, views, lambda: (gu, dn)


def _module_list(path: str, ex: nn.Module, n: int, d: int, ea: str = "experts"):
    if not isinstance(ex, nn.ModuleList):
        return None
    where = f"{path}.{ea}"
    if len(ex) != n:
        raise RecognitionError(f"{where}: {len(ex)} expert modules but the router scores {n} experts")
    shapes = [ffn_shape(m, d, f"{where}.{i}") for i, m in enumerate(ex)]
    if shapes[0] is None:
        raise RecognitionError(
            f"{where}.0: expert is not an FFN of bias-free Linears named {GATED_TRIPLES[0]}, ('w1','w3','w2'), "
            "('fc1','fc2') or ('up_proj','down_proj')"
        )
    if any(s != shapes[0] for s in shapes):
        raise UnsupportedFeatureError(f"{where}: experts differ in structure or width; all must be identical")
    s = shapes[0]
    h = s.hidden
    canon_in = f"{path}.{ea}.{'gate_up_proj' if s.gated else 'up_proj'}"
    canon_out = f"{path}.{ea}.down_proj"
    views: list[ParamView] = []
    for e in range(n):
        if s.gated:
            g, u, dn = s.names
            views += [
                ParamView(f"{path}.{ea}.{e}.{g}.weight", canon_in, e, (0, h)),
                ParamView(f"{path}.{ea}.{e}.{u}.weight", canon_in, e, (h, 2 * h)),
            ]
        else:
            u, dn = s.names
            views.append(ParamView(f"{path}.{ea}.{e}.{u}.weight", canon_in, e, None))
        views.append(ParamView(f"{path}.{ea}.{e}.{dn}.weight", canon_out, e, None))

    def weights():
        if s.gated:
            w_in = torch.stack([torch.cat([getattr(m, s.names[0]).weight, getattr(m, s.names[1]).weight]) for m in ex])
        else:
            w_in = torch.stack([getattr(m, s.names[0]).weight for m in ex])
        return w_in.detach(), torch.stack([getattr(m, s.names[-1]).weight for m in ex]).detach()

    return ExpertsSpec(n, d, h, s.activation, s.gated, "module_list"), tuple(views), weights


def _stacked(path: str, ex: nn.Module, block: nn.Module, n: int, d: int, ea: str = "experts"):
    params = dict(ex.named_parameters(recurse=False))
    where = f"{path}.{ea}"
    for group in GATED_TRIPLES:
        if not all(k in params and params[k].dim() == 3 for k in group):
            continue
        g, u, dn = (params[k] for k in group)
        h = g.shape[1]
        if g.shape != (n, h, d) or u.shape != (n, h, d) or dn.shape != (n, d, h):
            raise UnsupportedFeatureError(
                f"{where}: stacked expert weights {group} have shapes {[tuple(p.shape) for p in (g, u, dn)]}; "
                f"expected [N, out, in] = [{n}, h, {d}], [{n}, h, {d}], [{n}, {d}, h]"
            )
        extra = sorted(set(params) - set(group))
        if extra:
            raise UnsupportedFeatureError(f"{where}: extra expert parameters {extra} are not supported")
        canon_in, canon_out = f"{path}.{ea}.gate_up_proj", f"{path}.{ea}.down_proj"
        views = [
            ParamView(f"{path}.{ea}.{group[0]}", canon_in, None, (0, h)),
            ParamView(f"{path}.{ea}.{group[1]}", canon_in, None, (h, 2 * h)),
            ParamView(f"{path}.{ea}.{group[2]}", canon_out, None),
        ]
        spec = ExpertsSpec(n, d, h, find_activation((ex, block), where), True, "stacked")
        return spec, tuple(views), lambda g=g, u=u, dn=dn: (torch.cat([g, u], 1).detach(), dn.detach())
    return None


def read_block(path: str, block: nn.Module, experts_attr: str, router_attr: str | None = None) -> Candidate:
    """Read the MoE block at ``path``: its experts child ``experts_attr`` and its router (the child
    ``router_attr``, or found by name)."""
    where = path or "<root>"
    router_attr, router, weight_attr = router_of(block, where, router_attr)
    weight = router.get_parameter(weight_attr) if weight_attr != "weight" else router.weight
    n, d = weight.shape
    ex = getattr(block, experts_attr)
    unsupported_router_features(block, router, where)
    router_inputs(router, f"{where}.{router_attr}")
    found = (_fused(where, ex, n, d, experts_attr) or _module_list(where, ex, n, d, experts_attr)
             or _stacked(where, ex, block, n, d, experts_attr))
    if found is None:
        raise RecognitionError(
            f"{where}.{experts_attr}: expert weights not understood: expected fused 3-D gate_up_proj/down_proj, "
            "an nn.ModuleList of FFNs, or stacked 3-D w1/w3/w2 (or gate_proj/up_proj/down_proj) parameters"
        )
    experts, views, weights = found
    mods = (block, router)
    _, k = first_attr(mods, TOPK_ATTRS)
    if not isinstance(k, int) or not 1 <= k <= n:
        raise RecognitionError(f"{where}: top-k not understood (attributes {TOPK_ATTRS} give {k!r}; need 1..{n})")
    # a Linear subclass with its own forward (PhiMoE) returns more than logits: probe it as a module
    plain_linear = isinstance(router, nn.Linear) and type(router).forward is nn.Linear.forward
    router_kind = "linear" if plain_linear else "hf"
    if router_kind == "hf" and not isinstance(getattr(router, "top_k", None), int):
        raise RecognitionError(f"{where}.{router_attr}: a non-Linear router must expose top_k")
    _, sf = first_attr(mods, SCORE_ATTRS)
    if sf is not None and sf not in ("softmax", "sigmoid"):
        raise UnsupportedFeatureError(f"{where}: router score function {sf!r} is not supported (softmax, sigmoid)")
    _, rn = first_attr(mods, RENORM_ATTRS)
    bias_attr = None
    for m, prefix in ((block, ""), (router, f"{router_attr}.")):
        for b in BIAS_ATTRS:
            t = getattr(m, b, None)
            if isinstance(t, torch.Tensor):
                if t.shape != (n,):
                    raise UnsupportedFeatureError(f"{where}: score-correction bias {prefix}{b} has shape {tuple(t.shape)}, not [{n}]")
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
        score_funcs=(sf,) if sf else ("softmax", "sigmoid"),
        renorms=(bool(rn),) if rn is not None else (False, True),
        fp32_options=(False, True) if router_kind == "hf" else (False,),
        bias_attr=bias_attr,
        groups=group_routing(block, router, n, k, where),
        weight_attr=weight_attr,
        scaling=float(scaling) if scaling is not None else 1.0,
        lb_coef=float(lb or 0.0),
        z_coef=float(z or 0.0),
        shared_attr=shared_attr,
        shared_gate_attr=gate_attr,
        shared_hidden=shared_hidden,
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
