"""Readers of a MoE block's expert weights, one per layout. The experts are one of:

* fused 3-D tensors ``gate_up_proj [N, 2h, d]`` and ``down_proj [N, d, h]`` (transformers 5.x), or
  input-major ``[N, d, 2h]`` / ``[N, h, d]``, ungated ``up_proj``, with optional ``*_bias`` tensors;
* an ``nn.ModuleList`` of N identical FFNs (SwiGLU: gate/up/down Linears; or two-layer up/down);
* stacked 3-D parameters ``w1/w3/w2`` or ``gate_proj/up_proj/down_proj`` shaped ``[N, out, in]``;
* experts flattened into 2-D rows ``[N·h, d]`` (DBRX's ``experts.mlp.w1/v1/w2``).

Every reading is re-laid out to the canonical ``w_in [N, F, d]`` ([gate; up] rows), ``w_out [N, d, h]``
at canonicalisation; ParamViews map canonical tensors back to the original names and layouts.

A layout the shapes leave open (output- or input-major, gate/up halves or alternating, activation)
gives one ExpertVariant per reading, for the probe in :mod:`.probe` to settle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import RecognitionError, UnsupportedFeatureError
from .spec import ExpertsSpec, ParamView
from .structure import GATED_TRIPLES, ffn_shape, find_activation, fused_activations

Weights = Callable[[], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ExpertVariant:
    """One reading of a block's experts (layout, activation) that the probe may try."""

    experts: ExpertsSpec
    views: tuple[ParamView, ...]
    full_weights: Weights
    full_biases: Weights | None = None


def _fused_layouts(where: str, wi: torch.Tensor, dn: torch.Tensor, n: int, d: int, f_mult: int, name: str,
                   dead: int = 0):
    """[(input_major, h)]: output-major wi [N, F, d], dn [N, d, h] (transformers' usual) and/or
    input-major wi [N, d, F], dn [N, h, d] (Llama 4, Aria, gpt-oss); both when the shapes allow both.
    With ``dead`` identity experts, wi may hold them too, unused, after the N (LongCat-Flash)."""
    if not (wi.shape[0] in (n, n + dead) and n == dn.shape[0]):
        raise UnsupportedFeatureError(
            f"{where}: the router scores {n} experts but {name} / down_proj hold {wi.shape[0]} / {dn.shape[0]} (a router "
            "that also scores shared experts, or experts beyond the routed ones, is not supported)")
    out = []
    if dn.shape[1] == d and wi.shape[2] == d and wi.shape[1] == f_mult * dn.shape[2]:
        out.append((False, dn.shape[2]))
    if dn.shape[2] == d and wi.shape[1] == d and wi.shape[2] == f_mult * dn.shape[1]:
        out.append((True, dn.shape[1]))
    if not out:
        raise RecognitionError(
            f"{where}: {name} {tuple(wi.shape)} and down_proj {tuple(dn.shape)} fit neither [N, F, d] / [N, d, h] "
            f"(output-major) nor [N, d, F] / [N, h, d] (input-major) with N={n}, d={d}, F={'2h' if f_mult == 2 else 'h'}")
    return out


def _fused_variant(path, ea, wi, dn, biases, spec_args, input_major: bool, interleaved: bool) -> ExpertVariant:
    """Canonical tensors of one reading: w_in [N, F, d] = [gate; up] rows, w_out [N, d, h], biases [N, F], [N, d]."""
    name = "gate_up_proj" if spec_args[4] else "up_proj"
    dead = wi.shape[0] - spec_args[0]  # unused experts after the N (LongCat-Flash's identity experts)

    def canon_in(t: torch.Tensor) -> torch.Tensor:  # [N, F, …] rows (gate/up alternating → [gate; up])
        return torch.cat([t[:, 0::2], t[:, 1::2]], 1) if interleaved else t

    def weights():  # read at call time: the probe swaps the parameters' storage for random weights
        w = wi[: spec_args[0]].detach() if dead else wi
        if not (input_major or interleaved):
            return w, dn
        w_in = canon_in(w.transpose(1, 2) if input_major else w)
        w_out = dn.transpose(1, 2) if input_major else dn
        return w_in.detach().contiguous(), w_out.detach().contiguous()

    views = [ParamView(f"{path}.{ea}.{name}", f"{path}.{ea}.{name}", None, transpose=input_major, interleaved=interleaved,
                       dead_experts=dead),
             ParamView(f"{path}.{ea}.down_proj", f"{path}.{ea}.down_proj", None, transpose=input_major)]
    bias_fn = None
    if biases is not None:
        bi, bo = biases
        views += [ParamView(f"{path}.{ea}.{name}_bias", f"{path}.{ea}.{name}_bias", None, interleaved=interleaved),
                  ParamView(f"{path}.{ea}.down_proj_bias", f"{path}.{ea}.down_proj_bias", None)]
        bias_fn = (lambda: (bi, bo)) if not interleaved else (lambda: (canon_in(bi).detach().contiguous(), bo))
    return ExpertVariant(ExpertsSpec(*spec_args), tuple(views), weights, bias_fn)


