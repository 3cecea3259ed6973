"""cp_causal_convs — a causal convolution over the sequence sees the tokens before its shard (cp > 1).

Glossary: C / CP, S. Short causal convolutions (LFM2's conv layers, the short convolutions of linear
attention, Inkling's key and value convolutions: depthwise, kernel k, padding k − 1, the output's first
tokens kept) mix each token with the k − 1 before it, which under context parallelism lie on another rank
at every shard boundary (a shard is chunks r and 2cp−1−r of 2cp). This pass gives each of the rank's two
chunks its halo, the k − 1 tokens before it: each chunk's last k − 1 tokens go to the neighbouring rank
that needs them (moe_cp::halo_exchange; a zero halo before chunk 0, the convolution's own padding), and
each chunk is convolved unpadded behind its halo:

    y' = pad(cat(conv1d(halo_r ‖ chunk_r), conv1d(halo_s ‖ chunk_s)), (0, k − 1))    s = 2cp−1−r

y' has the shape of the node it replaces, whose users keep its first S/cp positions as before; backward
sends the halos' gradient back to the ranks that hold those tokens (moe_cp::halo_return). Where a chunk is shorter than
k − 1 the halo would span several chunks: the whole sequence is gathered, convolved in sequence order
and this rank's tokens kept instead. A conv1d over the shard's sequence that is not of this form
(strided, dilated, not padded by k − 1, or read past the shard's first S/cp outputs) is refused, naming
its module. api._check_context_parallel admits models whose every Conv1d is such a short causal one.

Requires DENSE, ensures DENSE. A no-op at cp = 1.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import UnsupportedFeatureError
from ..ir import Stage
from ..ops.context_parallel import chunks_with_halos, halo_batches
from ..viz.graph import module_path
from .base import PassContext, moe_pass, propagate_fake, user_line
from .context_parallel import _reaches

TO_SEQUENCE = (torch.ops.moe_cp.to_sequence, torch.ops.moe_cp.to_sequence.default)

CONV1D = (torch.conv1d, F.conv1d, torch.ops.aten.conv1d.default)
_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _args(n: fx.Node) -> dict:
    got = dict(_DEFAULTS)
    got.update(zip(_NAMES, n.args))
    got.update(n.kwargs)
    return got


def _one(v) -> object:
    return v[0] if isinstance(v, list | tuple) and len(v) == 1 else v


def _shard_length(nodes: list[fx.Node], cp: int) -> int | None:
    """S/cp: from the position ids or token ids the graph takes, the positions the CP pass made for it,
    or (a later pipeline stage of convolution layers only) the [B, S/cp, d] hidden states it receives."""
    vals = [(n, n.meta.get("val")) for n in nodes if n.op == "placeholder"]
    for n, v in vals:
        if isinstance(v, torch.Tensor) and ("position_ids" in n.name or "input_ids" in n.name):
            return int(v.shape[-1])
    for n in nodes:
        if n.op == "call_function" and n.target is torch.ops.moe_cp.positions.default:
            return int(n.args[1]) // cp
    hidden = [v for _, v in vals if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 3]
    return int(hidden[0].shape[1]) if hidden else None


def _reads_prefix(user: fx.Node, n: fx.Node, length: int) -> bool:
    """Whether ``user`` keeps the first ``length`` (or fewer) positions of the last axis of ``n`` only."""
    if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not n:
        return False
    idx = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
    *lead, last = idx
    return (lead in ([slice(None)] * 2, [Ellipsis]) and isinstance(last, slice)
            and last.start in (None, 0) and last.step in (None, 1) and isinstance(last.stop, int)
            and 0 < last.stop <= length)


def _with_halos(g: fx.Graph, x: fx.Node, a: dict, k: int, shard: int, cp: int, prog) -> list[fx.Node]:
    """The convolution over this rank's chunks, each with its k − 1 halo tokens: [B, C, S/cp], this rank's
    outputs in its own order (no padding needed: the halo is the causal context)."""
    haloed = g.call_function(chunks_with_halos, (x, -1, k - 1, prog.ctx_id, cp))
    flat = g.call_function(torch.flatten, (haloed, 0, 1))  # [2B, C, k − 1 + S/2cp]
    conv = g.call_function(torch.conv1d, (flat, a["weight"], a["bias"], 1, 0, 1, a["groups"]))
    pair = g.call_function(torch.unflatten, (conv, 0, (2, -1)))
    first, second = (g.call_function(operator.getitem, (pair, i)) for i in (0, 1))
    return [haloed, flat, conv, pair, first, second, g.call_function(torch.cat, ((first, second), 2))]


@moe_pass(requires=Stage.DENSE, ensures=Stage.DENSE)
def cp_causal_convs(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    prog = ctx.program
    cp = prog.mesh.cp
    if cp == 1:
        return gm
    g = gm.graph
    nodes = list(g.nodes)
    convs = [n for n in nodes if n.op == "call_function" and n.target in CONV1D]
    if not convs:
        return gm
    shard = _shard_length(nodes, cp)
    for n in convs:
        a = _args(n)
        x, w = a["input"], a["weight"]
        xv, wv = x.meta["val"], w.meta["val"]
        if shard is None:
            raise UnsupportedFeatureError(
                f"{module_path(n) or n.name}: a convolution under context parallelism (cp={cp}) in a graph whose "
                f"sequence shard length cannot be told (no position ids, token ids or hidden states){user_line(n)}; "
                "use cp=1")
        if xv.dim() == 3 and xv.shape[-1] == shard * cp and _reaches(x, TO_SEQUENCE):
            continue  # inside a token mixer that runs on the whole sequence (models/hf_mixers.py)
        if _reaches(x, (halo_batches,)):
            continue  # inside a module that runs on its chunks with their halos (models/hf_halos.py)
        if xv.dim() != 3 or xv.shape[-1] != shard:
            raise UnsupportedFeatureError(
                f"{module_path(n) or n.name}: a convolution over an axis of {xv.shape[-1]} under context parallelism "
                f"(cp={cp}), not this rank's sequence shard of {shard} tokens{user_line(n)}: only short causal "
                "convolutions over the sequence are made whole; use cp=1")
        k = int(wv.shape[-1])
        if k == 1 and _one(a["stride"]) == 1 and _one(a["padding"]) == 0:
            continue  # pointwise: no token reads another, the shard's own convolution is exact
        causal = _one(a["stride"]) == 1 and _one(a["dilation"]) == 1 and _one(a["padding"]) == k - 1
        if not causal or not n.users or not all(_reads_prefix(u, n, shard) for u in n.users):
            raise UnsupportedFeatureError(
                f"{module_path(n) or n.name}: a convolution over the sequence under context parallelism (cp={cp}) "
                f"that is not a short causal one (stride 1, dilation 1, padding kernel − 1 = {k - 1}, its first "
                f"S/cp outputs kept; here stride {a['stride']}, dilation {a['dilation']}, padding {a['padding']})"
                f"{user_line(n)}: it would see this rank's shard only; use cp=1")
        with g.inserting_before(n):
            if shard // 2 >= k - 1:
                new = _with_halos(g, x, a, k, shard, cp, prog)
            else:  # a chunk shorter than the kernel's reach: the whole sequence
                seq = shard * cp
                gathered = g.call_function(torch.ops.moe_cp.all_gather.default, (x, 2, prog.ctx_id, cp))
                whole = g.call_function(torch.ops.moe_cp.to_sequence.default, (gathered, 2, cp))
                conv = g.call_function(n.target, (whole, *n.args[1:]), dict(n.kwargs))
                kept = g.call_function(torch.narrow, (conv, 2, 0, seq))
                ranked = g.call_function(torch.ops.moe_cp.from_sequence.default, (kept, 2, cp))
                new = [gathered, whole, conv, kept, ranked,
                       g.call_function(torch.narrow, (ranked, 2, prog.cp_rank * shard, shard))]
            out = g.call_function(F.pad, (new[-1], (0, k - 1)))
        new.append(out)
        for m in new:
            m.meta.update({key: v for key, v in n.meta.items() if key in ("nn_module_stack", "stack_trace")})
        propagate_fake(new)
        n.replace_all_uses_with(out)
        g.erase_node(n)
    gm.recompile()
    return gm
