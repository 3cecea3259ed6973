"""Compressed attention under context parallelism: DeepSeek-V4's CSA and HCA layers.

DeepSeek-V4's attention layers attend over a sliding window of the sequence's keys (its K = V latents)
followed by compressed entries: each window of m tokens (HCA: m' tokens, no overlap; CSA: m tokens,
each entry also reading the previous window's half) pooled into one entry by a learned softmax gate,
which query t may read once its window has closed (t + 1 ≥ (w + 1)·m). CSA's lightning indexer then
keeps each query's top-k entries, pooled the same way at its own width. The module's ``compressor``
projects the hidden states it is given (``kv_proj``, ``gate_proj``; its indexer's likewise), pools
their windows and builds the per-query mask over the entries (``block_bias``) for the queries it is
given, so on a sequence shard it would pool this rank's tokens only, in windows that start at the
shard, not at the sequence.

Under cp > 1, while compiled, the attention module runs as an indexed one does (models/hf_indexed.py):
its sliding keys come from ``cache.update`` as the whole sequence's, its boolean mask as this shard's
queries over the whole sequence (moe_cp::whole_mask, with the config's window; where transformers made
no mask, an all-true one stands in, else the module would skip its entries' mask). Its compressor keeps
this shard's queries and, where each of the rank's two sequence chunks (S/2cp tokens) holds whole windows
of every rate it pools at, pools its own windows: it is handed a cache (``_ShardWindows``) that answers
the hooks of transformers' streaming caches (DeepseekV4CSACache: one prompt fed in pieces) as if the
chunk before were the previous piece:

    store_compression_weights   the chunks' projected tokens, each CSA chunk after its halo window (the
                                m tokens before it, moe_cp::with_halos: the previous window's half an
                                entry reads; before the sequence, a gate of −inf as the dense model's),
                                and each window's first global token index (entries rotate there)
    update_overlap_state        nothing (the halo windows hold it)
    update_compressor_states    the shard's entries, halo windows' dropped → moe_cp::whole_sequence: all
                                T entries in sequence order

so every rank pools only its S/cp tokens' T/cp entries, gathers T entries of head_dim (not S tokens of
the projections' 2–4·head_dim: 16× fewer values at CSA's m = 4), and the indexer scores and picks them
for this shard's queries (its O(S·T) scores divide by cp, as the attention's do). Where a chunk does not
hold whole windows (S/2cp not a multiple of a rate), the compressor pools the whole sequence instead:

    kv_proj, gate_proj outputs (the compressor's and its indexer's) → moe_cp::whole_sequence

and gets no cache: exact too, at O(S) gathered projections per rank. Either way its entries' mask
(``block_bias`` [B, 1, S/cp, T]) becomes a boolean one beside the model's boolean mask, and the
gradients of what was gathered are reduce-scattered back. What does not divide by cp: the whole sliding
keys (not a halo of one window) and the T entries. Run eagerly (not being compiled), the modules run as
they were.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

# config.layer_types entries of DeepSeek-V4's compressed layers (sliding window + compressed entries)
COMPRESSED_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention")
_COMPRESSOR_ARGS = ("hidden_states", "q_residual", "position_ids", "cache")
PROJECTIONS = ("kv_proj", "gate_proj")  # what a compressor (and its indexer) pools, per token


def compressed_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules of DeepSeek-V4's form: a forward taking ``cache`` and a ``compressor`` child
    (None on its sliding layers) whose forward takes hidden_states, q_residual, position_ids and cache,
    and which (and its ``indexer``, if any) holds the projections it pools as Linear children
    (PROJECTIONS) and its window rate and entry width (``compress_rate``, ``head_dim``). Any other
    compressor would pool the shard: its layers stay refused."""
    def pools(owner) -> bool:
        return all(isinstance(getattr(owner, p, None), nn.Linear) for p in PROJECTIONS) \
            and all(isinstance(getattr(owner, a, None), int) for a in ("compress_rate", "head_dim"))

    def v4(m: nn.Module) -> bool:
        c = getattr(m, "compressor", None)
        return isinstance(c, nn.Module) and "cache" in inspect.signature(m.forward).parameters \
            and set(_COMPRESSOR_ARGS) <= set(inspect.signature(c.forward).parameters) and pools(c) \
            and (getattr(c, "indexer", None) is None or pools(c.indexer))

    return [(name, m) for name, m in model.named_modules() if v4(m)]


