"""A tiny decoder-only MoE language model written the ordinary single-device way.

Nothing here knows about expert parallelism: it is the kind of model a user hands to
``moe_compile``. Its MoE block is the usual shape — a Linear router, softmax or sigmoid scores, top-k,
experts as an ``nn.ModuleList`` of FFNs or as stacked 3-D weights, an optional shared expert — and
its forward loops over experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .aux_losses import router_aux_loss


@dataclass
class TinyMoEConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int = 256
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 64
    activation: str = "silu"  # silu → SwiGLU experts; gelu → two-layer GELU experts
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    expert_bias: bool = False  # score-correction bias, used for selection only
    expert_layout: str = "module_list"  # module_list | stacked
    shared_expert_hidden: int = 0
    shared_expert_gate: bool = False
    lb_coef: float = 0.01
    z_coef: float = 0.001
    dense_layers: tuple[int, ...] = field(default_factory=tuple)  # layers with a dense MLP instead
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"TinyMoEConfig: d_model={self.d_model} must be a multiple of n_heads={self.n_heads} "
                             "(the attention heads split it evenly)")


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, h, bias=False)  # gate
        self.w3 = nn.Linear(d, h, bias=False)  # up
        self.w2 = nn.Linear(h, d, bias=False)  # down
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class GeluFFN(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)
        self.act_fn = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn(self.fc1(x)))


def make_ffn(d: int, h: int, activation: str) -> nn.Module:
    if activation == "silu":
        return SwiGLU(d, h)
    if activation == "gelu":
        return GeluFFN(d, h)
    raise ValueError(f"TinyMoEConfig.activation={activation!r}: expected 'silu' or 'gelu'")


class StackedExperts(nn.Module):
    """All experts' SwiGLU weights as 3-D tensors [num_experts, out, in]."""

    def __init__(self, n: int, d: int, h: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, h, d))
        self.w3 = nn.Parameter(torch.empty(n, h, d))
        self.w2 = nn.Parameter(torch.empty(n, d, h))
        self.act_fn = nn.SiLU()

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.act_fn(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])


class MoEFeedForward(nn.Module):
    """Router → top-k → experts → router-weighted sum (+ shared expert). Returns (y, aux_loss)."""

    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__()
        d, n = cfg.d_model, cfg.num_experts
        self.num_experts, self.top_k = n, cfg.top_k
        self.score_func, self.norm_topk_prob = cfg.score_func, cfg.norm_topk_prob
        self.lb_coef, self.z_coef = cfg.lb_coef, cfg.z_coef
        self.router = nn.Linear(d, n, bias=False)
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(n))
        else:
            self.expert_bias = None
        if cfg.expert_layout == "stacked":
            if cfg.activation != "silu":
                raise ValueError("stacked experts are SwiGLU (activation='silu')")
            self.experts = StackedExperts(n, d, cfg.expert_hidden)
        else:
            self.experts = nn.ModuleList(make_ffn(d, cfg.expert_hidden, cfg.activation) for _ in range(n))
        self.shared_expert = make_ffn(d, cfg.shared_expert_hidden, "silu") if cfg.shared_expert_hidden else None
        self.shared_expert_gate = nn.Linear(d, 1, bias=False) if cfg.shared_expert_gate else None

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        logits = self.router(x)
        lf = logits.float()
        scores = torch.softmax(lf, dim=-1) if self.score_func == "softmax" else torch.sigmoid(lf)
        select = scores if self.expert_bias is None else scores + self.expert_bias
        idx = torch.topk(select, self.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        y = self.expert_mix(x, idx, weights.to(x.dtype))
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(x)) * s
            y = y + s
        aux = router_aux_loss(logits, idx, self.score_func, self.lb_coef, self.z_coef)
        return y.reshape(shape), aux


    def expert_mix(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_k weights[t, k] · expert_{idx[t, k]}(x[t]), one expert at a time."""
        y = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, k = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            if isinstance(self.experts, StackedExperts):
                out = self.experts.expert(e, x[tok])
            else:
                out = self.experts[e](x[tok])
            y = y.index_add(0, tok, out * weights[tok, k, None])
        return y


class DenseFeedForward(nn.Module):
    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__()
        self.ffn = make_ffn(cfg.d_model, cfg.expert_hidden * cfg.top_k, "silu")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ffn(x), x.new_zeros((), dtype=torch.float32)


class Attention(nn.Module):
    def __init__(self, cfg: TinyMoEConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, d))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyMoEConfig, i: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = DenseFeedForward(cfg) if i in cfg.dense_layers else MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x))
        m, aux = self.mlp(self.mlp_norm(x))
        return x + m, aux


@dataclass
class MoELMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor
    aux_loss: torch.Tensor


class TinyMoELM(nn.Module):
    """Decoder-only MoE LM. ``forward(input_ids, labels=None, position_ids=None, shift_labels=None,
    num_items_in_batch=None)``: labels are shifted inside, as in HF; as in HF's causal-LM loss,
    ``shift_labels`` are labels already shifted (then used as they are) and ``num_items_in_batch``
    turns the token loss into a sum divided by it (a sequence shard's part of the whole loss)."""

    def __init__(self, cfg: TinyMoEConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or TinyMoEConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layers) if "proj" in name else std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None,
                num_items_in_batch: torch.Tensor | None = None) -> MoELMOutput:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device) if position_ids is None else position_ids
        x = self.embed(input_ids) + self.pos(pos)
        aux = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, a = layer(x)
            aux = aux + a
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None or shift_labels is not None:
            if shift_labels is None:
                lg, target = logits[:, :-1], labels[:, 1:]
            else:
                lg, target = logits, shift_labels
            lg = lg.reshape(-1, logits.shape[-1]).float()
            if num_items_in_batch is None:
                ce = F.cross_entropy(lg, target.reshape(-1))
            else:
                ce = F.cross_entropy(lg, target.reshape(-1), reduction="sum") / num_items_in_batch
            loss = ce + aux
        return MoELMOutput(loss=loss, logits=logits, aux_loss=aux)
