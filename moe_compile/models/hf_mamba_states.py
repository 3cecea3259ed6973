"""Mamba's selective scans under context parallelism, sharded: the state-passing forms of the scans.

A Mamba layer's state decays element by element: Mamba-1 (Jamba's ``mamba_selective_scan``) holds
h [B, I, N] per channel i and state n, h_t = exp(A_in·Δ_it)·h_{t−1} + Δ_it·B_tn·x_it, y_it = Σ_n C_tn·h_tin;
Mamba-2 (``mamba2_chunk_scan``: Nemotron-H, GraniteMoE-Hybrid) holds h [B, H, P, N] per head with one
decay exp(A_h·Δ_th) for the whole head. So over a chunk the state a chunk enters passes through a diagonal
map, and each output gets a term linear in it:

    leaving state = S⁰ + a ⊙ S_in          y_t = y⁰_t + Σ_n C_tn·a_t·S_in[…, n]   (a_t = exp(A·Σ_{≤t} Δ))

y⁰ and S⁰ are the scan itself from a zero state (one call of transformers' own function per chunk); the
decays a_t come from the same discretised Δ (bias, softplus, clamp as the function takes them). The
summaries [2, B, ·, dk, dv + 1] carry the decay as one diagonal column (moe_cp::incoming_states with
``diagonal``), so the CP group gathers states, not [dk, dk] transitions. Installed by
models/hf_state_passing.py, like the delta rules.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from ..errors import UnsupportedFeatureError


def _bind(rule, *args, **kwargs) -> dict:
    """The call's arguments by name, defaults filled in, a ``**kwargs`` catch-all spread out."""
    bound = inspect.signature(inspect.unwrap(rule)).bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    for p in inspect.signature(inspect.unwrap(rule)).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            named.update(named.pop(p.name, {}))
    return named


def halves(s: int, path: str, cp: int) -> tuple[slice, slice]:
    """This rank's two sequence chunks of its shard of ``s`` tokens (shared with the delta rules)."""
    if s % 2:
        raise UnsupportedFeatureError(f"{path}: a shard of {s} tokens under context parallelism (cp={cp}) "
                                      "does not split into its two sequence chunks")
    return slice(0, s // 2), slice(s // 2, s)


def cached_state_error(path: str, cp: int) -> UnsupportedFeatureError:
    """A recurrence handed a state from a cache under CP (shared with the delta rules)."""
    return UnsupportedFeatureError(
        f"{path}: a recurrent state from a cache under context parallelism (cp={cp}): the CP group passes "
        "states between its sequence chunks itself; call the model without a cache")


def _step(dt: torch.Tensor, bias, softplus: bool) -> torch.Tensor:
    """Δ as the scans discretise it: plus the bias, then softplus where asked."""
    dt = dt if bias is None else dt + bias.to(dt.dtype)
    return (F.softplus(dt) if softplus else dt).float()


def mamba1_form(rule, cp: int, path: str):
    """``mamba_selective_scan(x [B, I, S], Δ [B, I, S], A [I, N], B [B, N, S], C [B, N, S], D, z, …)`` on
    this rank's two chunks with the states they enter with."""

    @functools.wraps(rule)
    def run(*args, **kwargs):
        a = _bind(rule, *args, **kwargs)
        want_last = a.pop("return_last_state")
        s = a["hidden_states"].shape[-1]
        bias = a["delta_bias"]
        outs, summaries, terms = [], [], []
        for part in halves(s, path, cp):
            piece = {k: (v[..., part] if k in ("hidden_states", "dt", "B", "C", "z") and v is not None else v)
                     for k, v in a.items()}
            y0, s0 = rule(**piece, return_last_state=True)  # [B, I, s], [B, I, N]
            step = _step(piece["dt"], None if bias is None else bias[..., None], a["delta_softplus"])
            decay = torch.exp(a["A"].float()[None, :, None, :] * step.cumsum(-1)[..., None])  # [B, I, s, N]
            gate = None if piece["z"] is None else F.silu(piece["z"].float())
            outs.append(y0)
            terms.append((decay * piece["C"].float().transpose(1, 2)[:, None], gate))  # C_tn·a_tin
            summaries.append(torch.cat([s0.float()[..., None], decay[:, :, -1, :, None]], -1))  # [B, I, N, 2]
        entering = torch.ops.moe_cp.incoming_states(torch.stack(summaries), s, cp, True)  # [2, B, I, N, 1]
        ys = []
        for i, (y0, (q, gate)) in enumerate(zip(outs, terms)):
            extra = torch.einsum("bitn,bin->bit", q, entering[i, ..., 0])
            ys.append((y0.float() + (extra if gate is None else extra * gate)).to(y0.dtype))
        y = torch.cat(ys, -1)
        if not want_last:
            return y
        last = summaries[1][..., 0] + summaries[1][..., 1] * entering[1, ..., 0]
        return y, last.to(outs[1].dtype)

    return run


def mamba2_form(rule, cp: int, path: str):
    """``mamba2_chunk_scan(x [B, S, H, P], Δ [B, S, H], A [H], B [B, S, G, N], C [B, S, G, N], chunk_size,
    D, dt_bias, initial_states, dt_softplus, dt_limit, return_final_states)`` on this rank's two chunks
    with the states they enter with."""

    @functools.wraps(rule)
    def run(*args, **kwargs):
        a = _bind(rule, *args, **kwargs)
        if a.pop("initial_states") is not None:
            raise cached_state_error(path, cp)
        want_last = a.pop("return_final_states")
        s, h = a["hidden_states"].shape[1:3]
        parts = halves(s, path, cp)
        a["chunk_size"] = min(int(a["chunk_size"]), s // 2)  # a chunk shorter than the scan's: not padded
        lo, hi = a["dt_limit"]
        outs, summaries, terms = [], [], []
        for part in parts:
            piece = {k: (v[:, part] if k in ("hidden_states", "dt", "B", "C") else v) for k, v in a.items()}
            y0, s0 = rule(**piece, return_final_states=True)  # [B, s, H, P], [B, H, P, N]
            step = torch.clamp(_step(piece["dt"], a["dt_bias"], a["dt_softplus"]), min=lo, max=hi)
            decay = torch.exp((a["A"].float() * step).cumsum(1))  # [B, s, H]
            c = piece["C"].float().repeat_interleave(h // piece["C"].shape[2], 2)  # groups → heads
            outs.append(y0)
            terms.append(decay[..., None] * c)  # C_tn·a_th
            summaries.append(torch.cat([s0.float(), decay[:, -1, :, None, None].expand(*s0.shape[:-1], 1)], -1))
        entering = torch.ops.moe_cp.incoming_states(torch.stack(summaries), s, cp, True)  # [2, B, H, P, N]
        y = torch.cat([(y0.float() + torch.einsum("bthn,bhpn->bthp", q, entering[i])).to(y0.dtype)
                       for i, (y0, q) in enumerate(zip(outs, terms))], 1)
        if not want_last:
            return y
        last = summaries[1][..., :-1] + summaries[1][..., -1:] * entering[1]
        return y, last.to(outs[1].dtype)

    return run


def no_fused_path(fused, cp: int, path: str):
    """The fused in-projection + convolution + scan kernel (mamba-ssm, on GPUs) runs the whole layer on
    the shard alone: under CP the layer takes its unfused path, whose convolution and scan are sharded."""

    @functools.wraps(fused)
    def run(*args, **kwargs):
        return None

    return run
