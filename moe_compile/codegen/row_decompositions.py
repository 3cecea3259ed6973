"""Row-op inlining for dense fusion: the routed-row ops that are pure index arithmetic become aten nodes,
so inductor fuses each into one loop with the dense code next to it.

    moe::unpermute           y[t]      = Σ_k w[t,k] · back[pos[t,k]]
    moe::unpermute_backward  g_back[r] = grad_y[order[r] // K] · w[order[r]],   g_w[t,k] = ⟨grad_y[t], back[pos[t,k]]⟩
    moe::permute_backward    g_x[t]    = Σ_k grad_xs[pos[t,k]]

with ``pos`` the inverse of the expert order (``pos[order[r]] = r``: where row (t, k) landed). Their torch
kernels scatter-add over [R, d] temporaries (R = T·K routed rows: 8× the tokens at top-8); written as
gathers into token order, each output row is a sum of K gathered rows (unrolled over K) that inductor
emits as a single loop with no [R, d] buffer and no zero-filled accumulator. The gathers sum the K rows in k order where
the kernels add them in expert order, so results differ by rounding only (and reduced-precision inputs
accumulate in float32 here).

Only for dense_fusion="inductor": eagerly the gather form would materialise the same [T, K, d] rows. The
lowered graph itself (``prog.graphs``) keeps the moe:: nodes; only the executable copy is rewritten.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from .ffn_decompositions import FFN_DECOMPOSITIONS


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """pos with pos[order[r]] = r (order is a permutation of the R routed rows)."""
    rows = torch.arange(order.shape[0], device=order.device, dtype=order.dtype)
    return torch.zeros_like(order).scatter(0, order, rows)


def _sum_over_k(rows_of: Callable[[int], torch.Tensor], top_k: int) -> torch.Tensor:
    """Σ_k rows_of(k), unrolled: inductor then emits one pointwise loop over [T, d], vectorised along d
    (as a reduction over a K dimension it would vectorise the short K axis with scalar gathers)."""
    acc = rows_of(0)
    for k in range(1, top_k):
        acc = acc + rows_of(k)
    return acc


def _unpermute(back, order, weights):
    t, k = weights.shape
    acc = torch.promote_types(back.dtype, weights.dtype)
    pos, w = _inverse(order).view(t, k), weights.to(acc)
    return _sum_over_k(lambda j: back[pos[:, j]].to(acc) * w[:, j:j + 1], k).to(back.dtype)


def _unpermute_backward(grad_y, back, order, weights):
    t, k = weights.shape
    acc = torch.promote_types(grad_y.dtype, weights.dtype)
    w_sorted = weights.reshape(-1)[order].to(acc).unsqueeze(1)
    g_back = (grad_y[order // k].to(acc) * w_sorted).to(back.dtype)
    rows = back[_inverse(order).view(t, k)].to(acc)
    g_w = (grad_y.to(acc).unsqueeze(1) * rows).sum(-1).to(weights.dtype)
    return g_back, g_w


def _permute_backward(grad_xs, order, num_tokens, top_k):
    acc = torch.promote_types(grad_xs.dtype, torch.float32)
    pos = _inverse(order).view(num_tokens, top_k)
    return _sum_over_k(lambda j: grad_xs[pos[:, j]].to(acc), top_k).to(grad_xs.dtype)


def _rows_match(back: torch.Tensor, order: torch.Tensor) -> bool:
    return back.shape[0] == order.shape[0]  # the gather form reads every routed row exactly once


# op name → (decomposition, whether it applies), both over the node's args without the trailing block name
ROW_DECOMPOSITIONS: dict[str, tuple[Callable, Callable]] = {
    "unpermute": (_unpermute, lambda back, order, w: _rows_match(back, order)),
    "unpermute_backward": (_unpermute_backward, lambda gy, back, order, w: _rows_match(back, order)),
    "permute_backward": (_permute_backward, lambda g, order, t, k: g.shape[0] == order.shape[0] == t * k),
}


def _decomposition(n: fx.Node, ffn: bool) -> Callable | None:
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != "moe":
        return None
    name = t._overloadpacket.__name__
    entry = ROW_DECOMPOSITIONS.get(name) or (FFN_DECOMPOSITIONS.get(name) if ffn else None)
    if entry is None or n.kwargs:
        return None
    fn, applies = entry
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in n.args[:-1]]  # the last arg: block
    if any(isinstance(a, fx.Node) and not isinstance(v, torch.Tensor) for a, v in zip(n.args, vals)):
        return None
    return fn if applies(*vals) else None


def _trace(fn: Callable, n: fx.Node) -> fx.Graph:
    """The aten graph of ``fn`` on the node's fake values (its tensor args become the placeholders)."""
    args = list(n.args[:-1])
    slots = [i for i, a in enumerate(args) if isinstance(a, fx.Node)]
    fake = [args[i].meta["val"] for i in slots]

    def over_tensors(*ts):
        full = list(args)
        for i, v in zip(slots, ts):
            full[i] = v
        return fn(*full)

    with detect_fake_mode(fake):
        return make_fx(over_tensors, tracing_mode="real")(*fake).graph


def _splice(out: fx.Graph, sub: fx.Graph, inputs: list, origin: str):
    """Copy ``sub``'s nodes into ``out`` (placeholders bound to ``inputs``); its result node(s)."""
    local: dict[fx.Node, fx.Node] = {}
    bound = iter(inputs)
    for s in sub.nodes:
        if s.op == "placeholder":
            local[s] = next(bound)
        elif s.op == "output":
            res = fx.map_arg(s.args[0], local.__getitem__)
            return tuple(res) if isinstance(res, (tuple, list)) else res
        else:
            local[s] = out.node_copy(s, local.__getitem__)
            local[s].meta["moe_inlined_from"] = origin
    raise AssertionError("a traced graph without an output node")


def inline_row_ops(gm: fx.GraphModule, ffn: bool = True) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` with every applicable row op (and, with ``ffn``, expert FFN: ffn_decompositions.py)
    replaced by its aten graph; and how many were."""
    out = fx.Graph()
    env: dict[fx.Node, object] = {}
    inlined = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and isinstance(env.get(n.args[0]), tuple):
            env[n] = env[n.args[0]][n.args[1]]  # an output of an inlined multi-output op
            continue
        fn = _decomposition(n, ffn)
        if fn is None:
            env[n] = out.node_copy(n, env.__getitem__)
            continue
        env[n] = _splice(out, _trace(fn, n), [env[a] for a in n.args if isinstance(a, fx.Node)], n.name)
        inlined += 1
    return fx.GraphModule(gm, out), inlined
