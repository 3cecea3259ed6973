"""Expert-side MoE ops: permute, grouped expert FFN, router-weighted unpermute, and the logical
routed-experts op of the dense stage.

Shapes (T tokens on this rank, K = top_k, R = T·K routed rows, N experts, L local experts,
cap = receive capacity, d = d_model, h = h_e, F = 2h for gated (SwiGLU) FFNs else h)::

    permute       x[T,d], idx[T,K]            → xs[R,d] (expert order), order[R], counts[N]
    grouped_ffn   recv[cap,d], counts[L], w_in[L,F,d], w_out[L,d,h] (, b_in[L,F], b_out[L,d]) → out[cap,d], pre[cap,F]
    unpermute     back[R,d], order[R], weights[T,K] → y[T,d] = Σ_k weights[t,k] · back[row(t,k)]

Rows past the valid prefix of a capacity-sized buffer are never read; their contents are unspecified
(zeroing them would cost a capacity-sized write per buffer: ep_mp·T·K rows when dropless).
"""

from __future__ import annotations

import torch

from .activations import ffn_activation, ffn_activation_backward, ffn_activation_parts
from .grouped_mm import grouped_mm, pad_rows

# -- permute ------------------------------------------------------------------------------------


@torch.library.custom_op("moe::permute", mutates_args=())
def permute(
    x: torch.Tensor, idx: torch.Tensor, num_experts: int, block: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xs = x.index_select(0, order // idx.shape[1])
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return xs, order, counts


@permute.register_fake
def _(x, idx, num_experts, block):
    r = idx.numel()
    return (
        x.new_empty(r, x.shape[1]),
        idx.new_empty(r, dtype=torch.int64),
        idx.new_empty(num_experts, dtype=torch.int64),
    )


@torch.library.custom_op("moe::permute_backward", mutates_args=())
def permute_backward(grad_xs: torch.Tensor, order: torch.Tensor, num_tokens: int, top_k: int, block: str) -> torch.Tensor:
    g = grad_xs.new_zeros(num_tokens, grad_xs.shape[1])
    return g.index_add_(0, order // top_k, grad_xs)


@permute_backward.register_fake
def _(grad_xs, order, num_tokens, top_k, block):
    return grad_xs.new_empty(num_tokens, grad_xs.shape[1])


def _permute_setup(ctx, inputs, output):
    x, idx, _, block = inputs
    ctx.save_for_backward(output[1])
    ctx.cfg = (x.shape[0], idx.shape[1], block)
    ctx.mark_non_differentiable(output[1], output[2])


def _permute_bwd(ctx, g_xs, _g_order, _g_counts):
    (order,) = ctx.saved_tensors
    return torch.ops.moe.permute_backward(g_xs, order, *ctx.cfg), None, None, None


permute.register_autograd(_permute_bwd, setup_context=_permute_setup)

# -- unpermute (router-weighted accumulation into token order) ----------------------------------


def _sorted_weights(weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return weights.reshape(-1).index_select(0, order).unsqueeze(1)


@torch.library.custom_op("moe::unpermute", mutates_args=())
def unpermute(back: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, block: str) -> torch.Tensor:
    contrib = (back * _sorted_weights(weights, order)).to(back.dtype)
    y = back.new_zeros(weights.shape[0], back.shape[1])
    return y.index_add_(0, order // weights.shape[1], contrib)


@unpermute.register_fake
def _(back, order, weights, block):
    return back.new_empty(weights.shape[0], back.shape[1])


@torch.library.custom_op("moe::unpermute_backward", mutates_args=())
def unpermute_backward(
    grad_y: torch.Tensor, back: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, block: str
) -> tuple[torch.Tensor, torch.Tensor]:
    g_rows = grad_y.index_select(0, order // weights.shape[1])
    ws = _sorted_weights(weights, order)
    # per-row dots as a batched GEMM, and the weighting in place when the dtypes allow: no [R, d]
    # temporaries beyond g_rows (on CPU each fresh [R, d] buffer costs page faults, not only bandwidth)
    g_ws = torch.bmm(g_rows.to(ws.dtype).unsqueeze(1), back.to(ws.dtype).unsqueeze(2)).view(-1)
    same = g_rows.dtype == back.dtype == torch.promote_types(g_rows.dtype, ws.dtype)
    g_back = g_rows.mul_(ws) if same else (g_rows * ws).to(back.dtype)
    g_w = torch.zeros_like(weights).reshape(-1).index_copy_(0, order, g_ws.to(weights.dtype))
    return g_back, g_w.view_as(weights)


@unpermute_backward.register_fake
def _(grad_y, back, order, weights, block):
    return torch.empty_like(back), torch.empty_like(weights)


def _unpermute_setup(ctx, inputs, output):
    back, order, weights, block = inputs
    ctx.save_for_backward(back, order, weights)
    ctx.block = block


def _unpermute_bwd(ctx, grad_y):
    back, order, weights = ctx.saved_tensors
    g_back, g_w = torch.ops.moe.unpermute_backward(grad_y, back, order, weights, ctx.block)
    return g_back, None, g_w, None


unpermute.register_autograd(_unpermute_bwd, setup_context=_unpermute_setup)

# -- grouped expert FFN over the valid prefix ---------------------------------------------------
# Optional expert biases (gpt-oss): b_in [L, F] added to the first GEMM's rows, b_out [L, d] to the
# second's, each row taking its expert's bias (rows are in expert order: counts[e] rows of expert e).


def _bias_rows(b: torch.Tensor | None, counts: torch.Tensor, rows: int) -> torch.Tensor | None:
    return None if b is None else b.repeat_interleave(counts, dim=0, output_size=rows)


def _ffn_rows(x, counts, w_in, w_out, activation, gated, b_in=None, b_out=None):
    pre = grouped_mm(x, w_in.transpose(-2, -1), counts)
    if b_in is not None:
        pre = pre + _bias_rows(b_in, counts, x.shape[0])
    out = grouped_mm(ffn_activation(pre, activation, gated), w_out.transpose(-2, -1), counts)
    if b_out is not None:
        out = out + _bias_rows(b_out, counts, x.shape[0])
    return out, pre


@torch.library.custom_op("moe::grouped_ffn", mutates_args=())
def grouped_ffn(
    recv: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    activation: str,
    gated: bool,
    block: str,
    b_in: torch.Tensor | None = None,
    b_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    valid = int(counts.sum())
    if not valid:
        return recv.new_empty(recv.shape[0], w_out.shape[1]), recv.new_empty(recv.shape[0], w_in.shape[1])
    o, p = _ffn_rows(recv[:valid], counts, w_in, w_out, activation, gated, b_in, b_out)
    return pad_rows(o, recv.shape[0]), pad_rows(p, recv.shape[0])


@grouped_ffn.register_fake
def _(recv, counts, w_in, w_out, activation, gated, block, b_in=None, b_out=None):
    return recv.new_empty(recv.shape[0], w_out.shape[1]), recv.new_empty(recv.shape[0], w_in.shape[1])


def _ffn_backward_rows(grad_out, recv, pre, counts, w_in, w_out, activation, gated):
    """(g_recv [cap, d], g_w_in, g_w_out, g_pre [valid, F], valid) of the grouped FFN; valid > 0."""
    valid = int(counts.sum())
    go, x, p = grad_out[:valid], recv[:valid], pre[:valid]
    g_a = grouped_mm(go, w_out, counts)
    a, act_gate = ffn_activation_parts(p, activation, gated)
    g_w_out = grouped_mm(go.t(), a, counts)
    g_pre = ffn_activation_backward(g_a, p, activation, gated, act_gate)
    g_recv = pad_rows(grouped_mm(g_pre, w_in, counts), recv.shape[0])
    g_w_in = grouped_mm(g_pre.t(), x, counts)
    return g_recv, g_w_in, g_w_out, g_pre


def _ffn_input_grad(grad_out, recv, pre, counts, w_in, w_out, activation, gated) -> torch.Tensor:
    """g_recv [cap, d] of the grouped FFN alone (no weight gradients: the experts are frozen)."""
    valid = int(counts.sum())
    if not valid:
        return torch.zeros_like(recv)
    g_a = grouped_mm(grad_out[:valid], w_out, counts)
    a, act_gate = ffn_activation_parts(pre[:valid], activation, gated)
    g_pre = ffn_activation_backward(g_a, pre[:valid], activation, gated, act_gate)
    return pad_rows(grouped_mm(g_pre, w_in, counts), recv.shape[0])


@torch.library.custom_op("moe::grouped_ffn_backward", mutates_args=())
def grouped_ffn_backward(
    grad_out: torch.Tensor,
    recv: torch.Tensor,
    pre: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    activation: str,
    gated: bool,
    block: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not int(counts.sum()):
        return torch.empty_like(recv), torch.zeros_like(w_in), torch.zeros_like(w_out)
    return _ffn_backward_rows(grad_out, recv, pre, counts, w_in, w_out, activation, gated)[:3]


@grouped_ffn_backward.register_fake
def _(grad_out, recv, pre, counts, w_in, w_out, activation, gated, block):
    return torch.empty_like(recv), torch.empty_like(w_in), torch.empty_like(w_out)


def _segment_sum(g: torch.Tensor, counts: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-expert sums of rows in expert order: [L, cols] (the gradient of a per-expert bias)."""
    experts = torch.arange(counts.shape[0], device=g.device).repeat_interleave(counts, output_size=g.shape[0])
    return torch.zeros_like(like).index_add_(0, experts, g.to(like.dtype))


@torch.library.custom_op("moe::grouped_ffn_biased_backward", mutates_args=())
def grouped_ffn_biased_backward(
    grad_out: torch.Tensor,
    recv: torch.Tensor,
    pre: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    b_in: torch.Tensor,
    b_out: torch.Tensor,
    activation: str,
    gated: bool,
    block: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grouped_ffn_backward with the expert biases' gradients (a separate op: bias-free graphs and the
    Triton / MXFP8 twins of grouped_ffn_backward keep their schema)."""
    valid = int(counts.sum())
    if not valid:
        zeros = (torch.zeros_like(t) for t in (w_in, w_out, b_in, b_out))
        return (torch.empty_like(recv), *zeros)
    g_recv, g_w_in, g_w_out, g_pre = _ffn_backward_rows(grad_out, recv, pre, counts, w_in, w_out, activation, gated)
    return g_recv, g_w_in, g_w_out, _segment_sum(g_pre, counts, b_in), _segment_sum(grad_out[:valid], counts, b_out)


@grouped_ffn_biased_backward.register_fake
def _(grad_out, recv, pre, counts, w_in, w_out, b_in, b_out, activation, gated, block):
    return tuple(torch.empty_like(t) for t in (recv, w_in, w_out, b_in, b_out))


def _ffn_setup(ctx, inputs, output):
    recv, counts, w_in, w_out, activation, gated, block, b_in, b_out = inputs
    biases = (b_in, b_out) if b_in is not None else ()
    if (b_in is None) != (b_out is None):
        raise ValueError(f"{block}: grouped_ffn takes both expert biases or neither")
    ctx.save_for_backward(recv, output[1], counts, w_in, w_out, *biases)
    ctx.cfg = (activation, gated, block)
    ctx.mark_non_differentiable(output[1])


def _ffn_bwd(ctx, g_out, _g_pre):
    recv, pre, counts, w_in, w_out, *biases = ctx.saved_tensors
    if biases:
        g = torch.ops.moe.grouped_ffn_biased_backward(g_out, recv, pre, counts, w_in, w_out, *biases, *ctx.cfg)
        return g[0], None, g[1], g[2], None, None, None, g[3], g[4]
    g_recv, g_w_in, g_w_out = torch.ops.moe.grouped_ffn_backward(g_out, recv, pre, counts, w_in, w_out, *ctx.cfg)
    return g_recv, None, g_w_in, g_w_out, None, None, None, None, None


grouped_ffn.register_autograd(_ffn_bwd, setup_context=_ffn_setup)

# -- logical routed experts (dense stage) -------------------------------------------------------


def _local_only(ctx: int, block: str, w_in: torch.Tensor, num_experts: int) -> None:
    from ..errors import RuntimeFault
    from ..runtime import get_context

    if get_context(ctx).ep_size != 1 or w_in.shape[0] != num_experts:
        raise RuntimeFault(
            f"{block}: the logical routed-experts op ran un-partitioned with {w_in.shape[0]} of {num_experts} "
            "experts on this rank; it only runs eagerly when one rank holds every expert (run the compiled "
            "program instead)"
        )


@torch.library.custom_op("moe::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    activation: str,
    gated: bool,
    num_experts: int,
    ctx: int,
    block: str,
    b_in: torch.Tensor | None = None,
    b_out: torch.Tensor | None = None,
) -> torch.Tensor:
    _local_only(ctx, block, w_in, num_experts)
    xs, order, counts = permute(x, idx, num_experts, block)
    out, _ = grouped_ffn(xs, counts, w_in, w_out, activation, gated, block, b_in, b_out)
    return unpermute(out, order, weights, block)


@routed_experts.register_fake
def _(x, idx, weights, w_in, w_out, activation, gated, num_experts, ctx, block, b_in=None, b_out=None):
    return torch.empty_like(x)


def _re_setup(ctx, inputs, output):
    x, idx, weights, w_in, w_out, activation, gated, num_experts, _ctx, block, b_in, b_out = inputs
    ctx.save_for_backward(x, idx, weights, w_in, w_out, *((b_in, b_out) if b_in is not None else ()))
    ctx.cfg = (activation, gated, num_experts, block)


def _re_bwd(ctx, grad_y):
    # Eager-only path (the compiled program never keeps this node): recompute, then run the mirrors.
    x, idx, weights, w_in, w_out, *biases = ctx.saved_tensors
    activation, gated, n, block = ctx.cfg
    xs, order, counts = permute(x, idx, n, block)
    out, pre = grouped_ffn(xs, counts, w_in, w_out, activation, gated, block, *biases)
    g_out, g_w = unpermute_backward(grad_y, out, order, weights, block)
    g_b = (None, None)
    need = ctx.needs_input_grad  # as long as the inputs given (the biases are optional)
    if not any(need[i] for i in (3, 4, 10, 11) if i < len(need)):  # frozen experts (and the probe's backward)
        g_x = None
        if need[0]:
            g_xs = _ffn_input_grad(g_out, xs, pre, counts, w_in, w_out, activation, gated)
            g_x = permute_backward(g_xs, order, x.shape[0], idx.shape[1], block)
        return g_x, None, g_w, None, None, None, None, None, None, None, None, None
    if biases:
        g_xs, g_w_in, g_w_out, *g_b = grouped_ffn_biased_backward(
            g_out, xs, pre, counts, w_in, w_out, *biases, activation, gated, block)
    else:
        g_xs, g_w_in, g_w_out = grouped_ffn_backward(g_out, xs, pre, counts, w_in, w_out, activation, gated, block)
    g_x = permute_backward(g_xs, order, x.shape[0], idx.shape[1], block)
    return g_x, None, g_w, g_w_in, g_w_out, None, None, None, None, None, *g_b


routed_experts.register_autograd(_re_bwd, setup_context=_re_setup)
