"""Qwen4-Exp's QSA token indexer as one static graph.

Each indexed attention layer asks its indexer which keys every query may see. The indexer's own forward
loops over batch rows and queries in Python: a query's visible keys (its row of the attention mask) are
cut, in order, into blocks of ``compress_ratio``; each complete block's keys are mean-pooled, normalised
and rotated at the block's first position; the ``block_topk`` blocks whose pooled key scores highest
(Σ_heads ReLU(q·k) / √D) are kept with the incomplete tail of visible keys, and the result is a boolean
mask over the keys. The number of complete blocks is data (the mask), so the loop cannot be captured
(``if num_complete_blocks > 0`` on a value) and the family was refused.

The same computation for all queries at once: the visible keys of each query in order come from a stable
argsort of its mask row, their rank from its cumulative sum; blocks past a query's complete ones score
−inf and a stable descending sort picks the top blocks. Ties (ReLU makes a block's score exactly 0 when
every head's product is negative) go to the lower block. The loop's CPU top-k breaks them by its
selection algorithm: toward the lower block for up to 3 blocks, in no documented order beyond, so a
tied pick is the one place the two forms may differ. Installing it checks it against the loop on a
probe batch (causal with left padding), queries with a tie at the cut left out, and refuses the module
if any other mask differs. It holds [B, S, S, D] gathered keys where the loop held one query's: O(S²·D)
memory per batch row, for the indexer's head dimension D.

The selection is a boolean mask, so nothing differentiates through the indexer in either form.
"""

from __future__ import annotations

import math
import sys
import types

import torch
import torch.nn as nn

from ..errors import UnsupportedFeatureError

QSA_ATTRS = ("index_qk_proj", "q_layernorm", "k_layernorm", "compress_ratio", "token_budget", "block_topk",
             "index_head_dim", "index_n_heads", "index_kv_heads")


def qsa_indexers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of the QSA indexer form (Qwen4-Exp): the attributes above, a forward taking
    (hidden_states, position_embeddings, attention_mask, cache)."""
    return [(p, m) for p, m in model.named_modules() if all(hasattr(m, a) for a in QSA_ATTRS)]


def _rotary(m: nn.Module):
    """The rotary embedding its own forward applies: its module's ``apply_rotary_pos_emb`` (or a base class's)."""
    fn = next((f for c in type(m).__mro__ if (f := getattr(sys.modules.get(c.__module__), "apply_rotary_pos_emb", None))),
              None)
    if fn is None:
        raise UnsupportedFeatureError(f"{type(m).__name__}: no apply_rotary_pos_emb in its module to rotate the pooled keys")
    return fn


def static_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                   cache=None) -> torch.Tensor:
    """The indexer's selection mask [B, 1, S, KL] for all queries at once (module docstring)."""
    return _select(self, hidden_states, position_embeddings, attention_mask, cache)[0]


