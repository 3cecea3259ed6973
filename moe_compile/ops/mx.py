"""MXFP8 ops of the quantised graph (inserted by the mxfp8_casts pass after autograd, so they need no
autograd formulas). Payloads are packed qdata–scale rows (uint8 [rows, K + K/32], see mxfp8.py).

    quantize_mx          x[..., K] → packed[..., K + K/32]                      (a cast node)
    weight_cache         w → its FP8WeightStore's compute-weight cache (fwd: [L, out, in+in/32],
                         t: [L, in, out+out/32], each quantised along its contraction dimension)
    grouped_ffn_mx       recv (packed, along d) → out, pre                       (MXFP8 GEMMs)
    grouped_ffn_backward_mx  grad out (packed, along d) → grad recv (BF16/fp32), weight grads
                         (high-precision operands, fp32 accumulation)
    mx_linear            x @ wᵀ with an MXFP8 weight cache (dense linears under mxfp8="…shared"/"all")

The MXFP8 GEMM on CPU is emulated: both operands dequantised exactly to fp32, mm with fp32
accumulation (the Triton ``tl.dot_scaled`` kernel computes the same products on GPUs). The emulation
runs one expert at a time, so its fp32 copies are one expert's weight and rows, not every local
expert's weights at once (those were the step's largest temporaries: the allocator peak was 1.4–1.5×
the graph's working memory on the tiny LM, above the ledger's bound; MX scales are per 32-element
block of a row, so quantising an expert's rows alone gives the same bytes).
"""

from __future__ import annotations

import torch

from ..mxfp8 import dequantize_packed, packed_width, quantize_packed
from .activations import ffn_activation, ffn_activation_backward, ffn_activation_parts


def _k(packed_cols: int) -> int:
    """K of a packed row of K + K/32 bytes."""
    return packed_cols * 32 // 33


