"""Compressed attention under context parallelism: DeepSeek-V4's CSA and HCA layers.

DeepSeek-V4's attention layers attend over a sliding window of the sequence's keys (its K = V latents)
followed by compressed entries: each window of m tokens (HCA: m' tokens, no overlap; CSA: m tokens,
each entry also reading the previous window's half) pooled into one entry by a learned softmax gate,
which query t may read once its window has closed (t + 1 ≥ (w + 1)·m). CSA's lightning indexer then
keeps each query's top-k entries. The module's ``compressor`` builds those entries and the per-query
mask over them (``block_bias``) from the hidden states it is given, so on a sequence shard it would pool
and pick over this rank's tokens only (its windows would also start at the shard, not the sequence).

Under cp > 1, while compiled, the attention module runs as an indexed one does (models/hf_indexed.py):
its sliding keys come from ``cache.update`` as the whole sequence's, its boolean mask as this shard's
queries over the whole sequence (moe_cp::whole_mask, with the config's window), and its compressor runs
on the whole sequence:

    hidden_states, q_residual, position_ids → moe_cp::whole_sequence (in sequence order), no cache
    block_bias [B, 1, S, T]                 → moe_cp::own_tokens (this shard's queries), as a boolean
                                              mask (True: attend) beside the model's boolean one

so its windows, gates, indexer scores and picks are the dense model's, and the attention reads this
shard's queries over S + T keys (the CP pass leaves that call as it is). Exact in forward and backward
(the gathered inputs' gradients are reduce-scattered back). The cost is not sharded for the compressor:
every rank of the CP group pools all S tokens and scores all S queries against the T entries (CSA's
indexer, O(S·T) per rank); the sliding keys are gathered whole (not a halo of one window). The
attention itself, the MoE and the MLP layers stay sharded. Run eagerly (not being compiled), the
modules run as they were.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

# config.layer_types entries of DeepSeek-V4's compressed layers (sliding window + compressed entries)
COMPRESSED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")
_COMPRESSOR_ARGS = ("hidden_states", "q_residual", "position_ids", "cache")


def compressed_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules of DeepSeek-V4's form: a forward taking ``cache`` and a ``compressor`` child
    (None on its sliding layers) whose forward takes hidden_states, q_residual, position_ids and cache."""
    def v4(m: nn.Module) -> bool:
        c = getattr(m, "compressor", None)
        return isinstance(c, nn.Module) and "cache" in inspect.signature(m.forward).parameters \
            and set(_COMPRESSOR_ARGS) <= set(inspect.signature(c.forward).parameters)

    return [(name, m) for name, m in model.named_modules() if v4(m)]


def _whole(x: torch.Tensor, cp: int) -> torch.Tensor:
    return torch.ops.moe_cp.whole_sequence(x, 1, cp)


def _before(m: nn.Module, args: tuple, kwargs: dict):
    """Compressor pre-hook: the whole sequence's inputs, no cache, while being compiled."""
    if not torch.compiler.is_compiling():
        return None
    cp = m._moe_cp_compressed
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    for name in _COMPRESSOR_ARGS[:3]:
        bound.arguments[name] = _whole(bound.arguments[name], cp)
    bound.arguments["cache"] = None  # (the attention's cache argument: models/hf_indexed._WholeSequence)
    return bound.args[1:], bound.kwargs


def _after(m: nn.Module, args: tuple, kwargs: dict, out):
    """Compressor hook: the whole sequence's entries; their mask for this shard's queries, boolean (the
    model concatenates it, cast to its mask's dtype, beside the boolean whole-sequence mask)."""
    if not torch.compiler.is_compiling():
        return None
    entries, bias = out
    if bias is None:  # no window closed yet
        return out
    return entries, torch.ops.moe_cp.own_tokens(bias, 2, m._moe_cp_compressed) == 0


def use_compressed_attention(model: nn.Module, cp: int) -> list[str]:
    """Make each compressed attention module of ``model`` see the whole sequence's keys and compressed
    entries when compiled at ``cp`` > 1 (module docstring); the module paths it changed."""
    from .hf_indexed import whole_sequence_keys

    paths = []
    for path, m in compressed_attention_modules(model):
        whole_sequence_keys(m, cp, path)
        c = m.compressor
        if getattr(c, "_moe_cp_compressed", None) is None:
            c.register_forward_pre_hook(_before, with_kwargs=True)
            c.register_forward_hook(_after, with_kwargs=True)
        c._moe_cp_compressed = cp
        paths.append(path)
    return paths
