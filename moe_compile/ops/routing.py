"""moe::router — scores, top-k selection and route weights of one MoE block.

    scores  = softmax(logits) | sigmoid(logits) | sqrt(softplus(logits))   (in fp32; the last DeepSeek-V4's)
    select  = scores + bias | logits + bias                (bias: selection only; added to the scores
                                                            (DeepSeek-V3) or to the logits (Kolibri))
    groups  = topk over n_group groups of select, scored by their top-2 sum | max   (n_group > 1)
    idx     = topk(select outside the chosen groups = −inf, K), or the given ``hash_idx`` (hash routing:
              the experts come from a token-id table, DeepSeek-V4's first layers; the scores still weight them)
    weights = scores[idx] (/ Σ_k scores[idx] if renormalize) · scaling

The router's linear projection stays an ordinary dense op; this op is what passes see as the router.
Its backward recomputes the (tiny) score function and applies eager autograd's chain rule by hand.
"""

from __future__ import annotations

import torch


def _route_weights(
    logits: torch.Tensor, idx: torch.Tensor, score_func: str, renormalize: bool, scaling: float
) -> torch.Tensor:
    scores = route_scores(logits, score_func)
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        w = w * scaling
    return w


def route_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if score_func == "sigmoid":
        return torch.sigmoid(logits.float())
    if score_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits.float()).sqrt()
    raise ValueError(f"unknown router score function {score_func!r}; supported: {', '.join(SCORE_FUNCS)}")


SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def group_mask(select: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """select with every expert outside each token's best ``topk_group`` groups set to −inf."""
    t, n = select.shape
    grouped = select.view(t, n_group, n // n_group)
    if group_score == "top2_sum":
        score = grouped.topk(2, dim=-1).values.sum(dim=-1)
    elif group_score == "max":
        score = grouped.max(dim=-1).values
    else:
        raise ValueError(f"unknown group score {group_score!r}; supported: top2_sum, max")
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(topk_group, dim=-1).indices, True)
    return select.masked_fill(~keep.unsqueeze(-1).expand(t, n_group, n // n_group).reshape(t, n), float("-inf"))


@torch.library.custom_op("moe::router", mutates_args=())
def router(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    score_func: str,
    renormalize: bool,
    scaling: float,
    fp32_weights: bool,
    block: str,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "top2_sum",
    bias_on: str = "scores",
    hash_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if bias_on not in ("scores", "logits"):
        raise ValueError(f"unknown bias_on {bias_on!r}; supported: scores, logits")
    if hash_idx is not None:  # (a new tensor: a custom op's outputs may not alias its inputs)
        idx = hash_idx.to(torch.int64, copy=True)
        w = _route_weights(logits, idx, score_func, renormalize, scaling)
        return (w if fp32_weights else w.to(logits.dtype)), idx
    scores = route_scores(logits, score_func)
    select = scores if bias is None else (logits.float() if bias_on == "logits" else scores) + bias.float()
    if n_group > 1:
        select = group_mask(select, n_group, topk_group, group_score)
    idx = torch.topk(select, top_k, dim=-1).indices
    w = _route_weights(logits, idx, score_func, renormalize, scaling)
    return (w if fp32_weights else w.to(logits.dtype)), idx


@router.register_fake
def _(logits, bias, top_k, score_func, renormalize, scaling, fp32_weights, block, n_group=1, topk_group=1,
      group_score="top2_sum", bias_on="scores", hash_idx=None):
    t = logits.shape[0]
    wd = torch.float32 if fp32_weights else logits.dtype
    return logits.new_empty(t, top_k, dtype=wd), logits.new_empty(t, top_k, dtype=torch.int64)


@torch.library.custom_op("moe::router_backward", mutates_args=())
def router_backward(
    grad_weights: torch.Tensor,
    logits: torch.Tensor,
    idx: torch.Tensor,
    score_func: str,
    renormalize: bool,
    scaling: float,
    block: str,
) -> torch.Tensor:
    # The chain of eager autograd, written out (custom-op kernels run below autograd):
    # cast → scale → renormalise → gather → score function.
    scores = route_scores(logits, score_func)
    g = grad_weights.float()
    if scaling != 1.0:
        g = g * scaling
    if renormalize:
        w = scores.gather(-1, idx)
        total = w.sum(dim=-1, keepdim=True)
        g = g / total - (g * w / (total * total)).sum(dim=-1, keepdim=True)
    g_scores = torch.zeros_like(scores).scatter_add_(-1, idx, g)
    if score_func == "softmax":
        g_logits = torch._softmax_backward_data(g_scores, scores, -1, torch.float32)
    elif score_func == "sqrtsoftplus":  # sqrt's backward, then softplus's (beta 1, threshold 20)
        g_logits = torch.ops.aten.softplus_backward(g_scores / (2 * scores), logits.float(), 1.0, 20.0)
    else:
        g_logits = torch.ops.aten.sigmoid_backward(g_scores, scores)
    return g_logits.to(logits.dtype)


@router_backward.register_fake
def _(grad_weights, logits, idx, score_func, renormalize, scaling, block):
    return torch.empty_like(logits)


def _setup(ctx, inputs, output):
    logits, _bias, _k, score_func, renormalize, scaling, _fp32, block = inputs[:8]
    ctx.save_for_backward(logits, output[1])
    ctx.cfg = (score_func, renormalize, scaling, block)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_w, _grad_idx):
    logits, idx = ctx.saved_tensors
    g = torch.ops.moe.router_backward(grad_w, logits, idx, *ctx.cfg)
    return (g,) + (None,) * 12


router.register_autograd(_backward, setup_context=_setup)
