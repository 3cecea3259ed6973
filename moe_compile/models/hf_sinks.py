"""Attention sinks under context parallelism: a transformers attention implementation over
``moe_cp::sink_attention`` (ops/sink_attention.py).

GPT-OSS, Flint, GraniteMoE-SWA and MiMo-V2-Flash declare ``_supports_sdpa=False`` (SDPA has no sink
argument) and run an eager matmul-softmax form that the context-parallel pass cannot read. Under cp > 1
moe_compile registers this implementation with transformers' AttentionInterface (its masks as SDPA's:
boolean, or none for plain causal) and switches the model to it: the same arithmetic as one node, which
the pass shards as it shards SDPA. Indexed attention with sinks (HY-V4) hands this implementation its
indexer's top-k picks as ``indices`` (it masks by itself for eager and SDPA only): they are masked here. The sinks are read from the module, as the eager forms read them; a
layer without (MiMo-V2-Flash's full-attention layers) runs transformers' SDPA function.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import UnsupportedFeatureError

NAME = "moe_cp_sinks"
SINK_NAMES = ("sinks", "attn_sinks")


def sink_parameter(model: nn.Module) -> str | None:
    """The first parameter named as attention sinks, or None."""
    return next((n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in SINK_NAMES), None)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    indices = kwargs.pop("indices", None)
    if indices is not None:  # indexed attention (HY-V4) hands a kernel other than eager/SDPA its top-k picks
        picked = torch.zeros((*query.shape[:1], query.shape[2], key.shape[2]), dtype=torch.bool, device=query.device)
        picked = picked.scatter(-1, indices.long(), True).unsqueeze(1)
        attention_mask = picked if attention_mask is None else attention_mask & picked
    sinks = getattr(module, "sinks", None)
    if sinks is None:
        if isinstance(getattr(module, "attn_sinks", None), torch.Tensor):
            raise UnsupportedFeatureError(f"{type(module).__name__}: attention sinks held as `attn_sinks` under "
                                          "context parallelism: only a `sinks` parameter is read; use cp=1")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise UnsupportedFeatureError(f"{type(module).__name__}: attention dropout {dropout} under context "
                                      "parallelism; use cp=1 or attention_dropout=0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = torch.ops.moe_cp.sink_attention(query, key, value, sinks, attention_mask, is_causal, scale)
    return out.transpose(1, 2).contiguous(), None


def use_sink_attention(model: nn.Module) -> bool:
    """Switch a transformers model with attention sinks to :data:`NAME`; False (nothing done) for any other."""
    if getattr(model, "_supports_sdpa", True) is not False or sink_parameter(model) is None \
            or not hasattr(model, "set_attn_implementation"):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