def _a_mask(m: nn.Module, args: tuple, kwargs: dict):
    """Attention pre-hook while compiled (before models/hf_indexed.py's): transformers makes no mask where
    plain causal attention would do (no padding, a window longer than the sequence), and the module then
    skips its entries' mask; it gets an all-true one, which the CP pass replaces with the whole sequence's
    causal mask (moe_cp::whole_mask)."""
    if not torch.compiler.is_compiling():
        return None
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    if bound.arguments.get("attention_mask") is not None:
        return None
    b, shard = bound.arguments["hidden_states"].shape[:2]
    bound.arguments["attention_mask"] = torch.ones((b, 1, shard, shard), dtype=torch.bool,
                                                   device=bound.arguments["hidden_states"].device)
    return bound.args[1:], bound.kwargs


def _pooling_forms(c: nn.Module) -> dict[str, tuple[int, int, bool]]:
    """Compressor ``c``'s streaming-cache names (transformers': "compressor", its indexer's "indexer") →
    (window rate m, entry head_dim, whether an entry also reads the previous window's half: CSA, whose
    projections hold the two halves, 2·head_dim)."""
    owners = {"compressor": c, "indexer": getattr(c, "indexer", None)}
    return {name: (int(o.compress_rate), int(o.head_dim), o.kv_proj.out_features == 2 * o.head_dim)
            for name, o in owners.items() if o is not None}