def _fused(path: str, ex: nn.Module, n: int, d: int, ea: str = "experts", dead: int = 0) -> list[ExpertVariant] | None:
    """Fused 3-D experts: gated ``gate_up_proj`` or ungated ``up_proj``, with ``down_proj``, optional
    ``*_bias`` [N, F] / [N, d]; output- or input-major; gate/up halves or alternating columns. Every
    reading the shapes and attributes allow, most likely first: the probe keeps the first that
    reproduces the block."""
    gated = isinstance(getattr(ex, "gate_up_proj", None), nn.Parameter)
    name = "gate_up_proj" if gated else "up_proj"
    wi, dn = getattr(ex, name, None), getattr(ex, "down_proj", None)
    if not (isinstance(wi, nn.Parameter) and isinstance(dn, nn.Parameter) and wi.dim() == 3 and dn.dim() == 3):
        return None
    where = f"{path}.{ea}"
    bias_names = (f"{name}_bias", "down_proj_bias")
    extra = [p for p, _ in ex.named_parameters() if p not in (name, "down_proj", *bias_names)]
    if extra:
        raise UnsupportedFeatureError(f"{where}: expert parameters {extra} are not supported")
    bi, bo = (getattr(ex, b, None) for b in bias_names)
    if (bi is None) != (bo is None):
        raise UnsupportedFeatureError(f"{where}: one expert bias without the other ({bias_names}) is not supported")
    variants = []
    for input_major, h in _fused_layouts(where, wi, dn, n, d, 2 if gated else 1, name, dead):
        f = 2 * h if gated else h
        if bi is not None and (tuple(bi.shape), tuple(bo.shape)) != ((n, f), (n, d)):
            raise RecognitionError(f"{where}: expert biases {bias_names} have shapes {tuple(bi.shape)}, "
                                   f"{tuple(bo.shape)}; expected [{n}, {f}], [{n}, {d}]")
        for act, params in fused_activations(ex, where):
            for interleaved in (False, True) if gated else (False,):
                args = (n, d, h, act, gated, "fused", params, bi is not None)
                variants.append(_fused_variant(path, ea, wi, dn, (bi, bo) if bi is not None else None, args,
                                               input_major, interleaved))
    return variants


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


FLAT_TRIPLES = (("w1", "v1", "w2"),) + GATED_TRIPLES


def _flat_stacked(path: str, ex: nn.Module, n: int, d: int, ea: str = "experts"):
    """Experts flattened into 2-D rows, held by the experts module or one child (DBRX's ``experts.mlp``):
    gate and up ``[N·h, d]``, down ``[N·h, d]`` (input-major) or ``[N·d, h]`` (output-major)."""
    for prefix, holder in (("", ex), *((f"{k}.", m) for k, m in ex.named_children())):
        params = dict(holder.named_parameters(recurse=False))
        group = next((g for g in FLAT_TRIPLES if set(params) == set(g) and all(params[k].dim() == 2 for k in g)), None)
        if group is None:
            continue
        where = f"{path}.{ea}{'.' + prefix[:-1] if prefix else ''}"
        g, u, dn = (params[k] for k in group)
        if g.shape[0] % n or g.shape[1] != d or u.shape != g.shape:
            raise RecognitionError(f"{where}: flattened expert weights {group} of shapes "
                                   f"{[tuple(p.shape) for p in (g, u, dn)]} do not split into {n} experts of width d={d}")
        h = g.shape[0] // n
        if tuple(dn.shape) == (n * h, d):
            input_major = True
        elif tuple(dn.shape) == (n * d, h):
            input_major = False
        else:
            raise RecognitionError(f"{where}.{group[2]}: shape {tuple(dn.shape)} is neither [N·h, d] nor [N·d, h]")
        name = f"{path}.{ea}.{prefix}"
        canon_in, canon_out = f"{path}.{ea}.gate_up_proj", f"{path}.{ea}.down_proj"
        views = (ParamView(name + group[0], canon_in, None, (0, h), flat=True),
                 ParamView(name + group[1], canon_in, None, (h, 2 * h), flat=True),
                 ParamView(name + group[2], canon_out, None, transpose=input_major, flat=True))

        def weights(g=g, u=u, dn=dn, h=h, input_major=input_major):
            w_out = dn.view(n, h, d).transpose(1, 2) if input_major else dn.view(n, d, h)
            return torch.cat([g.view(n, h, d), u.view(n, h, d)], 1).detach(), w_out.detach().contiguous()

        spec = ExpertsSpec(n, d, h, find_activation((holder, ex), where), True, "stacked")
        return spec, views, weights
    return None
