"""Indexed attention under context parallelism: DeepSeek-V3.2's sparse attention (DSA) and its copies.

DeepSeek-V3.2, GLM-MoE-DSA, HY-V4, AXK2 and Dots3-Note's indexed layers pick, per query, the top-k keys
of a lightweight indexer and mask the rest: the attention module builds that mask itself, as wide as the
keys it holds, before it calls SDPA. On a sequence shard those are this rank's keys only, and the CP pass
cannot widen the mask afterwards (the top-k is taken over the shard's keys). So under cp > 1 each such
module runs its own forward with the whole sequence's keys from the start, through the two hooks
transformers gives a KV cache (``cache.update`` for the attention's latents, ``cache.update_indexer`` for
the indexer's keys) and its ``attention_mask`` argument:

    latents, indexer keys → moe_cp::whole_sequence (the CP pass: all-gathered, in sequence order)
    attention_mask        → moe_cp::whole_mask (the CP pass: the whole sequence's causal mask)

The indexer then scores and picks over all S keys as on one device, and its index mask and the SDPA call
come out whole; the pass leaves that SDPA as it is. Keys stay in sequence order so that top-k meets ties
(ReLU scores of 0) in the order the dense model does. Run eagerly (not being compiled, e.g. the pipeline
split's probe forward), the module runs as it was.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from ..errors import UnsupportedFeatureError


def indexed_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules of the DSA form: an ``indexer`` attribute and a forward that takes ``cache``,
    the indexer a module with ``index_topk``, or None on a layer that reuses the previous layer's picks
    (its forward takes ``prev_topk_indices``; None without is plain attention: Dots3-Note's sliding layers);
    and those of the QSA form (Qwen4-Exp: its indexer pools blocks of keys, models/hf_qsa.py), whose cache
    hooks ``update`` (keys, values) and ``update_indexer`` are those of the DSA form."""
    from .hf_qsa import QSA_ATTRS

    def dsa(m: nn.Module) -> bool:
        if not hasattr(m, "indexer"):
            return False
        params = inspect.signature(m.forward).parameters
        if "attention_mask" not in params:  # not attention: DeepSeek-V4's CSA compressor (models/hf_compressed.py)
            return False
        if m.indexer is not None and all(hasattr(m.indexer, a) for a in QSA_ATTRS):
            return "cache" in params
        return "cache" in params and (hasattr(m.indexer, "index_topk") if m.indexer is not None
                                      else "prev_topk_indices" in params)

    found = [(name, m) for name, m in model.named_modules() if dsa(m)]
    return found if any(m.indexer is not None for _, m in found) else []


class _WholeSequence:
    """The KV-cache hooks the DSA modules call, answering with the whole sequence's keys (stored in the
    model's own cache too, when the forward was given one)."""

    def __init__(self, cp: int, cache=None):
        self.cp, self.cache = cp, cache

    def update(self, k_pass: torch.Tensor, k_rot: torch.Tensor, layer_idx: int, **kw):
        k_pass, k_rot = torch.ops.moe_cp.whole_sequence(k_pass, 2, self.cp), torch.ops.moe_cp.whole_sequence(k_rot, 2, self.cp)
        return (k_pass, k_rot) if self.cache is None else self.cache.update(k_pass, k_rot, layer_idx, **kw)

    def update_indexer(self, k: torch.Tensor, layer_idx: int) -> torch.Tensor:
        k = torch.ops.moe_cp.whole_sequence(k, 1, self.cp)
        return k if self.cache is None else self.cache.update_indexer(k, layer_idx)


def _whole_sequence(m: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: while being compiled, the module's ``attention_mask`` and ``cache`` arguments
    become the whole sequence's (module docstring); eagerly, they stay as given."""
    if not torch.compiler.is_compiling():
        return None
    cp, path = m._moe_cp_whole
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    mask, cache = bound.arguments.get("attention_mask"), bound.arguments.get("cache")
    if cache is not None and cache.get_seq_length(getattr(m, "layer_idx", 0)) > 0:
        raise UnsupportedFeatureError(f"{path}: a KV cache holding earlier tokens under context parallelism "
                                      f"(cp={cp}): only whole sequences are sharded; use cp=1 to decode")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise UnsupportedFeatureError(
            f"{path}: indexed attention under context parallelism (cp={cp}) needs the boolean mask of "
            f"transformers' SDPA implementation, got {None if mask is None else mask.dtype}; use "
            "attn_implementation='sdpa' or cp=1")
    bound.arguments["attention_mask"] = torch.ops.moe_cp.whole_mask(mask, cp)
    bound.arguments["cache"] = _WholeSequence(cp, cache)
    return bound.args[1:], bound.kwargs


def whole_sequence_keys(m: nn.Module, cp: int, path: str) -> None:
    """While compiled at ``cp`` > 1, attention module ``m`` gets the whole sequence's keys from its cache
    hooks and its boolean mask for them (module docstring; DeepSeek-V4's compressed layers too:
    models/hf_compressed.py)."""
    if getattr(m, "_moe_cp_whole", None) is None:
        m.register_forward_pre_hook(_whole_sequence, with_kwargs=True)
    m._moe_cp_whole = (cp, path)


def use_indexed_attention(model: nn.Module, cp: int) -> list[str]:
    """Make each DSA attention module of ``model`` see the whole sequence's keys when compiled at ``cp`` > 1
    (module docstring); the module paths it changed."""
    paths = []
    for path, m in indexed_attention_modules(model):
        whole_sequence_keys(m, cp, path)
        if m.indexer is not None and hasattr(m.indexer, "block_topk"):  # QSA: rotates pooled keys at their positions
            m.indexer._moe_cp_positions = cp
        paths.append(path)
    return paths
