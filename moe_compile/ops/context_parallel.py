"""Context-parallel collectives over a rank's CP group (namespace ``moe_cp``; not MoE-block ops):

    moe_cp::all_gather(x, dim, ctx, cp)       → the CP group's shards of x concatenated along dim, in
                                                CP-rank order; backward: moe_cp::reduce_scatter
    moe_cp::reduce_scatter(g, dim, ctx, cp)   → Σ over the CP group of g, this rank's slice along dim
                                                (all-reduce then slice: gloo has no reduce-scatter)

    moe_cp::halo_exchange(tails, ctx, cp)     → the tails of the chunks before this rank's two, from its
                                                neighbours; backward: moe_cp::halo_return

K/V of attention travel through all_gather in forward and their gradients through reduce_scatter
in backward (the all-gather form of context-parallel attention); a sliding window's keys, and what a
convolution or a pooling window reads back, through halo_exchange. ``moe_cp::to_sequence`` /
``moe_cp::from_sequence`` put a gathered tensor in sequence order and back (a causal convolution over the
whole sequence: passes/cp_convs.py). Integer tensors (positions, the padding
mask) have no gradient; ``moe_cp::causal_mask`` makes the attention mask over the gathered keys from them. ``cp`` is the group size, so that fake kernels know the gathered shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import get_context


def _group(ctx: int):
    g = get_context(ctx).cp_group
    if g is None:
        raise RuntimeError(f"runtime context {ctx} has no context-parallel group")
    return g


@torch.library.custom_op("moe_cp::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, ctx: int, cp: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=_group(ctx))
    return torch.cat(parts, dim)


@all_gather.register_fake
def _(x, dim, ctx, cp):
    shape = list(x.shape)
    shape[dim] *= cp
    return x.new_empty(shape)


@torch.library.custom_op("moe_cp::reduce_scatter", mutates_args=())
def reduce_scatter(g: torch.Tensor, dim: int, ctx: int, cp: int) -> torch.Tensor:
    group = _group(ctx)
    total = g.contiguous().clone()
    dist.all_reduce(total, group=group)
    n = g.shape[dim] // cp
    return total.narrow(dim, dist.get_rank(group) * n, n).clone()


@reduce_scatter.register_fake
def _(g, dim, ctx, cp):
    shape = list(g.shape)
    shape[dim] //= cp
    return g.new_empty(shape)


def _setup(ctx, inputs, output):
    ctx.dim, ctx.ctx_id, ctx.cp = inputs[1], inputs[2], inputs[3]


def _backward(ctx, grad):
    return torch.ops.moe_cp.reduce_scatter(grad, ctx.dim, ctx.ctx_id, ctx.cp), None, None, None


def _backward_rs(ctx, grad):
    return torch.ops.moe_cp.all_gather(grad, ctx.dim, ctx.ctx_id, ctx.cp), None, None, None


all_gather.register_autograd(_backward, setup_context=_setup)
reduce_scatter.register_autograd(_backward_rs, setup_context=_setup)


def _gathered_index(seq: int, cp: int, device) -> torch.Tensor:
    """The global token index of each gathered position (rank-major shards)."""
    from ..runtime.context_parallel import shard_positions

    return torch.cat([shard_positions(seq, cp, r) for r in range(cp)]).to(device)


@torch.library.custom_op("moe_cp::to_sequence", mutates_args=())
def to_sequence(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """``x`` gathered over the CP group (rank-major shards along ``dim``) in sequence order; backward:
    moe_cp::from_sequence (the inverse permutation)."""
    return x.index_select(dim, torch.argsort(_gathered_index(x.shape[dim], cp, x.device)))


@torch.library.custom_op("moe_cp::from_sequence", mutates_args=())
def from_sequence(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """``x`` in sequence order along ``dim`` back in the gathered (rank-major) order: rank r's shard is
    the r-th slice of S/cp; backward: moe_cp::to_sequence."""
    return x.index_select(dim, _gathered_index(x.shape[dim], cp, x.device))


def _adjoints(op, other) -> None:
    """Register two linear custom ops of (x, *ints) → x's shape as each other's backward, fakes of x's shape."""
    def setup(ctx, inputs, output):
        ctx.ints = inputs[1:]

    for a, b in ((op, other), (other, op)):
        a.register_fake(lambda x, *ints: torch.empty_like(x))
        a.register_autograd(lambda ctx, g, b=b: (b(g, *ctx.ints), *(None,) * len(ctx.ints)), setup_context=setup)


