"""Attention with sinks as one op (namespace ``moe_cp``), so that context parallelism can shard it:

    moe_cp::sink_attention(q, k, v, sinks, attn_mask, is_causal, scale) → [B, H, Sq, Dv]

Each head h scores its queries against the keys and against one learned logit ``sinks[h]`` that attends
to nothing: softmax over [q·kᵀ·scale (masked), sinks[h]], the sink's column dropped, times V. That is
the attention of GPT-OSS, Flint, GraniteMoE-SWA and MiMo-V2-Flash (transformers' eager forms; GraniteMoE-SWA
writes the same thing as a sigmoid(lse − sink) scale). SDPA has no sink argument, so transformers runs
them eagerly, as matmul-softmax graphs the context-parallel pass cannot read; as one node the pass gathers
K/V and gives it the whole sequence's mask, as it does for SDPA (passes/context_parallel.py).

K/V may have fewer heads than Q (GQA: each K/V head serves H/Hkv query heads) and V another head size
(MiMo-V2-Flash). The mask is boolean (True: attend) or additive, broadcast to [B, H, Sq, Sk]; without
one, ``is_causal`` is SDPA's top-left causal mask. Scores and softmax run in fp32 at least (as Flint's and MiMo's
forms; fp32 models compute exactly what every form computes). Backward recomputes the probabilities
from the saved inputs (nothing [Sq, Sk] is saved, as with a fused SDPA kernel).
"""

from __future__ import annotations

import torch


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)


def _probs(q, k, sinks, attn_mask, is_causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(P over the keys [B, H, Sq, Sk], the sink's share [B, H, Sq]) in fp32 (or fp64)."""
    heads, acc = q.shape[-3], _acc(q)
    logits = torch.matmul(q.to(acc), _expand_heads(k, heads).to(acc).transpose(-1, -2)) * scale
    if attn_mask is not None:
        logits = logits.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool \
            else logits + attn_mask.to(acc)
    elif is_causal:
        sq, sk = logits.shape[-2:]
        logits = logits.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril().logical_not(),
                                    float("-inf"))
    sink = sinks.to(acc).view(1, heads, 1, 1).expand(*logits.shape[:-1], 1)
    p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)  # the sink keeps every row finite
    return p[..., :-1], p[..., -1]


@torch.library.custom_op("moe_cp::sink_attention", mutates_args=())
def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor,
                   attn_mask: torch.Tensor | None, is_causal: bool, scale: float) -> torch.Tensor:
    p, _ = _probs(query, key, sinks, attn_mask, is_causal, scale)
    return torch.matmul(p.to(value.dtype), _expand_heads(value, query.shape[-3]))


@sink_attention.register_fake
def _(query, key, value, sinks, attn_mask, is_causal, scale):
    return value.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.custom_op("moe_cp::sink_attention_backward", mutates_args=())
def sink_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            sinks: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention's backward with the sink as one more column: dS = P∘(dP − D), D = Σ_j P_j·dP_j,
    and the sink's gradient −p_sink·D summed over batch and queries (its value is zero)."""
    heads, kv_heads = query.shape[-3], key.shape[-3]
    p, p_sink = _probs(query, key, sinks, attn_mask, is_causal, scale)
    g = grad.to(p.dtype)
    v = _expand_heads(value, heads).to(p.dtype)
    dp = torch.matmul(g, v.transpose(-1, -2))
    d = (p * dp).sum(-1, keepdim=True)
    ds = p * (dp - d)
    dq = torch.matmul(ds, _expand_heads(key, heads).to(p.dtype)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), query.to(p.dtype)) * scale
    dv = torch.matmul(p.transpose(-1, -2), g)
    if kv_heads != heads:  # each K/V head's gradient: the sum over the query heads it served
        dk = dk.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)
        dv = dv.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)
    dsinks = -(p_sink * d.squeeze(-1)).movedim(-2, 0).reshape(heads, -1).sum(-1)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), dsinks.to(sinks.dtype)


@sink_attention_backward.register_fake
def _(grad, query, key, value, sinks, attn_mask, is_causal, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), \
        sinks.new_empty(sinks.shape)


def _setup(ctx, inputs, output):
    query, key, value, sinks, attn_mask, is_causal, scale = inputs
    ctx.save_for_backward(query, key, value, sinks, attn_mask)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad):
    query, key, value, sinks, attn_mask = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.moe_cp.sink_attention_backward(grad, query, key, value, sinks, attn_mask,
                                                                  ctx.is_causal, ctx.scale)
    return dq, dk, dv, dsinks, None, None, None


sink_attention.register_autograd(_backward, setup_context=_setup)