def _select(self: nn.Module, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor, cache):
    """(selection mask [B, 1, S, KL], block scores [B, S, NB] with −inf past each query's complete blocks)."""
    rope = _rotary(self)
    b, s, _ = hidden_states.shape
    d, cr, topk = self.index_head_dim, self.compress_ratio, self.block_topk
    full_cos, full_sin = position_embeddings
    cp = getattr(self, "_moe_cp_positions", 1)
    q_cos, q_sin = full_cos[:, -s:], full_sin[:, -s:]
    if cp > 1 and torch.compiler.is_compiling():  # the keys are the whole sequence's (hf_indexed.py): so their positions
        full_cos, full_sin = (torch.ops.moe_cp.whole_sequence(t, 1, cp) for t in (full_cos, full_sin))
    q, token_k = torch.split(self.index_qk_proj(hidden_states),
                             [self.index_n_heads * d, self.index_kv_heads * d], dim=-1)
    q = rope(self.q_layernorm(q.reshape(b, s, -1, d)), cos=q_cos, sin=q_sin, unsqueeze_dim=2)
    keys = token_k.reshape(b, s, -1, d).squeeze(2)  # [B, KL, D] (one indexer key head)
    if cache is not None:
        keys = cache.update_indexer(keys, self.layer_idx)
    visible = (attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)[:, 0]  # [B, S, KL]
    kl = visible.shape[-1]
    nb_max = kl // cr
    order = torch.argsort((~visible).to(torch.int8), dim=-1, stable=True)  # visible keys first, in order
    complete = visible.sum(-1) // cr  # [B, S]: each query's complete blocks
    members = order[..., : nb_max * cr]  # [B, S, NB·cr]: key index of block i's r-th member at i·cr + r
    rows = torch.arange(b, device=keys.device).view(b, 1, 1)
    pos_rows = rows if full_cos.shape[0] == b else torch.zeros_like(rows)  # positions shared by the batch: [1, …]
    grouped = keys[rows, members].view(b, s, nb_max, cr, d)
    pooled = self.k_layernorm(grouped.float().mean(dim=3).to(keys.dtype))  # [B, S, NB, D]
    starts = members[..., ::cr]  # [B, S, NB]: the block's first key
    block_keys = rope(pooled.unsqueeze(-2), cos=full_cos[pos_rows, starts], sin=full_sin[pos_rows, starts],
                      unsqueeze_dim=-2).squeeze(-2)
    scores = torch.matmul(q.float(), block_keys.float().transpose(-1, -2)).transpose(-1, -2)  # [B, S, NB, H]
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(d)
    block = torch.arange(nb_max, device=keys.device)
    scores = scores.masked_fill(block >= complete.unsqueeze(-1), float("-inf"))
    picked = scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk]  # [B, S, k]: ties, lower first
    picked = torch.where(picked < complete.unsqueeze(-1), picked, nb_max)  # past the complete ones: none
    chosen = torch.zeros(b, s, nb_max + 1, dtype=torch.bool, device=keys.device).scatter(-1, picked, True)
    rank = visible.cumsum(-1) - 1  # a visible key's place among the query's visible keys
    key_block = torch.where(visible, rank // cr, nb_max).clamp(max=nb_max)  # [B, S, KL]
    tail = key_block >= complete.unsqueeze(-1)  # visible keys after the complete blocks: always kept
    return (visible & (tail | chosen.gather(-1, key_block))).unsqueeze(1), scores


def _tied_at_cut(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B, S]: queries whose k-th and (k+1)-th best complete blocks score the same (top-k's tie-break decides)."""
    if scores.shape[-1] <= k:
        return torch.zeros(scores.shape[:-1], dtype=torch.bool)
    best = scores.sort(dim=-1, descending=True).values
    return (best[..., k - 1] == best[..., k]) & torch.isfinite(best[..., k])


def _probe_mask(s: int, pad: int) -> torch.Tensor:
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = causal.expand(2, 1, s, s).clone()
    mask[1, :, :, :pad] = False  # the second row left-padded
    return mask


def use_static_qsa(model: nn.Module) -> int:
    """Install the static form on every QSA indexer of ``model`` (per instance), after checking it gives
    the loop's masks on a probe batch; returns how many were installed."""
    found = qsa_indexers(model)
    for path, m in found:
        if m.index_kv_heads != 1:
            raise UnsupportedFeatureError(f"{path}: QSA indexer with {m.index_kv_heads} key heads (its own forward "
                                          "takes one)")
        p = next(m.parameters())
        g = torch.Generator().manual_seed(0)
        s = 6 * m.compress_ratio + 3
        x = torch.randn(2, s, m.index_qk_proj.in_features, generator=g).to(p)
        ang = torch.randn(2, s, m.index_head_dim // 2, generator=g).repeat(1, 1, 2)  # rotary angles, halves alike
        cos, sin = ang.cos().to(p), ang.sin().to(p)
        mask = _probe_mask(s, m.compress_ratio + 1).to(p.device)
        with torch.no_grad():
            try:
                want = type(m).forward(m, x, (cos, sin), mask, None)
            except Exception as e:  # noqa: BLE001 - named with the module
                raise UnsupportedFeatureError(f"{path}: its QSA indexer's own forward fails on a probe batch "
                                              f"({type(e).__name__}: {e}); this indexer is not supported") from e
            got, scores = _select(m, x, (cos, sin), mask, None)
        if want.shape == got.shape:  # a tie at the cut may go either way (module docstring)
            tied = _tied_at_cut(scores, m.block_topk)[:, None, :, None]
            want, got = want & ~tied, got & ~tied
        if want.shape != got.shape or not torch.equal(want, got):
            raise UnsupportedFeatureError(f"{path}: the static form of its QSA indexer selects other keys than its own "
                                          "forward on a probe batch; this indexer is not supported")
        m.forward = types.MethodType(static_forward, m)
    return len(found)