def _pools_shard(shard: int, rates) -> bool:
    """Each of the rank's two chunks of ``shard`` = S/cp tokens holds whole windows of every rate."""
    return shard % 2 == 0 and all((shard // 2) % r == 0 for r in rates)


class _ShardWindows:
    """The streaming-cache hooks a compressor calls, answered for this rank's two sequence chunks (module
    docstring): ``layers[layer_idx]`` is the object itself."""

    def __init__(self, cp: int, forms: dict[str, tuple[int, int, bool]], layer_idx: int):
        self.cp, self.forms, self.layers = cp, forms, {layer_idx: self}

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        rate, head_dim, overlap = self.forms[name]
        shard = kv.shape[1]
        index = torch.ops.moe_cp.own_tokens(torch.arange(shard * self.cp, device=kv.device), 0, self.cp)
        starts = index[::rate]  # each window's first token (no window crosses the chunks' seam)
        if overlap:
            kv, gate, starts = _after_halo_windows(kv, gate, starts, rate, head_dim, self.cp)
        # the compressor rotates window w's entry at w·rate + first_window_position
        return kv, gate, starts - torch.arange(starts.shape[0], device=kv.device) * rate

    def update_overlap_state(self, name: str, chunk_kv, chunk_gate, head_dim: int):
        return None, None  # each chunk's previous window is its halo window

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """[B, n, D] pooled entries (halo windows' first in each chunk for CSA) → [B, T, D] all entries."""
        if self.forms[name][2]:
            w = compressed.shape[1] // 2  # halo window + the chunk's windows
            compressed = torch.cat([compressed[:, 1:w], compressed[:, w + 1:]], 1)
        return torch.ops.moe_cp.whole_sequence(compressed, 1, self.cp)


def _after_halo_windows(kv: torch.Tensor, gate: torch.Tensor, starts: torch.Tensor, rate: int, head_dim: int,
                        cp: int):
    """CSA: [B, S/cp, F] projected tokens → [B, 2·(rate + S/2cp), F], each chunk after the window before it;
    its starts too. Before the sequence that window is zeros, and its first half (the one the chunk's first
    entry reads) gets a gate of −inf: softmax weight 0, as the dense model's first entry gives it. Its
    other half stays finite (only the halo window's own entry reads it, and that entry is dropped: a
    softmax over −inf alone would be NaN, and NaN·0 in its backward)."""
    b, c = kv.shape[0], kv.shape[1] // 2

    def seam(x):  # [2B, rate + c, F] (chunks stacked in the batch) → [B, 2·(rate + c), F]
        x = x.unflatten(0, (2, b))
        return torch.cat([x[0], x[1]], 1)

    kv, gate = seam(torch.ops.moe_cp.with_halos(kv, rate, cp)), seam(torch.ops.moe_cp.with_halos(gate, rate, cp))
    per_chunk = c // rate
    starts = torch.cat([starts[:1] - rate, starts[:per_chunk], starts[per_chunk:per_chunk + 1] - rate,
                        starts[per_chunk:]])
    real = (starts >= 0).repeat_interleave(rate).view(1, -1, 1)
    gate = torch.cat([torch.where(real, gate[..., :head_dim], float("-inf")), gate[..., head_dim:]], -1)
    return kv, gate, starts


def _shard_windows(m: nn.Module, args: tuple, kwargs: dict):
    """Compressor pre-hook while compiled: the cache it pools this shard's windows with (``_ShardWindows``),
    or, where a chunk holds no whole windows, none (it then pools the whole sequence's projections). The
    attention's cache argument is the whole-sequence hooks' of models/hf_indexed.py, not a transformers
    cache."""
    if not torch.compiler.is_compiling():
        return None
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    cp, forms = m._moe_cp_compressed
    local = _pools_shard(bound.arguments["hidden_states"].shape[1], [f[0] for f in forms.values()])
    bound.arguments["cache"] = _ShardWindows(cp, forms, bound.arguments["layer_idx"]) if local else None
    return bound.args[1:], bound.kwargs


def _boolean_bias(m: nn.Module, args: tuple, kwargs: dict, out):
    """Compressor hook while compiled: its entries' mask as a boolean one (the model concatenates it, cast
    to its mask's dtype, beside the boolean whole-sequence mask: cast from 0 / −inf it would invert)."""
    if not torch.compiler.is_compiling() or out[1] is None:  # (None: no window closed yet)
        return None
    return out[0], out[1] == 0


def _whole_projection(m: nn.Module, args: tuple, out: torch.Tensor):
    """Projection hook while compiled: the whole sequence's projected tokens, in sequence order, where the
    compressor cannot pool this shard's windows (_pools_shard)."""
    if not torch.compiler.is_compiling():
        return None
    cp, rates = m._moe_cp_compressed
    if _pools_shard(out.shape[1], rates):
        return None
    return torch.ops.moe_cp.whole_sequence(out, 1, cp)


def use_compressed_attention(model: nn.Module, cp: int) -> list[str]:
    """Make each compressed attention module of ``model`` see the whole sequence's keys and compressed
    entries when compiled at ``cp`` > 1 (module docstring); the module paths it changed."""
    from .hf_indexed import whole_sequence_keys

    paths = []
    for path, m in compressed_attention_modules(model):
        if getattr(m, "_moe_cp_whole", None) is None:  # (registered before whole_sequence_keys' hook)
            m.register_forward_pre_hook(_a_mask, with_kwargs=True)
        whole_sequence_keys(m, cp, path)
        c = m.compressor
        if getattr(c, "_moe_cp_compressed", None) is None:
            c.register_forward_pre_hook(_shard_windows, with_kwargs=True)
            c.register_forward_hook(_boolean_bias, with_kwargs=True)
        forms = _pooling_forms(c)
        c._moe_cp_compressed = (cp, forms)
        rates = tuple(f[0] for f in forms.values())
        for owner in (c, c.indexer) if getattr(c, "indexer", None) is not None else (c,):
            for name in PROJECTIONS:
                proj = getattr(owner, name)
                if getattr(proj, "_moe_cp_compressed", None) is None:
                    proj.register_forward_hook(_whole_projection)
                proj._moe_cp_compressed = (cp, rates)
        paths.append(path)
    return paths
