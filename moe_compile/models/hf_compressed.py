"""Compressed attention under context parallelism: DeepSeek-V4's CSA and HCA layers.

DeepSeek-V4's attention layers attend over a sliding window of the sequence's keys (its K = V latents)
followed by compressed entries: each window of m tokens (HCA: m' tokens, no overlap; CSA: m tokens,
each entry also reading the previous window's half) pooled into one entry by a learned softmax gate,
which query t may read once its window has closed (t + 1 ≥ (w + 1)·m). CSA's lightning indexer then
keeps each query's top-k entries, pooled the same way at its own width. The module's ``compressor``
projects the hidden states it is given (``kv_proj``, ``gate_proj``; its indexer's likewise), pools
their windows and builds the per-query mask over the entries (``block_bias``) for the queries it is
given, so on a sequence shard it would pool this rank's tokens only, in windows that start at the
shard, not at the sequence.

Under cp > 1, while compiled, the attention module runs as an indexed one does (models/hf_indexed.py):
its sliding keys come from ``cache.update`` as the whole sequence's, its boolean mask as this shard's
queries over the whole sequence (moe_cp::whole_mask, with the config's window; where transformers made
no mask, an all-true one stands in, else the module would skip its entries' mask). Its compressor keeps
this shard's queries, and only the projections it pools come whole:

    kv_proj, gate_proj outputs (the compressor's and its indexer's) → moe_cp::whole_sequence
    block_bias [B, 1, S/cp, T]                                     → a boolean mask (True: attend) beside
                                                                     the model's boolean one

so every rank pools the dense model's T entries, and the indexer scores and picks them for this shard's
queries only (its O(S·T) scores, the quadratic part, divide by cp, as the attention's do). Exact in
forward and backward (the gathered projections' gradients are reduce-scattered back). What does not
divide by cp: the gathered projections and the pooling over them (O(S) per rank), and the whole
sliding keys (not a halo of one window). Run eagerly (not being compiled), the modules run as they were.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

# config.layer_types entries of DeepSeek-V4's compressed layers (sliding window + compressed entries)
COMPRESSED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")
_COMPRESSOR_ARGS = ("hidden_states", "q_residual", "position_ids", "cache")
PROJECTIONS = ("kv_proj", "gate_proj")  # what a compressor (and its indexer) pools, per token


def compressed_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules of DeepSeek-V4's form: a forward taking ``cache`` and a ``compressor`` child
    (None on its sliding layers) whose forward takes hidden_states, q_residual, position_ids and cache,
    and which (and its ``indexer``, if any) holds the projections it pools as Linear children
    (PROJECTIONS). Any other compressor would pool the shard: its layers stay refused."""
    def pools(owner) -> bool:
        return all(isinstance(getattr(owner, p, None), nn.Linear) for p in PROJECTIONS)

    def v4(m: nn.Module) -> bool:
        c = getattr(m, "compressor", None)
        return isinstance(c, nn.Module) and "cache" in inspect.signature(m.forward).parameters \
            and set(_COMPRESSOR_ARGS) <= set(inspect.signature(c.forward).parameters) and pools(c) \
            and (getattr(c, "indexer", None) is None or pools(c.indexer))

    return [(name, m) for name, m in model.named_modules() if v4(m)]


def _a_mask(m: nn.Module, args: tuple, kwargs: dict):
    """Attention pre-hook while compiled (before models/hf_indexed.py's): transformers makes no mask where
    plain causal attention would do (no padding, a window longer than the sequence), and the module then
    skips its entries' mask; it gets an all-true one, which the CP pass replaces with the whole sequence's
    causal mask (moe_cp::whole_mask)."""
    if not torch.compiler.is_compiling():
        return None
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    if bound.arguments.get("attention_mask") is not None:
        return None
    b, shard = bound.arguments["hidden_states"].shape[:2]
    bound.arguments["attention_mask"] = torch.ones((b, 1, shard, shard), dtype=torch.bool,
                                                   device=bound.arguments["hidden_states"].device)
    return bound.args[1:], bound.kwargs


def _no_cache(m: nn.Module, args: tuple, kwargs: dict):
    """Compressor pre-hook while compiled: no cache (the attention's cache argument is the whole-sequence
    hooks' of models/hf_indexed.py, not a transformers cache)."""
    if not torch.compiler.is_compiling():
        return None
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    bound.arguments["cache"] = None
    return bound.args[1:], bound.kwargs


def _boolean_bias(m: nn.Module, args: tuple, kwargs: dict, out):
    """Compressor hook while compiled: its entries' mask as a boolean one (the model concatenates it, cast
    to its mask's dtype, beside the boolean whole-sequence mask: cast from 0 / −inf it would invert)."""
    if not torch.compiler.is_compiling() or out[1] is None:  # (None: no window closed yet)
        return None
    return out[0], out[1] == 0


def _whole_projection(m: nn.Module, args: tuple, out: torch.Tensor):
    """Projection hook while compiled: the whole sequence's projected tokens, in sequence order."""
    if not torch.compiler.is_compiling():
        return None
    return torch.ops.moe_cp.whole_sequence(out, 1, m._moe_cp_compressed)


def use_compressed_attention(model: nn.Module, cp: int) -> list[str]:
    """Make each compressed attention module of ``model`` see the whole sequence's keys and compressed
    entries when compiled at ``cp`` > 1 (module docstring); the module paths it changed."""
    from .hf_indexed import whole_sequence_keys

    paths = []
    for path, m in compressed_attention_modules(model):
        if getattr(m, "_moe_cp_whole", None) is None:  # (registered before whole_sequence_keys' hook)
            m.register_forward_pre_hook(_a_mask, with_kwargs=True)
        whole_sequence_keys(m, cp, path)
        c = m.compressor
        if getattr(c, "_moe_cp_compressed", None) is None:
            c.register_forward_pre_hook(_no_cache, with_kwargs=True)
            c.register_forward_hook(_boolean_bias, with_kwargs=True)
        c._moe_cp_compressed = cp
        for owner in (c, c.indexer) if getattr(c, "indexer", None) is not None else (c,):
            for name in PROJECTIONS:
                proj = getattr(owner, name)
                if getattr(proj, "_moe_cp_compressed", None) is None:
                    proj.register_forward_hook(_whole_projection)
                proj._moe_cp_compressed = cp
        paths.append(path)
    return paths
