"""Transport MoE ops: dispatch, combine and their backward mirrors.

    dispatch          xs[R,d], counts[N] → recv[cap,d] (expert-major, valid prefix), recv_counts[L],
                                           layout[2,ep,ep,L] (requested / kept rows)
    combine           out[cap,d], layout → back[R,d] (rows returned to where they came from)
    dispatch_backward grad recv[cap,d]  → grad xs[R,d]   (moves rows in the combine direction)
    combine_backward  grad back[R,d]    → grad out[cap,d] (moves rows in the dispatch direction)

``ctx`` names the runtime context (transport, counters); ``block`` the MoE block, for counters and
errors. Router-weighted accumulation happens in ``moe::unpermute`` after combine.
"""

from __future__ import annotations

import torch

from ..errors import RuntimeFault
from ..runtime import get_context, keep_counts
from ..runtime.dropless import find_dropless_state


def _ctx(ctx: int, ep_size: int, block: str):
    c = get_context(ctx)
    if c.ep_size != ep_size:
        raise RuntimeFault(f"{block}: graph compiled for an EP-MP group of {ep_size} runs in one of {c.ep_size}")
    return c


@torch.library.custom_op("moe::dispatch", mutates_args=())
def dispatch(
    xs: torch.Tensor, counts: torch.Tensor, ctx: int, block: str, capacity: int, ep_size: int,
    own_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``capacity``: this rank's receive rows. ``own_capacity`` (compiled programs): on the all_to_all
    transport each rank sends its capacity with its counts, so ranks whose buffers differ (batches of
    different shapes, or a graph compiled before the dropless capacity grew) take every destination's
    own; otherwise (direct calls, the symmetric transport, whose lease plans must agree) one capacity
    for every rank, same rows required."""
    c = _ctx(ctx, ep_size, block)
    sent = counts.view(ep_size, -1)
    ragged = own_capacity and c.transport.name == "all_to_all"
    if ragged:  # one more column: [dst, L + 1], the last this rank's capacity (in every dst row)
        sent = torch.cat([sent, sent.new_full((ep_size, 1), capacity)], 1)
    requested = c.transport.exchange_counts(sent, block)
    caps = capacity
    if ragged:
        caps = requested[:, 0, -1]  # [ep] each rank's receive rows
        requested = requested[..., :-1].contiguous()
    kept = keep_counts(requested, caps)
    watch = find_dropless_state(ctx)
    if watch is not None and block in watch.blocks:  # dropless: would any rank receive more than capacity?
        watch.observe(requested, caps)  # tensors only; settled once per forward (runtime.dropless)
    layout = torch.stack([requested, kept])
    recv = c.transport.dispatch_rows(xs, layout, capacity, "dispatch", block, same_rows=not ragged)
    c.stats.record_counts(block, counts, kept[c.ep_rank].reshape(-1))
    return recv, kept[:, c.ep_rank, :].sum(0), layout


@dispatch.register_fake
def _(xs, counts, ctx, block, capacity, ep_size, own_capacity=False):
    nl = counts.shape[0] // ep_size
    return (
        xs.new_empty(capacity, xs.shape[1]),
        counts.new_empty(nl),
        counts.new_empty(2, ep_size, ep_size, nl),
    )


@torch.library.custom_op("moe::dispatch_backward", mutates_args=())
def dispatch_backward(grad_recv: torch.Tensor, layout: torch.Tensor, ctx: int, block: str, num_rows: int) -> torch.Tensor:
    c = _ctx(ctx, layout.shape[1], block)
    return c.transport.return_rows(grad_recv, layout, num_rows, "dispatch_backward", block)


@dispatch_backward.register_fake
def _(grad_recv, layout, ctx, block, num_rows):
    return grad_recv.new_empty(num_rows, grad_recv.shape[1])


def _dispatch_setup(ctx, inputs, output):
    xs, _counts, c, block = inputs[:4]
    ctx.save_for_backward(output[2])
    ctx.cfg = (c, block, xs.shape[0])
    ctx.mark_non_differentiable(output[1], output[2])


def _dispatch_bwd(ctx, g_recv, _g_counts, _g_layout):
    (layout,) = ctx.saved_tensors
    return torch.ops.moe.dispatch_backward(g_recv, layout, *ctx.cfg), None, None, None, None, None, None


dispatch.register_autograd(_dispatch_bwd, setup_context=_dispatch_setup)


@torch.library.custom_op("moe::combine", mutates_args=())
def combine(out: torch.Tensor, layout: torch.Tensor, ctx: int, block: str, num_rows: int) -> torch.Tensor:
    c = _ctx(ctx, layout.shape[1], block)
    return c.transport.return_rows(out, layout, num_rows, "combine", block)


@combine.register_fake
def _(out, layout, ctx, block, num_rows):
    return out.new_empty(num_rows, out.shape[1])


@torch.library.custom_op("moe::combine_backward", mutates_args=())
def combine_backward(grad_back: torch.Tensor, layout: torch.Tensor, ctx: int, block: str, capacity: int) -> torch.Tensor:
    c = _ctx(ctx, layout.shape[1], block)
    # the forward dispatch's layout: its drops were agreed there (whatever rows each rank routes)
    return c.transport.dispatch_rows(grad_back, layout, capacity, "combine_backward", block, same_rows=False)


@combine_backward.register_fake
def _(grad_back, layout, ctx, block, capacity):
    return grad_back.new_empty(capacity, grad_back.shape[1])


def _combine_setup(ctx, inputs, output):
    out, layout, c, block, _rows = inputs
    ctx.save_for_backward(layout)
    ctx.cfg = (c, block, out.shape[0])


def _combine_bwd(ctx, g_back):
    (layout,) = ctx.saved_tensors
    return torch.ops.moe.combine_backward(g_back, layout, *ctx.cfg), None, None, None, None


combine.register_autograd(_combine_bwd, setup_context=_combine_setup)


@torch.library.custom_op("moe::local_layout", mutates_args=())
def local_layout(counts: torch.Tensor, ctx: int, block: str) -> torch.Tensor:
    """Layout of a dispatch inside an EP-MP group of one rank with nothing dropped (what lowering
    leaves of dispatch/combine there: no rows move)."""
    c = get_context(ctx)
    c.stats.record_counts(block, counts, counts)
    return torch.stack([counts, counts]).view(2, 1, 1, -1)


@local_layout.register_fake
def _(counts, ctx, block):
    return counts.new_empty(2, 1, 1, counts.shape[0])