_adjoints(to_sequence, from_sequence)


@torch.library.custom_op("moe_cp::positions", mutates_args=())
def positions(like: torch.Tensor, seq: int, cp: int, rank: int) -> torch.Tensor:
    """[1, seq/cp] global positions of CP rank ``rank``'s tokens (runtime.context_parallel.shard_positions),
    for a graph that does not take position_ids itself (a later pipeline stage) and in place of positions a
    module makes from the shard's length (passes/cp_positions.py)."""
    from ..runtime.context_parallel import shard_positions

    return shard_positions(seq, cp, rank).to(like.device).unsqueeze(0)


@positions.register_fake
def _(like, seq, cp, rank):
    return like.new_empty((1, seq // cp), dtype=torch.int64)


@torch.library.custom_op("moe_cp::causal_mask", mutates_args=())
def causal_mask(kpos: torch.Tensor, kvalid: torch.Tensor | None, seq: int, cp: int, rank: int,
                packed: bool, window: int, chunk: int) -> torch.Tensor:
    """[b, 1, seq/cp, seq] boolean mask of CP rank ``rank``'s queries over the CP group's gathered keys
    (rank-major shards), transformers' causal mask over the whole sequence: key token ≤ query token (by
    global token index), fewer than ``window`` tokens before the query when ``window`` > 0 (sliding-window
    attention), in the query's chunk of ``chunk`` tokens when ``chunk`` > 0 (chunked attention: Llama 4;
    chunks start after the sequence's left padding, or at each packed sequence's position 0), within one
    packed sequence when ``packed`` (a new one starts where the gathered position ids ``kpos`` [b, seq], back
    in sequence order, do not step by 1), and not a padding key (``kvalid`` [b, seq], the gathered
    attention_mask, 0 at padding)."""
    from ..runtime.context_parallel import shard_positions

    dev = kpos.device
    kidx = _gathered_index(seq, cp, dev)
    order = torch.argsort(kidx)  # gathered keys back in sequence order
    qidx = shard_positions(seq, cp, rank).to(dev)
    b = max(kpos.shape[0], 1 if kvalid is None else kvalid.shape[0])
    m = kidx[None, :] <= qidx[:, None]
    if window > 0:
        m = m & (qidx[:, None] - kidx[None, :] < window)
    m = m.expand(b, -1, -1)
    if chunk > 0:
        if packed:  # transformers maps the chunk rule onto the position ids of packed sequences
            kc = kpos.expand(b, -1) // chunk
            qc = kc[:, rank * (seq // cp):(rank + 1) * (seq // cp)]  # this rank's shard, gathered in rank order
        else:  # chunks start after each sequence's left padding (masking_utils.create_chunked_causal_mask)
            lead = torch.zeros(b, 1, dtype=torch.long, device=dev)
            if kvalid is not None:
                ordered = kvalid.expand(b, -1)[:, order]
                lead = (ordered.cumsum(-1) == 0).sum(-1, keepdim=True)
            kc, qc = (kidx[None, :] - lead) // chunk, (qidx[None, :] - lead) // chunk
        m = m & (kc[:, None, :] == qc[:, :, None])
    if packed:
        in_order = kpos.expand(b, -1)[:, order]
        seg = (torch.diff(in_order, prepend=in_order[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        m = m & (seg[:, kidx][:, None, :] == seg[:, qidx][:, :, None])
    if kvalid is not None:
        m = m & kvalid.expand(b, -1).bool()[:, None, :]
    return m.unsqueeze(1).contiguous()


@causal_mask.register_fake
def _(kpos, kvalid, seq, cp, rank, packed, window, chunk):
    b = max(kpos.shape[0], 1 if kvalid is None else kvalid.shape[0])
    return kpos.new_empty((b, 1, seq // cp, seq), dtype=torch.bool)


@torch.library.custom_op("moe_cp::window_mask", mutates_args=())
def window_mask(kpos: torch.Tensor, kvalid: torch.Tensor | None, seq: int, cp: int, rank: int,
                packed: bool, window: int) -> torch.Tensor:
    """[b, 1, seq/cp, 2L] boolean mask of CP rank ``rank``'s queries (chunks r and 2cp−1−r) over its two key
    spans (moe_cp halo_spans: each chunk after the L − seq/2cp tokens before it, L per span): the causal
    sliding-window mask of transformers over those keys. A chunk's queries see only their own span (at
    r = cp−1 the second span's halo is the first chunk's tail: seen once, from the first span), keys by
    global token index: not before the sequence, key ≤ query, fewer than ``window`` tokens before it; within
    one packed sequence when ``packed`` (``kpos`` [b, 2L], the spans' position ids, restart); not a padding
    key (``kvalid`` [b, 2L], the spans' attention_mask, 0 at padding)."""
    dev = kpos.device
    half, span = seq // (2 * cp), kpos.shape[-1] // 2
    b = max(kpos.shape[0], 1 if kvalid is None else kvalid.shape[0])
    m = torch.zeros(b, 2 * half, 2 * span, dtype=torch.bool, device=dev)
    for s, c in enumerate((rank, 2 * cp - 1 - rank)):
        q = c * half + torch.arange(half, device=dev)
        k = c * half - (span - half) + torch.arange(span, device=dev)
        blk = ((k[None, :] <= q[:, None]) & (q[:, None] - k[None, :] < window) & (k[None, :] >= 0)).expand(b, -1, -1)
        if packed:
            p = kpos.expand(b, -1)[:, s * span:(s + 1) * span]
            seg = (torch.diff(p, prepend=p[:, :1] - 1, dim=-1) != 1).cumsum(-1)
            blk = blk & (seg[:, None, :] == seg[:, span - half:, None])  # a span's last half tokens are its queries
        if kvalid is not None:
            blk = blk & kvalid.expand(b, -1)[:, s * span:(s + 1) * span].bool()[:, None, :]
        m[:, s * half:(s + 1) * half, s * span:(s + 1) * span] = blk
    return m.unsqueeze(1)


@window_mask.register_fake
def _(kpos, kvalid, seq, cp, rank, packed, window):
    b = max(kpos.shape[0], 1 if kvalid is None else kvalid.shape[0])
    return kpos.new_empty((b, 1, seq // cp, kpos.shape[-1]), dtype=torch.bool)


def _marker(name: str) -> RuntimeError:
    return RuntimeError(f"moe_cp::{name} marks where the context-parallel pass makes the sequence whole; it runs only "
                        "inside a program moe_compile built (the pass replaces it), not eagerly")


@torch.library.custom_op("moe_cp::whole_sequence", mutates_args=())
def whole_sequence(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Marker: ``x`` (this shard's tokens along ``dim``) for the whole sequence, in sequence order. Indexed
    attention asks for its keys so (it builds its own mask over them: models/hf_indexed.py), a recurrent token
    mixer for its input (models/hf_mixers.py); the CP pass puts moe_cp::to_sequence(moe_cp::all_gather(x)) in
    its place."""
    raise _marker("whole_sequence")


@whole_sequence.register_fake
def _(x, dim, cp):
    shape = list(x.shape)
    shape[dim] *= cp
    return x.new_empty(shape)


@torch.library.custom_op("moe_cp::whole_mask", mutates_args=())
def whole_mask(mask: torch.Tensor, cp: int) -> torch.Tensor:
    """Marker: the model's boolean mask [b, 1, S/cp, S/cp] of this shard's queries over its keys, for the
    same queries over the whole sequence's keys in sequence order [b, 1, S/cp, S]; the CP pass puts the
    whole sequence's mask (moe_cp::causal_mask, keys in sequence order) in its place."""
    raise _marker("whole_mask")


@whole_mask.register_fake
def _(mask, cp):
    return mask.new_empty((*mask.shape[:-1], mask.shape[-1] * cp))


@torch.library.custom_op("moe_cp::own_tokens", mutates_args=())
def own_tokens(x: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Marker: of ``x`` over the whole sequence in sequence order along ``dim``, this rank's shard's tokens
    (what a token mixer run on moe_cp::whole_sequence returns); the CP pass puts
    narrow(moe_cp::from_sequence(x), rank·S/cp, S/cp) in its place."""
    raise _marker("own_tokens")


@own_tokens.register_fake
def _(x, dim, cp):
    shape = list(x.shape)
    shape[dim] //= cp
    return x.new_empty(shape)


@torch.library.custom_op("moe_cp::incoming_states", mutates_args=())
def incoming_states(summaries: torch.Tensor, shard: int, cp: int, diagonal: bool = False) -> torch.Tensor:
    """Marker: the state a recurrent token mixer enters each of this rank's two sequence chunks with
    (models/hf_state_passing.py). ``summaries`` [2, B, H, dk, dv + t] holds, per chunk (r, then 2cp−1−r),
    the state it leaves from a zero state (the first dv columns, S⁰) and its state transition (the last t:
    leaving state = S⁰ + A·entering state). A is a [dk, dk] matrix (t = dk; the delta rules) or, with
    ``diagonal``, the [dk] diagonal of one (t = 1; the Mamba scans' decays). The result is [2, B, H, dk,
    dv]. The CP pass puts an all-gather in sequence order and the scan over the 2cp chunks in its place.
    ``shard``: S/cp."""
    raise _marker("incoming_states")


@incoming_states.register_fake
def _(summaries, shard, cp, diagonal=False):
    dv = summaries.shape[-1] - (1 if diagonal else summaries.shape[-2])
    return summaries.new_empty((*summaries.shape[:-1], dv))


def scan_incoming_states(ordered: torch.Tensor, cp: int, rank: int, diagonal: bool = False) -> torch.Tensor:
    """What moe_cp::incoming_states becomes, after the all-gather in sequence order: ``ordered`` [2cp, B, H,
    dk, dv + t] holds every chunk's (S⁰ | A); chunk c enters with S_c, S_0 = 0, S_{c+1} = S⁰_c + A_c·S_c
    (A_c ⊙ S_c row by row where ``diagonal``). Returns S_r and S_{2cp−1−r}, [2, B, H, dk, dv]. Plain torch
    ops: autograd runs the scan backward."""
    dv = ordered.shape[-1] - (1 if diagonal else ordered.shape[-2])
    entering = [torch.zeros_like(ordered[0, ..., :dv])]
    for c in range(2 * cp - 1):
        a = ordered[c, ..., dv:]
        entering.append(ordered[c, ..., :dv] + (a * entering[-1] if diagonal else a @ entering[-1]))
    # every rank computes and stacks all 2cp states and narrows out its own two: one graph for every rank
    # (picking two of them would leave ranks' dead scan steps to dead-code elimination, and the programs of
    # an EP group's ranks must match)
    return own_chunks(torch.stack(entering), cp, rank)


@torch.library.custom_op("moe_cp::with_halos", mutates_args=())
def with_halos(x: torch.Tensor, reach: int, cp: int) -> torch.Tensor:
    """Marker: ``x`` [B, S/cp, …] (this rank's chunks r and 2cp−1−r along dim 1) as [2B, reach + S/2cp, …]:
    each chunk with the ``reach`` tokens before it in front (zeros before chunk 0), the two stacked along
    the batch (models/hf_halos.py). The CP pass puts halo_batches in its place."""
    raise _marker("with_halos")


@with_halos.register_fake
def _(x, reach, cp):
    return x.new_empty((2 * x.shape[0], reach + x.shape[1] // 2, *x.shape[2:]))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).view(torch.uint8)


def _swap(to_prev: torch.Tensor, to_next: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``to_prev`` to CP rank r−1 and ``to_next`` to r+1 (those that exist) in one all-to-all that
    moves nothing between other ranks; returns what r−1 and r+1 sent this rank (zeros where none)."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    splits = [int(d in (r - 1, r + 1)) for d in range(n)]
    sends = [t for d, t in ((r - 1, to_prev), (r + 1, to_next)) if 0 <= d < n]
    send = torch.stack(sends).contiguous()
    got = send.new_empty((sum(splits), *to_prev.shape))
    # as bytes, so that any dtype travels (gloo has no float8)
    dist.all_to_all_single(_bytes(got), _bytes(send), splits, splits, group=group)
    parts = iter(got)
    from_prev = next(parts) if r >= 1 else torch.zeros_like(to_prev)
    from_next = next(parts) if r + 1 < n else torch.zeros_like(to_prev)
    return from_prev, from_next


@torch.library.custom_op("moe_cp::halo_exchange", mutates_args=())
def halo_exchange(tails: torch.Tensor, ctx: int, cp: int) -> torch.Tensor:
    """``tails`` [2, …]: the last tokens of this rank's chunks r and 2cp−1−r. Returns [2, …], what comes
    before each chunk in the sequence: chunk r−1's tail (rank r−1's first chunk; zeros before chunk 0) and
    chunk 2cp−2−r's (rank r+1's second, or at r = cp−1 this rank's own first chunk). Only neighbours trade,
    so a rank receives two tails whatever cp is (an all-gather of the tails brought 2cp). Backward:
    moe_cp::halo_return."""
    group = _group(ctx)
    from_prev, from_next = _swap(tails[1], tails[0], group)
    last = dist.get_rank(group) == cp - 1
    return torch.stack([from_prev, tails[0] if last else from_next])


@torch.library.custom_op("moe_cp::halo_return", mutates_args=())
def halo_return(grad: torch.Tensor, ctx: int, cp: int) -> torch.Tensor:
    """The gradient of moe_cp::halo_exchange's ``tails`` from that of its output: each halo's gradient goes
    back to the rank whose tail it was and adds to it there."""
    group = _group(ctx)
    last = dist.get_rank(group) == cp - 1
    from_prev, from_next = _swap(grad[0], grad[1], group)  # rank cp−1's second halo is its own first tail
    return torch.stack([from_next + grad[1] if last else from_next, from_prev])


_adjoints(halo_exchange, halo_return)


def chunks_with_halos(x: torch.Tensor, dim: int, reach: int, ctx: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of ``x`` (its S/cp tokens along ``dim``: chunks r, 2cp−1−r), each with the
    ``reach`` tokens before it in front, stacked: [2, …, reach + S/2cp along dim, …]. The chunks' last
    ``reach`` tokens travel to the ranks that need them (moe_cp::halo_exchange); zeros before chunk 0."""
    dim %= x.dim()
    half = x.shape[dim] // 2
    chunks = torch.stack([x.narrow(dim, 0, half), x.narrow(dim, half, half)])
    before = torch.ops.moe_cp.halo_exchange(chunks.narrow(dim + 1, half - reach, reach).contiguous(), ctx, cp)
    return torch.cat([before, chunks], dim + 1)


def halo_batches(x: torch.Tensor, reach: int, ctx: int, cp: int) -> torch.Tensor:
    """What moe_cp::with_halos becomes: chunks_with_halos along the sequence (dim 1), flattened into the
    batch, [2B, reach + S/2cp, …]."""
    return chunks_with_halos(x, 1, reach, ctx, cp).flatten(0, 1)


def halo_spans(x: torch.Tensor, dim: int, reach: int, ctx: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim``, each after the ``reach`` tokens before it, side by side:
    [… 2·(reach + S/2cp) …] (the keys of sliding-window attention, masked by moe_cp::window_mask)."""
    spans = chunks_with_halos(x, dim, reach, ctx, cp)
    return torch.cat([spans[0], spans[1]], dim % x.dim())


def own_chunks(ordered: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Of ``ordered`` [2cp, …] (one entry per sequence chunk, in sequence order), this rank's chunks r and
    2cp−1−r, [2, …]; the same ops on every rank (its chunk indices are constants)."""
    return torch.cat([ordered.narrow(0, rank, 1), ordered.narrow(0, 2 * cp - 1 - rank, 1)])


class LossSum(torch.autograd.Function):
    """Σ over the CP group of each rank's part of the whole-sequence loss; every rank then holds the
    whole loss, and backward hands each rank's part gradient 1 (its tokens' share), not cp."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group) -> torch.Tensor:
        total = part.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
