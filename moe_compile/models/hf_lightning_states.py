"""MiniMax's lightning attention under context parallelism, sharded: the ranks pass states.

Lightning attention is linear attention with one decay per head: with λ = exp(−slope), the state after token
t is S_t = λ·S_{t−1} + k_tᵀv_t and the output o_t = q_t·S_t (transformers computes it in blocks, inside the
module's forward, from a zero state made by ``torch.zeros``). Over a chunk of L tokens

    leaving state = S⁰ + λ^L·S_in          o_t = o⁰_t + λ^(t+1)·q_t·S_in

so the state a chunk leaves from a zero state (the forward's second output) and λ^L summarise it, and a
forward whose ``torch.zeros`` hands back the entering state computes the chunk's outputs exactly.

Under cp > 1 a rank holds chunks r and 2cp−1−r of 2cp. Its mixer, while compiled, runs the module's own
forward twice on the two chunks stacked along the batch: first from zero states, for the states they leave
(only the state recurrence of that call is live: the rest is dead code), then from the states they enter
with, which ``moe_cp::incoming_states`` (diagonal transitions, one column λ^L per head) scans over the CP
group's summaries. Compute and saved activations per rank shrink with cp (the q/k/v projection and the
state recurrence are computed twice). Backward is autograd's through both calls, the scan and its
all-gather, so every chunk gets the gradient that later chunks send back.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
import torch.nn as nn

from .hf_mamba_states import cached_state_error, halves
from .hf_rebind import namespace_copy, rebound

_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def is_lightning_attention(m: nn.Module) -> bool:
    """A MiniMax-style lightning-attention mixer: its decay buffers, and a forward that makes its zero state
    with ``torch.zeros`` and reads a cached one with ``get_linear_cache``."""
    names = inspect.unwrap(type(m).forward).__code__.co_names
    return all(isinstance(getattr(m, b, None), torch.Tensor) for b in _BUFFERS) and {"zeros", "get_linear_cache"} <= set(names)


def _cached_state(cache, layer: int):
    """The state a cache holds for ``layer`` (a fresh cache holds none: None, or an empty placeholder)."""
    get = getattr(cache, "get_linear_cache", None)
    try:
        return None if get is None else get(layer)
    except IndexError:
        return None


def use_lightning_states(m: nn.Module, cp: int, path: str) -> bool:
    """Make lightning-attention mixer ``m`` pass states over the CP group when compiled at ``cp`` > 1
    (module docstring); False (nothing changed) for any other mixer."""
    if not is_lightning_attention(m):
        return False
    fwd = type(m).forward
    entering: dict = {"state": None}  # what the next call's zero state is (None: zeros)

    def zeros(*size, **kwargs):
        state = entering["state"]
        return torch.zeros(*size, **kwargs) if state is None else state.to(kwargs.get("dtype") or state.dtype)

    # the forward with a `torch` whose zeros make the entering state where the forward makes its zero state
    run = rebound(fwd, "_moe_cp_lightning", torch=namespace_copy(vars(torch), "_moe_cp_lightning_torch", zeros=zeros))
    params = inspect.signature(fwd)

    @functools.wraps(fwd)
    def forward(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            return fwd(self, *args, **kwargs)
        bound = params.bind(self, *args, **kwargs)
        cache = bound.arguments.get("cache", bound.arguments.get("kwargs", {}).get("past_key_values"))
        if isinstance(_cached_state(cache, self.layer_idx), torch.Tensor):
            raise cached_state_error(path, cp)
        hidden, mask = bound.arguments["hidden_states"], bound.arguments.get("attention_mask")
        b, s, _ = hidden.shape
        parts = halves(s, path, cp)
        x = torch.cat([hidden[:, p] for p in parts], 0)  # [2B, S/2cp, d]: the two chunks side by side
        pad = None if mask is None else torch.cat([mask[:, p] for p in parts], 0)
        pos = bound.arguments.get("position_embeddings")
        entering["state"] = None
        _, leaving = run(self, x, pos, pad, None)  # [2B, H, dk, dv] from zero states
        length = s // 2
        h, dk = leaving.shape[1], leaving.shape[2]
        decay = torch.exp(-self.slope_rate.float() * length).reshape(1, h, 1, 1).expand(2 * b, h, dk, 1)
        summaries = torch.cat([leaving, decay.to(leaving.dtype)], -1).reshape(2, b, h, dk, -1)
        state = torch.ops.moe_cp.incoming_states(summaries, s, cp, True)  # [2, B, H, dk, dv]
        entering["state"] = state.reshape(2 * b, *state.shape[2:])
        out, leaving = run(self, x, pos, pad, None)
        entering["state"] = None
        if cache is not None:  # as the attention layers' caches hold the shard's keys: its later chunk's state
            cache.set_linear_cache(self.layer_idx, leaving[b:])
        return torch.cat(out.split(b, 0), 1), leaving[b:]

    m.forward = types.MethodType(forward, m)
    return True
