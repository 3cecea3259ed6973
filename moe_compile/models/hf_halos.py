"""Modules that read a few tokens back, under context parallelism: each chunk runs with its halo.

Zaya's compressed convolutional attention (``ZayaCCAProjection``) projects queries, keys and values token
by token, but mixes queries and keys with two causal convolutions over the sequence (after padding
k₀ + k₁ − 2 zeros in front, then unpadded convolutions, the second one grouped by head) and takes half of
each value head from the token before. Its outputs for a token read that token and the ``reach`` =
max(k₀ + k₁ − 2, 1) before it. Under cp > 1 a rank holds chunks r and 2cp−1−r of 2cp, and the tokens
before each lie on another rank (or, for the second chunk, are not the first chunk's last ones), so the
module, while compiled, runs on each chunk with its halo in front, the two stacked along the batch:

    hidden_states, conv_mask [B, S/cp, …] → moe_cp::with_halos → [2B, reach + S/2cp, …]
    each output [2B, reach + S/2cp, …]    → its last S/2cp tokens, the two chunks back side by side

The CP pass fills the marker in (each chunk's last ``reach`` tokens sent to the neighbouring rank that
needs them, moe_cp::halo_exchange; zeros before chunk 0). Exact where the module's own front padding equals a zero input: it pads the
projected queries and keys with zeros, which a zero hidden state gives only without projection biases
(refused with them), and its first delayed value is the delayed projection of a zero state, as here.
Backward sends the halos' gradient back to the ranks that hold those tokens. A fresh cache (transformers
makes one in training too) is left out of the module's call, so it keeps none of this layer's states.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from ..errors import UnsupportedFeatureError


def _reach(m: nn.Module) -> int:
    return max(int(m.conv_kernel_size), 1)


HALO_MODULES = {"ZayaCCAProjection": _reach}  # class name → the tokens before its own that a token's outputs read


def halo_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Path → module of each module of ``model`` that runs with halos under CP."""
    return {p: m for p, m in model.named_modules() if type(m).__name__ in HALO_MODULES}


def _haloed(x, shard: int, reach: int, cp: int):
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != shard:
        return x
    if x.dtype == torch.bool:  # gloo gathers no bool
        return torch.ops.moe_cp.with_halos(x.to(torch.uint8), reach, cp).bool()
    return torch.ops.moe_cp.with_halos(x, reach, cp)


def _before(m: nn.Module, args: tuple, kwargs: dict):
    if not torch.compiler.is_compiling():
        return None
    cp, path, reach = m._moe_cp_halo
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    cache = bound.arguments.get("cache")
    if cache is not None:
        # transformers makes a fresh cache in training too: it holds nothing of this layer yet, and the
        # module runs as without one (zero front padding). States from an earlier call would be the
        # tokens before the sequence, which the halos do not carry.
        held = [getter(m.layer_idx, state_idx=0) for getter in (cache.get_conv_state, cache.get_recurrent_state)]
        if any(h is not None for h in held):
            raise UnsupportedFeatureError(
                f"{path}: a cache that holds this layer's states from an earlier call under context parallelism "
                f"(cp={cp}): each chunk's halo starts the sequence afresh; call the model without a cache")
        bound.arguments["cache"] = None
    shard = bound.arguments["hidden_states"].shape[1]
    for name, value in list(bound.arguments.items()):
        if name != "self":
            bound.arguments[name] = _haloed(value, shard, reach, cp)
    return bound.args[1:], bound.kwargs


def _own(y, reach: int):
    """[2B, reach + c, …] → [B, 2c, …]: the chunks' own tokens, side by side again."""
    if not isinstance(y, torch.Tensor):
        return y
    pair = y[:, reach:].unflatten(0, (2, -1))
    return torch.cat([pair[0], pair[1]], 1)


def _after(m: nn.Module, args: tuple, kwargs: dict, out):
    if not torch.compiler.is_compiling():
        return None
    reach = m._moe_cp_halo[2]
    return tuple(_own(y, reach) for y in out) if isinstance(out, tuple) else _own(out, reach)


def use_halo_modules(model: nn.Module, cp: int) -> list[str]:
    """Run each module of HALO_MODULES on its chunks with their halos when compiled at ``cp`` > 1 (module
    docstring); their paths."""
    for path, m in halo_modules(model).items():
        biased = [n for n, p in m.named_parameters() if n.endswith("bias") and ("q_proj" in n or "k_proj" in n)]
        if biased:
            raise UnsupportedFeatureError(
                f"{path}: projection biases ({', '.join(biased)}) under context parallelism (cp={cp}): the module "
                "pads its projected queries and keys with zeros in front of the sequence, which the zero halo "
                "before the first chunk gives only without biases; use cp=1")
        if getattr(m, "_moe_cp_halo", None) is None:
            m.register_forward_pre_hook(_before, with_kwargs=True)
            m.register_forward_hook(_after, with_kwargs=True)
        m._moe_cp_halo = (cp, path, HALO_MODULES[type(m).__name__](m))
    return list(halo_modules(model))
