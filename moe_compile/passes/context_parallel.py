"""context_parallel_attention — make every attention node see the whole sequence (cp > 1).

Glossary: C / CP, S. Under context parallelism each rank's graph runs on its sequence shard (S/cp
tokens: chunks r and 2cp−1−r of 2cp, see runtime/context_parallel.py), with the tokens' global
position ids as the ``position_ids`` graph input. Everything per token then runs as it is; attention
is the one op that mixes tokens, so this pass rewrites each scaled-dot-product-attention node:

    K = moe_cp::all_gather(k, seq dim)        V = moe_cp::all_gather(v, seq dim)
    mask = moe_cp::causal_mask(all_gather(position_ids), all_gather(attention_mask), …)   (once per graph)
    out  = sdpa(q, K, V, attn_mask=mask, scale, enable_gqa)     (GQA kept as the model had it)

Backward of the all-gathers reduce-scatters the K/V gradients. The model's own mask for the local
shard is replaced by the whole sequence's, as transformers makes it (masking_utils): causal by global
token index, padding keys masked (the batch's attention_mask, sharded like the tokens), and, without an
attention_mask, packed sequences kept apart where the position ids restart. A node with ``is_causal``
and no mask of the model's gets the causal mask alone (the model ignored padding and packing), one with
neither none (bidirectional). Attention with sinks (GPT-OSS & co., which have no SDPA form) arrives as one
``moe_cp::sink_attention`` node (models/hf_sinks.py) and is rewritten the same way, its sinks as they
are. A graph with no such node (the eager matmul-softmax form) or with dropout in attention is refused,
naming the module; a pipeline stage with no attention module at all (MoE and MLP
layers only) is left as it is. Sliding-window layers (api.cp_attention_windows: the config's
window on its sliding layers) get the window in the same mask, by global token index, and chunked
layers (api.cp_attention_chunks: Llama 4's attention_chunk_size) their chunks. Where a window of W
fits (W − 1 ≤ S/2cp: halo_reach), a sliding layer's keys are not gathered whole:

    K = halo_spans(k) = [halo_r ‖ chunk_r ‖ halo_s ‖ chunk_s]   (halos: moe_cp::halo_exchange, s = 2cp−1−r)
    mask = moe_cp::window_mask(halo_spans(position_ids), halo_spans(attention_mask), …)

each chunk's queries over their own span only: S/cp + 2(W − 1) keys per rank instead of S. Indexed attention
(DeepSeek-V3.2's, models/hf_indexed.py) builds its own mask over its keys, so it asks for the whole
sequence before its indexer runs, through two markers this pass fills in, in sequence order:

    moe_cp::whole_sequence(x, dim)  → moe_cp::to_sequence(moe_cp::all_gather(x, dim))
    moe_cp::whole_mask(mask)    → moe_cp::to_sequence(the CP mask, key dim), in the model mask's shape

and its SDPA (whole keys, a mask made from whole_mask) is left as it is; DeepSeek-V4's compressed layers
(models/hf_compressed.py) run so too, their compressed entries after the whole keys. Attention over keys that are
neither the shard's nor so made whole is refused. Other linear-attention layers run their mixer on the whole
sequence (models/hf_mixers.py): whole_sequence on its input, and on its output

    moe_cp::own_tokens(y, dim)  → narrow(moe_cp::from_sequence(y, dim), rank·S/cp, S/cp)

(a pipeline stage of such layers and MoE / MLP layers has no attention to rewrite). Delta-rule layers
stay on the shard and pass states instead (models/hf_state_passing.py): their chunk summaries are

    moe_cp::incoming_states(x)  → scan_incoming_states(moe_cp::to_sequence(moe_cp::all_gather(x, 0)))

``moe-compile explain`` captures on the meta device with SDPA as a fused kernel (the CPU flash kernel, or
the memory-efficient one: attention_ops; what a rank saves, not the math path's probabilities): those
calls are rewritten the same way, the boolean mask turned into the additive one SDPA would make of it.

Requires DENSE, ensures DENSE. A no-op at cp = 1.
"""

from __future__ import annotations

