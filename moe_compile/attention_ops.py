"""The attention calls a captured graph may hold, and where their arguments are.

A rank's graph calls ``F.scaled_dot_product_attention`` (or, for attention with sinks under context
parallelism, ``moe_cp::sink_attention``). ``moe-compile explain`` captures on the meta
device, where SDPA would take its math path and save the [B, H, S, S] probabilities no fused kernel
keeps, so it traces a fused kernel in SDPA's place (explain._fused_attention): the CPU flash kernel
where it takes the call, else the memory-efficient kernel a GPU rank runs (an additive bias that needs a
gradient, value heads narrower than the query's: MLA). The context-parallel pass rewrites all four
forms and the ledger reads its attention shapes from them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops  # noqa: F401  (registers moe_cp::sink_attention)
from .errors import UnsupportedFeatureError

_aten = torch.ops.aten
SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
FLASH_CPU = (_aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_flash_attention_for_cpu.default)
EFFICIENT = (_aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_efficient_attention.default)
FUSED = FLASH_CPU + EFFICIENT
# attention with sinks (GPT-OSS & co. under context parallelism: models/hf_sinks.py)
SINKS = (torch.ops.moe_cp.sink_attention, torch.ops.moe_cp.sink_attention.default)
ATTENTION = SDPA + FUSED + SINKS

# positional argument names per form (keyword-only ones after them: scale, and attn_mask for flash_cpu)
_POSITIONAL = {
    "sdpa": ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
    "flash_cpu": ("query", "key", "value", "dropout_p", "is_causal"),
    "efficient": ("query", "key", "value", "attn_mask", "compute_log_sumexp", "dropout_p", "is_causal"),
    "sinks": ("query", "key", "value", "sinks", "attn_mask", "is_causal", "scale"),
}
_KEYWORD = {"sdpa": {}, "flash_cpu": {"attn_mask": "attn_mask"}, "efficient": {"attn_mask": "attn_bias"},
            "sinks": {}}


def form(target: object) -> str | None:
    return "sdpa" if target in SDPA else "flash_cpu" if target in FLASH_CPU else "efficient" if target in EFFICIENT \
        else "sinks" if target in SINKS else None


def attention_arg(n: torch.fx.Node, name: str, default=None):
    """Argument ``name`` (SDPA's names: query, key, value, attn_mask, dropout_p, is_causal, scale,
    enable_gqa) of an attention node of any form."""
    f = form(n.target)
    key = _KEYWORD[f].get(name, name)
    if key in n.kwargs:
        return n.kwargs[key]
    pos = _POSITIONAL[f]
    if name in pos and pos.index(name) < len(n.args):
        return n.args[pos.index(name)]
    return default


def efficient_attention(query, key, value, attn_mask=None, is_causal=False, scale=None) -> torch.Tensor:
    """SDPA through the memory-efficient kernel (what it saves: output and log-sum-exp): fewer K/V heads
    repeated to the query's, a boolean mask made additive as SDPA makes it."""
    if key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(attn_mask.logical_not(), float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
    return _aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, True, 0.0, is_causal,
                                                         scale=scale)[0]


def no_sdpa_form(where: str, sinks: bool, mesh: str) -> UnsupportedFeatureError:
    """The refusal under context parallelism of attention without an SDPA form: a transformers model that
    declares ``_supports_sdpa=False`` and holds no sinks, or attention with sinks computed eagerly in a
    model of the user's own (transformers' models with sinks run ``moe_cp::sink_attention``:
    models/hf_sinks.py)."""
    if sinks:
        return UnsupportedFeatureError(
            f"{where}: attention with sinks (a learned per-head logit beside the keys) computed as matmul-softmax "
            f"under context parallelism ({mesh}): only scaled_dot_product_attention and moe_cp::sink_attention are "
            "sharded (K/V gathered over the CP group); call torch.ops.moe_cp.sink_attention(q, k, v, sinks, "
            "attn_mask, is_causal, scale) in the attention, or use cp=1")
    return UnsupportedFeatureError(
        f"{where}: attention (the model declares _supports_sdpa=False, so it has no scaled_dot_product_attention "
        f"form) under context parallelism ({mesh}): only SDPA attention is sharded (K/V gathered over the CP "
        "group); use cp=1")
