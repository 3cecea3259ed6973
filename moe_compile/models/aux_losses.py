"""Router auxiliary losses, computed from requested routes (before any capacity drop).

    load balancing (Switch):  lb = N · Σ_e f_e · P_e,  f_e = rows routed to e / (T·K),  P_e = mean_t p[t, e]
    router z-loss (ST-MoE):   z  = mean_t logsumexp(logits_t)²

p is the softmax of the logits, or the row-normalised scores for the other score functions (sigmoid,
sqrt-softplus).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.routing import route_scores


def router_aux_loss(
    logits: torch.Tensor, idx: torch.Tensor, score_func: str, lb_coef: float, z_coef: float
) -> torch.Tensor:
    n = logits.shape[-1]
    total = logits.new_zeros((), dtype=torch.float32)
    if lb_coef:
        lf = logits.float()
        if score_func == "softmax":
            p = torch.softmax(lf, dim=-1)
        else:
            s = route_scores(lf, score_func)
            p = s / s.sum(dim=-1, keepdim=True)
        f = F.one_hot(idx.reshape(-1), n).sum(0).float() / idx.numel()
        total = total + lb_coef * n * (f * p.mean(0)).sum()
    if z_coef:
        total = total + z_coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
    return total