import re
from collections import deque

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..attention_ops import ATTENTION, EFFICIENT, FUSED, SDPA, SINKS, attention_arg, no_sdpa_form
from ..errors import UnsupportedFeatureError
from ..ir import Stage
from ..ops.context_parallel import halo_batches, halo_spans, scan_incoming_states
from ..viz.graph import module_path
from .base import PassContext, moe_pass, propagate_fake, user_line

WHOLE_SEQUENCE = (torch.ops.moe_cp.whole_sequence, torch.ops.moe_cp.whole_sequence.default)
OWN_TOKENS = (torch.ops.moe_cp.own_tokens, torch.ops.moe_cp.own_tokens.default)
INCOMING_STATES = (torch.ops.moe_cp.incoming_states, torch.ops.moe_cp.incoming_states.default)
WITH_HALOS = (torch.ops.moe_cp.with_halos, torch.ops.moe_cp.with_halos.default)
WHOLE_MASK = (torch.ops.moe_cp.whole_mask, torch.ops.moe_cp.whole_mask.default)
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _arg(n: fx.Node, i: int, default=None):
    return attention_arg(n, _ARGS[i], default)


def _where(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else n.name


def _has_attention_module(nodes: list[fx.Node]) -> bool:
    """Whether any node comes from an attention module (class or attribute named for attention). The
    model-level check (api._check_context_parallel) already refused every other token mixer a config
    declares; a stage without attention modules and without SDPA has nothing to make whole."""
    return any("attention" in getattr(cls, "__name__", str(cls)).lower()
               or re.search(r"(?:^|[._])(self_)?attn(?:$|[._])", str(path))
               for n in nodes for path, cls in (n.meta.get("nn_module_stack") or {}).values())


@moe_pass(requires=Stage.DENSE, ensures=Stage.DENSE)
def context_parallel_attention(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    prog = ctx.program
    cp = prog.mesh.cp
    if cp == 1:
        return gm
    g = gm.graph
    filled = _fill_sequence_markers(g, prog, cp)
    nodes = list(g.nodes)
    attn = [n for n in nodes if n.op == "call_function" and n.target in ATTENTION]
    if not attn and filled:  # only token mixers run on the whole sequence (models/hf_mixers.py); an eager
        _refuse_eager_attention(nodes, filled, cp)  # attention beside them would see the shard alone
    if not attn and (filled or prog.mesh.pp > 1 and not _has_attention_module(nodes)):
        _check_loss_inputs(nodes, prog.mesh, cp)
        gm.recompile()  # a pipeline stage of MoE / MLP layers only (Nemotron-H's later stage), or of recurrent
        return gm  # token mixers run on the whole sequence (models/hf_mixers.py): no attention to rewrite
    if not attn:
        soft = next((n for n in nodes if n.op in ("call_function", "call_method") and "softmax" in str(n.target)
                     and "attn" in _where(n).lower()), None)
        sinks = next((n for n in nodes if n.op in ("placeholder", "get_attr")
                      and re.search(r"(?:^|_)sinks_?$", str(n.target if n.op == "get_attr" else n.name))), None)
        if sinks is not None:  # a model of the user's own (transformers' run moe_cp::sink_attention: models/hf_sinks.py)
            user = next(iter(sinks.users), sinks)
            raise no_sdpa_form(module_path(user) or _where(user), True, f"cp={cp}")
        where = f" ({module_path(soft) or _where(soft)})" if soft is not None else ""
        raise UnsupportedFeatureError(
            f"context parallelism (cp={cp}) rewrites scaled_dot_product_attention, but the captured graph has "
            f"none{where}: run the model's attention through SDPA (transformers: attn_implementation='sdpa')")
    _check_loss_inputs(nodes, prog.mesh, cp)
    shard = int(_arg(attn[0], 0).meta["val"].shape[-2])  # S/cp: the queries' length
    _refuse_eager_attention(nodes, shard, cp)
    pos = [n for n in nodes if n.op == "placeholder" and "position_ids" in n.name]
    if len(pos) > 1:
        raise UnsupportedFeatureError(f"context parallelism (cp={cp}): the captured graph takes {len(pos)} position "
                                      "id inputs; expected one")
    synthesized = not pos
    if pos:
        pos = pos[0]
    else:  # a later pipeline stage, or a model without positions (NoPE: Nemotron-H, granitemoehybrid with
        # position_embedding_type=None): the shard's own global positions, as constants, for the causal mask.
        # One that makes positions from the shard's length instead is refused below, after the rewrite.
        with g.inserting_before(attn[0]):
            pos = g.call_function(torch.ops.moe_cp.positions.default, (_arg(attn[0], 0), shard * cp, cp, prog.cp_rank))
        propagate_fake([pos])
    seq = shard * cp
    pad = next((n for n in nodes if n.op == "placeholder" and "attention_mask" in n.name), None)
    masks: dict[tuple, fx.Node] = {}  # (the model made the mask, window, chunk, halo reach) → the CP mask

    gathered: dict[tuple, fx.Node] = {}  # position ids / padding mask over the group (or in halo spans): once per graph

    def gather(name: str, x: fx.Node, at: fx.Node, reach: int = 0) -> fx.Node:
        if (name, reach) not in gathered:
            with g.inserting_before(at):
                gathered[(name, reach)] = g.call_function(halo_spans, (x, 1, reach, prog.ctx_id, cp)) if reach else \
                    g.call_function(torch.ops.moe_cp.all_gather.default, (x, 1, prog.ctx_id, cp))
            propagate_fake([gathered[(name, reach)]])
        return gathered[(name, reach)]

    def mask_for(model_made: bool, window: int, chunk: int, at: fx.Node, reach: int = 0) -> fx.Node:
        if (model_made, window, chunk, reach) not in masks:  # before its first user (attention nodes in graph order)
            kpos = gather("pos", pos, at, reach)
            kvalid = gather("pad", pad, at, reach) if model_made and pad is not None else None
            # transformers packs sequences by restarting position ids only when no attention_mask is given
            packed = model_made and pad is None and pos.op == "placeholder"
            with g.inserting_before(at):
                mask = g.call_function(torch.ops.moe_cp.window_mask.default,
                                       (kpos, kvalid, seq, cp, prog.cp_rank, packed, window)) if reach else \
                    g.call_function(torch.ops.moe_cp.causal_mask.default,
                                    (kpos, kvalid, seq, cp, prog.cp_rank, packed, window, chunk))
            propagate_fake([mask])
            masks[(model_made, window, chunk, reach)] = mask
        return masks[(model_made, window, chunk, reach)]

    # keys made whole (the sequence's, then any entries the module appends: DeepSeek-V4's compressed ones)
    whole = {n for n in attn if int(_arg(n, 1).meta["val"].shape[-2]) >= seq and _reaches(_arg(n, 3), WHOLE_MASK)}
    for n in [n for n in nodes if n in attn or n.target in WHOLE_MASK]:
        if n.target in WHOLE_MASK:  # its mask: the whole sequence's, keys in sequence order, the model's shape
            mask = mask_for(True, _per_layer(n, prog.cp_windows, "the sliding window"),
                            _per_layer(n, prog.cp_chunks, "the attention chunk"), n)
            with g.inserting_before(n):
                ordered = g.call_function(torch.ops.moe_cp.to_sequence.default, (mask, 3, cp))
                out = g.call_function(torch.Tensor.expand, (ordered, *n.meta["val"].shape))
            _replace(g, n, out, [ordered, out])
            continue
        if n in whole:  # keys, values and mask already the whole sequence's: nothing to gather
            continue
        if int(_arg(n, 1).meta["val"].shape[-2]) != shard:
            raise UnsupportedFeatureError(
                f"{module_path(n) or _where(n)}: attention of {shard} queries over "
                f"{int(_arg(n, 1).meta['val'].shape[-2])} keys under context parallelism (cp={cp}): the keys are "
                f"neither this shard's nor the whole sequence's with its mask (moe_cp::whole_mask){user_line(n)}; "
                "use cp=1")
        dropout = _arg(n, 4, 0.0)
        if dropout not in (0, 0.0):
            raise UnsupportedFeatureError(f"{_where(n)}: attention dropout {dropout} under context parallelism"
                                          f"{user_line(n)}")
        q, k, v = _arg(n, 0), _arg(n, 1), _arg(n, 2)
        given = _arg(n, 3)
        val = given.meta.get("val") if isinstance(given, fx.Node) else None
        if n.target in SDPA + SINKS and isinstance(val, torch.Tensor) and val.is_floating_point():
            # transformers' SDPA masks are boolean: an additive one may carry a bias (ALiBi, a learned or dynamic
            # mask) that the whole sequence's causal mask would silently drop
            raise UnsupportedFeatureError(
                f"{module_path(n) or _where(n)}: attention with an additive {val.dtype} mask under context parallelism "
                f"(cp={cp}): it may carry a bias over the shard's keys, which the sharded attention cannot rebuild "
                f"over the whole sequence (it makes boolean causal, padding, packing and window masks){user_line(n)}; "
                "use cp=1")
        model_made = given is not None
        causal = model_made or bool(_arg(n, 5, False))
        sdim = len(k.meta["val"].shape) - 2
        window = _per_layer(n, prog.cp_windows, "the sliding window")
        chunk = _per_layer(n, prog.cp_chunks, "the attention chunk")
        reach = halo_reach(window, chunk, shard, cp) if causal else 0
        mask = mask_for(model_made, window, chunk, n, reach) if causal else None
        klen = shard + 2 * reach if reach else seq  # the keys each query row is given
        new: list[fx.Node] = []
        with g.inserting_before(n):
            kv = []
            for x in (k, v):  # K/V heads travel once, repeated for GQA after (transformers repeats before SDPA)
                x0, heads = _unrepeated(x)
                if reach:  # a sliding window's keys: the rank's two chunks, each after the window − 1 keys before it
                    xg = g.call_function(halo_spans, (x0, sdim, reach, prog.ctx_id, cp))
                else:
                    xg = g.call_function(torch.ops.moe_cp.all_gather.default, (x0, sdim, prog.ctx_id, cp))
                new.append(xg)
                if x0 is not x:
                    b, h0, _, d = x0.meta["val"].shape
                    xg = g.call_function(torch.unsqueeze, (xg, 2))
                    xg = g.call_function(torch.Tensor.expand, (xg, b, h0, heads // h0, klen, d))
                    xg = g.call_function(torch.reshape, (xg, (b, heads, klen, d)))
                    new += [xg.args[0].args[0], xg.args[0], xg]
                kv.append(xg)
            kg, vg = kv
            if n.target in SINKS:  # the sinks stay per head: one column beside the gathered keys
                out = g.call_function(torch.ops.moe_cp.sink_attention.default,
                                      (q, kg, vg, attention_arg(n, "sinks"), mask, False, _arg(n, 6)))
                new.append(out)
                _replace(g, n, out, new)
                continue
            kwargs = {"scale": _arg(n, 6)}
            if _arg(n, 7, False):
                kwargs["enable_gqa"] = True
            if causal:
                kwargs["attn_mask"] = mask
            if n.target in FUSED:  # (out, log-sum-exp, …) as the node it replaces; no GQA flag (heads as they are)
                kwargs.pop("enable_gqa", None)
                if causal:  # SDPA turns a boolean mask into an additive one of q's dtype first (what backward keeps)
                    zero = g.call_function(torch.zeros_like, (mask,), {"dtype": q.meta["val"].dtype})
                    hidden = g.call_function(torch.logical_not, (mask,))
                    kwargs["attn_mask"] = g.call_function(torch.Tensor.masked_fill, (zero, hidden, float("-inf")))
                    new += [zero, hidden, kwargs["attn_mask"]]
                if n.target in EFFICIENT:  # its bias is positional and must hold every head
                    bias = kwargs.pop("attn_mask", None)
                    if bias is not None:
                        bias = g.call_function(torch.Tensor.expand, (bias, *q.meta["val"].shape[:-1], klen))
                        new.append(bias)
                    out = g.call_function(n.target, (q, kg, vg, bias, True, 0.0, False), kwargs)
                else:
                    out = g.call_function(n.target, (q, kg, vg, 0.0, False), kwargs)
            else:
                out = g.call_function(F.scaled_dot_product_attention, (q, kg, vg), kwargs)
            new.append(out)
        _replace(g, n, out, new)
    g.eliminate_dead_code(is_impure_node=_keeps)
    if synthesized:
        _refuse_length_positions(g, shard, prog, cp)
    gm.recompile()
    return gm


def _fill_sequence_markers(g: fx.Graph, prog, cp: int) -> int:
    """moe_cp::whole_sequence → to_sequence(all_gather(x)), moe_cp::own_tokens → this rank's S/cp tokens of
    narrow(from_sequence(x)), moe_cp::incoming_states → the scan over to_sequence(all_gather(x)) of the
    chunks' state summaries; the shard length S/cp where the graph held any, else 0."""
    marked = [n for n in g.nodes if n.op == "call_function"
              and n.target in WHOLE_SEQUENCE + OWN_TOKENS + INCOMING_STATES + WITH_HALOS]
    shard = 0
    for n in marked:
        x, dim = n.args[0], n.args[1]
        with g.inserting_before(n):
            if n.target in WITH_HALOS:  # models/hf_halos.py: the module runs on its chunks with their halos
                shard, reach = int(x.meta["val"].shape[1]), int(n.args[1])
                if shard // 2 < reach:
                    raise UnsupportedFeatureError(
                        f"{_where(n)}: sequence chunks of {shard // 2} tokens under context parallelism (cp={cp}), "
                        f"shorter than the {reach} tokens before each that this module reads; use longer sequences "
                        "or a smaller cp")
                out = g.call_function(halo_batches, (x, reach, prog.ctx_id, cp))
                _replace(g, n, out, [out])
                continue
            if n.target in INCOMING_STATES:  # models/hf_state_passing.py: the mixer itself runs on the shard
                shard = int(n.args[1])
                gathered = g.call_function(torch.ops.moe_cp.all_gather.default, (x, 0, prog.ctx_id, cp))
                ordered = g.call_function(torch.ops.moe_cp.to_sequence.default, (gathered, 0, cp))
                diagonal = bool(n.args[3] if len(n.args) > 3 else n.kwargs.get("diagonal", False))
                out = g.call_function(scan_incoming_states, (ordered, cp, prog.cp_rank, diagonal))
                _replace(g, n, out, [gathered, ordered, out])
                continue
            if n.target in WHOLE_SEQUENCE:
                shard = int(x.meta["val"].shape[dim])
                gathered = g.call_function(torch.ops.moe_cp.all_gather.default, (x, dim, prog.ctx_id, cp))
                out = g.call_function(torch.ops.moe_cp.to_sequence.default, (gathered, dim, cp))
            else:
                shard = int(x.meta["val"].shape[dim]) // cp
                gathered = g.call_function(torch.ops.moe_cp.from_sequence.default, (x, dim, cp))
                out = g.call_function(torch.narrow, (gathered, dim, prog.cp_rank * shard, shard))
        _replace(g, n, out, [gathered, out])
    return shard


def _reaches(x, targets: tuple, limit: int = 256) -> bool:
    """Whether node ``x`` is computed from a node calling one of ``targets`` (the nearest ``limit`` nodes)."""
    return _computed_from(x, lambda n: n.target in targets, limit)


def _computed_from(x, found, limit: int) -> bool:
    """Whether node ``x`` or one of the nearest ``limit`` nodes it is computed from is ``found``."""
    seen, todo = set(), deque([x] if isinstance(x, fx.Node) else [])
    while todo and len(seen) < limit:
        n = todo.popleft()
        if n in seen:
            continue
        seen.add(n)
        if found(n):
            return True
        todo.extend(n.all_input_nodes)
    return False


def _product_scores(x, shard: int, limit: int = 32) -> bool:
    """Whether node ``x`` is computed (the nearest ``limit`` nodes) from a matrix product whose output ends
    in [S/cp, S/cp]: queries times keys. (DeepSeek-V4's hyper-connections softmax a [S/cp, 4, 4] mixing
    matrix viewed from a linear layer's output; at S/cp = 4 its shape alone looks like scores.)"""
    def product(n: fx.Node) -> bool:
        val = n.meta.get("val")
        return n.op in ("call_function", "call_method") and any(p in str(n.target) for p in ("matmul", "bmm", "einsum")) \
            and isinstance(val, torch.Tensor) and val.dim() >= 2 and tuple(val.shape[-2:]) == (shard, shard)

    return _computed_from(x, product, limit)


def _refuse_eager_attention(nodes: list[fx.Node], shard: int, cp: int) -> None:
    """Attention computed as matmul-softmax beside the SDPA calls the pass rewrites (one layer of the user's
    own, say) would mix the tokens of this rank's shard only: a softmax in an attention module over the last
    axis of [..., S/cp, S/cp] scores (S/cp + 1 with a sink column) made by a matrix product is refused. It
    ran silently on the shard before."""
    for n in nodes:
        if n.op not in ("call_function", "call_method") or "softmax" not in str(n.target) or not n.args:
            continue
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() < 3 or val.shape[-2] != shard \
                or val.shape[-1] not in (shard, shard + 1) or not _has_attention_module([n]):
            continue
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", -1)
        if isinstance(dim, int) and dim % val.dim() != val.dim() - 1:  # not over keys (a pooling gate's window)
            continue
        if not _product_scores(n.args[0], shard):
            continue
        where = module_path(n) or _where(n)
        if val.shape[-1] == shard + 1:
            raise no_sdpa_form(where, True, f"cp={cp}")
        raise UnsupportedFeatureError(
            f"{where}: attention computed as matmul-softmax under context parallelism (cp={cp}) would attend over "
            f"this rank's sequence shard only{user_line(n)}: run it through scaled_dot_product_attention "
            "(transformers: attn_implementation='sdpa'), or use cp=1")


def _replace(g: fx.Graph, n: fx.Node, out: fx.Node, new: list[fx.Node]) -> None:
    """``out`` (made of ``new``) takes the place of attention node ``n``."""
    out.meta.update({k: v for k, v in n.meta.items() if k in ("nn_module_stack", "stack_trace")})
    propagate_fake(sorted(set(new), key=lambda x: list(g.nodes).index(x)))
    n.replace_all_uses_with(out)
    g.erase_node(n)


def _refuse_length_positions(g: fx.Graph, shard: int, prog, cp: int) -> None:
    """A graph that reads no position_ids (its causal mask now takes the shard's global positions) must not
    make positions of its own from the length it sees: an ``arange`` over the shard's length that is still
    used once the model's own masks are replaced (RoPE or a position embedding from 0 … S/cp − 1 on every
    rank). Those in the modules cp_shard_positions rewrites (Llama 4's temperature tuning) are left to it."""
    from .cp_positions import ARANGE, _length, _owner

    for n in g.nodes:
        if n.op != "call_function" or n.target not in ARANGE or _length(n) != shard or not n.users:
            continue
        if _owner(module_path(n), prog.cp_length_positions) is not None:
            continue
        raise UnsupportedFeatureError(
            f"{module_path(n) or _where(n)}: context parallelism (cp={cp}) feeds each shard's global position ids "
            f"to the model as position_ids, but the captured graph reads none and makes positions from the length "
            f"it sees (arange({shard}), this rank's shard only){user_line(n)}: the model's forward must accept "
            "position_ids and use them, or use cp=1")


def _unrepeated(x: fx.Node) -> tuple[fx.Node, int]:
    """(the K/V node before transformers' repeat_kv, the repeated head count) where ``x`` [B, H, S, D] is
    ``x0[:, :, None].expand(B, H0, H/H0, S, D).reshape(B, H, S, D)`` of an ``x0`` [B, H0, S, D]; else (x, 0)."""
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or x.op not in ("call_method", "call_function") \
            or "reshape" not in str(x.target) and "view" not in str(x.target) or not x.args:
        return x, 0
    ex = x.args[0]
    if not isinstance(ex, fx.Node) or "expand" not in str(ex.target) or not ex.args:
        return x, 0
    ins = ex.args[0]  # x0[:, :, None] (or x0.unsqueeze(2), a view to [B, H0, 1, S, D])
    x0 = ins.args[0] if isinstance(ins, fx.Node) and ins.args and isinstance(ins.args[0], fx.Node) \
        and any(f in str(ins.target) for f in ("getitem", "unsqueeze", "view", "reshape")) else None
    v0, vins, vex = (getattr(n, "meta", {}).get("val") for n in (x0, ins, ex))
    if not all(isinstance(t, torch.Tensor) for t in (v0, vins, vex)) or v0.dim() != 4:
        return x, 0
    b, h0, s, d = v0.shape
    heads = val.shape[1]
    if tuple(vins.shape) != (b, h0, 1, s, d) or tuple(vex.shape) != (b, h0, heads // h0, s, d) \
            or tuple(val.shape) != (b, heads, s, d) or heads % h0 or heads == h0:
        return x, 0
    return x0, int(heads)


def halo_reach(window: int, chunk: int, shard: int, cp: int) -> int:
    """The keys before each of a rank's two chunks that a sliding window of ``window`` tokens reads (window − 1),
    where they lie in the chunk before (S/2cp tokens) and the two chunks with them are fewer keys than the
    whole sequence; else 0: the keys are gathered whole and masked (chunked layers too)."""
    reach = window - 1
    if window <= 1 or chunk or reach > shard // 2 or shard + 2 * reach >= shard * cp:
        return 0
    return reach


def _per_layer(n: fx.Node, table: dict[str, int], what: str) -> int:
    """The sliding window or attention chunk of ``n``'s decoder layer (0: none; api.cp_attention_windows,
    api.cp_attention_chunks)."""
    if not table:
        return 0
    if "*" in table:
        return table["*"]
    m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", module_path(n) or "")
    if m is None:
        raise UnsupportedFeatureError(
            f"{_where(n)}: context parallelism (cp) applies {what} of config.layer_types per decoder layer (layers "
            f"{sorted(table, key=int)}), but this attention's layer cannot be told from its module path{user_line(n)}; "
            "use cp=1")
    return table.get(m.group(1), 0)


def _reads(nodes: list[fx.Node], pattern: str) -> bool:
    return any(n.op == "placeholder" and re.search(pattern, n.name) and n.users for n in nodes)


def _check_loss_inputs(nodes: list[fx.Node], mesh, cp: int) -> None:
    """Each rank's labels are its shard's next tokens, shifted before sharding (the shard's last token's
    label is the next shard's first token) and passed as ``shift_labels=`` (and ``labels=``), with the
    whole batch's token count as ``num_items_in_batch`` (pp = 1) so the CP group's summed losses are the
    batch mean. A forward that reads ``labels`` but not ``shift_labels`` would shift the shard again,
    and one that ignores ``num_items_in_batch`` would sum shard means: refused (they were silently off,
    loss 11.1 for 5.6)."""
    # the batch inputs' placeholders (l_kwargs_labels_, …): a parameter's name ends in its own (…_weight_)
    labels, shifted = _reads(nodes, r"(?<!_shift)_labels_?$"), _reads(nodes, r"_shift_labels_?$")
    if labels and not shifted:
        raise UnsupportedFeatureError(
            f"context parallelism (cp={cp}) passes each rank's shard its labels already shifted, as shift_labels= "
            "(transformers' causal-LM loss reads them as they are), but the model's forward reads labels and not "
            "shift_labels, so it would shift them again within the shard: take shift_labels (and "
            "num_items_in_batch) as transformers' loss_function does, or use cp=1")
    if (labels or shifted) and mesh.pp == 1 and not _reads(nodes, r"_num_items_in_batch_?$"):
        raise UnsupportedFeatureError(
            f"context parallelism (cp={cp}) sums the ranks' losses, so each shard's loss must be its token sum over "
            "the whole batch's num_items_in_batch (passed with shift_labels); the model's forward ignores "
            "num_items_in_batch and would return its shard's mean: read it as transformers' loss_function does, "
            "or use cp=1")


def _keeps(n: fx.Node) -> bool:
    """What dead-code elimination must keep: FX's impure nodes, and in-place writes, which it takes for
    pure when they are Tensor methods. A captured graph writes into buffers through them: HF's MLA
    attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, …) builds its keys with new_empty and two slice copy_'s
    that nothing reads, and without them SDPA attended over uninitialised keys. And functorch's level
    changes (torch.func.vmap's _vmap_increment/_vmap_decrement_nesting, as Jamba's associative_scan captures
    them): a level left open broke the next vmapped op (models/hf_mamba_states.py)."""
    if n.is_impure():
        return True
    if n.op == "call_function" and getattr(n.target, "__name__", "").endswith("_nesting"):
        return True
    if n.op == "call_function" and getattr(n.target, "__module__", None) == "_operator":
        return False  # operator.and_ / or_: named like in-place methods, but pure (a dead mask of transformers')
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")
