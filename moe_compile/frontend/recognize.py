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
    SCORE_ATTRS,
    SHARED_GATE_NAMES,
    SHARED_NAMES,
    TOPK_ATTRS,
    Z_ATTRS,
    ffn_shape,
    find_activation,
    first_attr,
    group_routing,
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
    router_kind: str  # "linear": nn.Linear giving logits; "hf": returns (logits, weights, idx)
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
    notes: list[str] = field(default_factory=list)


def _fused(path: str, ex: nn.Module, n: int, d: int) -> tuple[ExpertsSpec, tuple[ParamView, ...], Weights] | None:
    gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3):
        return None
    where = f"{path}.experts"
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
        ParamView(f"{path}.experts.gate_up_proj", f"{path}.experts.gate_up_proj", None),
        ParamView(f"{path}.experts.down_proj", f"{path}.experts.down_proj", None),
    )
    return spec, views, lambda: (gu, dn)


def _module_list(path: str, ex: nn.Module, n: int, d: int):
    if not isinstance(ex, nn.ModuleList):
        return None
    where = f"{path}.experts"
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
    canon_in = f"{path}.experts.{'gate_up_proj' if s.gated else 'up_proj'}"
    canon_out = f"{path}.experts.down_proj"
    views: list[ParamView] = []
    for e in range(n):
        if s.gated:
            g, u, dn = s.names
            views += [
                ParamView(f"{path}.experts.{e}.{g}.weight", canon_in, e, (0, h)),
                ParamView(f"{path}.experts.{e}.{u}.weight", canon_in, e, (h, 2 * h)),
            ]
        else:
            u, dn = s.names
            views.append(ParamView(f"{path}.experts.{e}.{u}.weight", canon_in, e, None))
        views.append(ParamView(f"{path}.experts.{e}.{dn}.weight", canon_out, e, None))

    def weights():
        if s.gated:
            w_in = torch.stack([torch.cat([getattr(m, s.names[0]).weight, getattr(m, s.names[1]).weight]) for m in ex])
        else:
            w_in = torch.stack([getattr(m, s.names[0]).weight for m in ex])
        return w_in.detach(), torch.stack([getattr(m, s.names[-1]).weight for m in ex]).detach()

    return ExpertsSpec(n, d, h, s.activation, s.gated, "module_list"), tuple(views), weights


def _stacked(path: str, ex: nn.Module, block: nn.Module, n: int, d: int):
    params = dict(ex.named_parameters(recurse=False))
    where = f"{path}.experts"
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
        canon_in, canon_out = f"{path}.experts.gate_up_proj", f"{path}.experts.down_proj"
        views = [
            ParamView(f"{path}.experts.{group[0]}", canon_in, None, (0, h)),
            ParamView(f"{path}.experts.{group[1]}", canon_in, None, (h, 2 * h)),
            ParamView(f"{path}.experts.{group[2]}", canon_out, None),
        ]
        spec = ExpertsSpec(n, d, h, find_activation((ex, block), where), True, "stacked")
        return spec, tuple(views), lambda g=g, u=u, dn=dn: (torch.cat([g, u], 1).detach(), dn.detach())
    return None


def read_block(path: str, block: nn.Module, experts_attr: str) -> Candidate:
    where = path or "<root>"
    router_attr, router = router_of(block, where)
    n, d = router.weight.shape
    ex = getattr(block, experts_attr)
    unsupported_router_features(block, router, where)
    found = _fused(where, ex, n, d) or _module_list(where, ex, n, d) or _stacked(where, ex, block, n, d)
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
    router_kind = "linear" if isinstance(router, nn.Linear) else "hf"
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
    _, scaling = first_attr(mods, ("routed_scaling_factor",))
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
        scaling=float(scaling) if scaling is not None else 1.0,
        lb_coef=float(lb or 0.0),
        z_coef=float(z or 0.0),
        shared_attr=shared_attr,
        shared_gate_attr=gate_attr,
        shared_hidden=shared_hidden,
    )


def find_candidates(model: nn.Module) -> list[Candidate]:
    """Every MoE block of ``model`` in module order; raises if there is none."""
    found: list[Candidate] = []
    for path, mod in model.named_modules():
        if any(path == c.path or path.startswith(c.path + ".") for c in found):
            continue
        attr = next((n for n in EXPERTS_NAMES if isinstance(getattr(mod, n, None), nn.Module)), None)
        if attr is None:
            continue
        found.append(read_block(path, mod, attr))
    if not found:
        raise RecognitionError(
            f"no MoE block found in {type(model).__name__}: expected modules with an `experts` child "
            "(fused 3-D expert weights, an nn.ModuleList of FFNs, or stacked 3-D weights) and a router child "
            "`gate`/`router`; moe_compile does not fall back to running the model densely"
        )
    return found
