"""Context-parallel runtime: each rank of a CP group runs its shard of the batch's sequences.

Glossary: C / CP, S. Every rank of one CP group passes the same full-sequence batch (token ids are
small); the compiled program keeps only this rank's shard of every activation:

    chunks   S split into 2·cp equal chunks; CP rank r takes chunks r and 2cp−1−r (causal attention
             costs the same on every rank); S not divisible by 2·cp is an error
    inputs   input_ids[:, I_r], position_ids = global positions I_r or the user's position ids at I_r
             (the model's own rotary / position code sees the real positions; restarting ones, packed
             sequences, are kept apart in attention as transformers does), attention_mask[:, I_r]
    labels   shifted over the whole sequence first (position i predicts token i+1; the last position
             −100), then sharded: shift_labels = shifted[:, I_r], so no token is lost at chunk edges
             (a user's shift_labels [B, S] are sharded as given); num_items_in_batch = the whole batch's
             count of loss tokens. Any other per-token tensor ([B, S, …]) is refused by name
    loss     each rank's part = Σ its tokens' losses / num_items_in_batch; the CP group's sum (LossSum)
             is the whole-sequence mean loss, identical on its ranks
    logits   this rank's shard, positions I_r (``cm.cp_positions(S)``)

Attention is made whole by the context_parallel_attention pass (K/V all-gathered, causal by global
position). Gradients: each rank's are its tokens' part of the whole loss's; the dense reduction sums
them over dp×cp and averages over dp (train/ddp.py scales by 1/dp; experts by cp/(ep_mp·ep_dp)).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OptionError


def shard_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s tokens: chunks r and 2cp−1−r of 2·cp."""
    if seq % (2 * cp):
        raise OptionError(f"context parallelism cp={cp}: sequence length {seq} is not divisible by 2·cp = {2 * cp} "
                          "(each rank takes two of 2·cp equal chunks); pad the sequences to a multiple")
    c = seq // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def shard_batch(kwargs: dict[str, Any], cp: int, rank: int, count: bool = True) -> dict[str, Any]:
    """The model kwargs of this CP rank's shard (see the module docstring). ``count=False``: no
    num_items_in_batch (the model returns its shard's mean; a pipeline weights it per microbatch).
    output_router_logits=True is passed on: the caller runs the model's load-balancing loss over the
    whole sequences (runtime/cp_balance_loss.py)."""
    ids = kwargs.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise OptionError("context parallelism needs input_ids of shape [batch, sequence]")
    if "inputs_embeds" in kwargs:
        raise OptionError("context parallelism shards input_ids; inputs_embeds is not supported")
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None \
            or "cache_position" in kwargs:  # (transformers 5.x names the cache argument `cache`)
        raise OptionError("context parallelism: a KV cache (use_cache=True, cache, past_key_values, cache_position) would "
                          "hold one rank's shard of the keys, out of sequence order; pass use_cache=False")
    mask = kwargs.get("attention_mask")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise OptionError(f"context parallelism: attention_mask must be the 2-D padding mask of input_ids' shape "
                          f"{tuple(ids.shape)} (got {tuple(mask.shape)})")
    b, s = ids.shape
    handled = ("input_ids", "attention_mask", "labels", "shift_labels", "position_ids")
    per_token = [k for k, v in kwargs.items() if k not in handled and isinstance(v, torch.Tensor)
                 and v.dim() >= 2 and tuple(v.shape[:2]) == (b, s)]
    if per_token:  # it would reach the model whole, beside one shard of the tokens
        raise OptionError(f"context parallelism shards {list(handled)}; {per_token} "
                          f"({tuple(kwargs[per_token[0]].shape)}) look per-token and would not be sharded: not supported")
    idx = shard_positions(s, cp, rank).to(ids.device)
    out = {k: v for k, v in kwargs.items() if k not in handled}
    out["input_ids"] = ids[:, idx]
    if mask is not None:  # the attention's mask over the gathered keys reads it (passes/context_parallel.py)
        out["attention_mask"] = mask[:, idx].contiguous()
    given = kwargs.get("position_ids")
    if given is not None and tuple(given.shape) not in ((b, s), (1, s)):
        raise OptionError(f"context parallelism: position_ids must have input_ids' shape {tuple(ids.shape)} "
                          f"(got shape {tuple(given.shape)})")
    if given is not None:  # restarts (packed sequences) are kept apart by the attention's mask, as transformers does
        given = given.expand(b, -1)
    out["position_ids"] = (given[:, idx] if given is not None else idx.unsqueeze(0).expand(b, -1)).contiguous()
    labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
    if shifted is not None and tuple(shifted.shape) != (b, s):
        raise OptionError(f"context parallelism: shift_labels must have input_ids' shape {(b, s)} "
                          f"(got {tuple(shifted.shape)})")
    if shifted is None and labels is not None:  # the user's shift_labels win, as in transformers' loss
        shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], dim=1)
    if shifted is not None:
        out["shift_labels"] = shifted[:, idx].contiguous()
        # labels too, for a forward that only computes its loss when labels are given (transformers'): the same
        # values in another tensor, so the captured graph shows which of the two the model reads (one tensor
        # passed twice is one graph input)
        out["labels"] = out["shift_labels"].clone()
        if count:
            out["num_items_in_batch"] = (shifted != -100).sum()
    return out