def _groups(counts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows, in expert order."""
    out, r = [], 0
    for g, n in enumerate(counts.tolist()):
        if n:
            out.append((g, r, r + n))
        r += n
    return out


def mx_grouped_mm(a_packed: torch.Tensor, b_packed: torch.Tensor, counts: torch.Tensor,
                  out_dtype: torch.dtype, rows: int | None = None) -> torch.Tensor:
    """a [M, K] (packed, along K) times b[g] [N, K] (packed, along K), transposed: [rows or M, N], rows
    past M unspecified."""
    k = _k(a_packed.shape[-1])
    out = a_packed.new_empty(a_packed.shape[0] if rows is None else rows, b_packed.shape[-2], dtype=out_dtype)
    for g, r0, r1 in _groups(counts):
        part = dequantize_packed(a_packed[r0:r1], k) @ dequantize_packed(b_packed[g], k).t()
        out[r0:r1].copy_(part)
    return out


@torch.library.custom_op("moe::quantize_mx", mutates_args=())
def quantize_mx(x: torch.Tensor, mode: str, block: str) -> torch.Tensor:
    return quantize_packed(x, mode)


@quantize_mx.register_fake
def _(x, mode, block):
    return x.new_empty(*x.shape[:-1], packed_width(x.shape[-1]), dtype=torch.uint8)


@torch.library.custom_op("moe::weight_cache", mutates_args=())
def weight_cache(w: torch.Tensor, ctx: int, block: str, which: str, orientation: str) -> torch.Tensor:
    from ..runtime import get_context

    return get_context(ctx).weight_store(block, which).cache(orientation)  # refreshes assign, never write in place


@weight_cache.register_fake
def _(w, ctx, block, which, orientation):
    lead, rows, cols = w.shape[:-2], w.shape[-2], w.shape[-1]
    if orientation == "t":
        rows, cols = cols, rows
    return w.new_empty(*lead, rows, packed_width(cols), dtype=torch.uint8)


@torch.library.custom_op("moe::grouped_ffn_mx", mutates_args=())
def grouped_ffn_mx(
    recv: torch.Tensor,
    counts: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    activation: str,
    gated: bool,
    block: str,
    mode: str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    cap, d, f = recv.shape[0], _k(recv.shape[1]), w_in.shape[1]
    valid = int(counts.sum())
    if not valid:
        return recv.new_empty(cap, d, dtype=dtype), recv.new_empty(cap, f, dtype=dtype)
    p = mx_grouped_mm(recv[:valid], w_in, counts, dtype, rows=cap)
    out = mx_grouped_mm(quantize_packed(ffn_activation(p[:valid], activation, gated), mode), w_out, counts, dtype,
                        rows=cap)
    return out, p


@grouped_ffn_mx.register_fake
def _(recv, counts, w_in, w_out, activation, gated, block, mode, dtype):
    cap, d = recv.shape[0], _k(recv.shape[1])
    return recv.new_empty(cap, d, dtype=dtype), recv.new_empty(cap, w_in.shape[1], dtype=dtype)


@torch.library.custom_op("moe::grouped_ffn_backward_mx", mutates_args=())
def grouped_ffn_backward_mx(
    grad_out: torch.Tensor,
    recv: torch.Tensor,
    pre: torch.Tensor,
    counts: torch.Tensor,
    w_in_t: torch.Tensor,
    w_out_t: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    activation: str,
    gated: bool,
    block: str,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cap, d = recv.shape[0], _k(recv.shape[1])
    dtype = pre.dtype
    g_recv = pre.new_empty(cap, d)  # rows past the valid prefix unspecified
    g_w_in, g_w_out = torch.zeros_like(w_in), torch.zeros_like(w_out)  # an expert without rows: zero gradient
    f = pre.shape[-1]  # (1 + G)·h: the input-gradient GEMM contracts over it
    for g, r0, r1 in _groups(counts):  # one expert at a time (module docstring)
        go = dequantize_packed(grad_out[r0:r1], d)  # high-precision operand of the weight-gradient GEMM
        g_a = (go @ dequantize_packed(w_out_t[g], d).t()).to(dtype)  # MXFP8 GEMM (along d)
        p = pre[r0:r1]
        a, act_gate = ffn_activation_parts(p, activation, gated)
        g_w_out[g] = (go.t() @ a.float()).to(w_out.dtype)  # fp32 operands
        del go, a
        g_pre = ffn_activation_backward(g_a, p, activation, gated, act_gate)
        g_q = dequantize_packed(quantize_packed(g_pre, mode), f)  # MXFP8 GEMM (along (1 + G)·h)
        g_recv[r0:r1] = (g_q @ dequantize_packed(w_in_t[g], f).t()).to(dtype)
        del g_q
        g_w_in[g] = (g_pre.float().t() @ dequantize_packed(recv[r0:r1], d)).to(w_in.dtype)
    return g_recv, g_w_in, g_w_out


@grouped_ffn_backward_mx.register_fake
def _(grad_out, recv, pre, counts, w_in_t, w_out_t, w_in, w_out, activation, gated, block, mode):
    return pre.new_empty(recv.shape[0], _k(recv.shape[1])), torch.empty_like(w_in), torch.empty_like(w_out)


@torch.library.custom_op("moe::mx_linear", mutates_args=())
def mx_linear(x: torch.Tensor, w_cache: torch.Tensor, mode: str, dtype: torch.dtype, block: str) -> torch.Tensor:
    """x [M, K] @ Wᵀ where ``w_cache`` is W [N, K] packed along K; x is quantised along K here."""
    k = x.shape[-1]
    a = dequantize_packed(quantize_packed(x, mode), k)
    b = dequantize_packed(w_cache, k)
    return (a @ b.t()).to(dtype)


@mx_linear.register_fake
def _(x, w_cache, mode, dtype, block):
    return x.new_empty(*x.shape[:-1], w_cache.shape[-2], dtype=dtype)
