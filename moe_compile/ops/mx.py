"""MXFP8 ops of the quantised graph (inserted by the mxfp8_casts pass after autograd, so they need no
autograd formulas). Payloads are packed qdata–scale rows (uint8 [rows, K + K/32], see mxfp8.py).

    quantize_mx          x[..., K] → packed[..., K + K/32]                      (a cast node)
    weight_cache         w → its FP8WeightStore's compute-weight cache (fwd: [L, out, in+in/32],
                         t: [L, in, out+out/32], each quantised along its contraction dimension)
    grouped_ffn_mx       recv (packed, along d) → out, pre                       (MXFP8 GEMMs)
    grouped_ffn_backward_mx  grad out (packed, along d) → grad recv (BF16/fp32), weight grads
                         (high-precision operands, fp32 accumulation)
    mx_linear            x @ wᵀ with an MXFP8 weight cache (dense linears under mxfp8="…shared"/"all")

The MXFP8 GEMM on CPU is emulated: both operands dequantised exactly to fp32, grouped mm with fp32
accumulation (the Triton ``tl.dot_scaled`` kernel computes the same products on GPUs).
"""

from __future__ import annotations

import torch

from ..mxfp8 import dequantize_packed, packed_width, quantize_packed
from .activations import ffn_activation, ffn_activation_backward, ffn_activation_parts
from .grouped_mm import grouped_mm, pad_rows


def _k(packed_cols: int) -> int:
    """K of a packed row of K + K/32 bytes."""
    return packed_cols * 32 // 33


def mx_grouped_mm(a_packed: torch.Tensor, b_packed: torch.Tensor, counts: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] (packed, along K) times b[g] [N, K] (packed, along K), transposed: [M, N]."""
    k = _k(a_packed.shape[-1])
    a = dequantize_packed(a_packed, k)
    b = dequantize_packed(b_packed, k)
    return grouped_mm(a, b.transpose(-2, -1), counts).to(out_dtype)


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
    p = mx_grouped_mm(recv[:valid], w_in, counts, dtype)
    out = mx_grouped_mm(quantize_packed(ffn_activation(p, activation, gated), mode), w_out, counts, dtype)
    return pad_rows(out, cap), pad_rows(p, cap)


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
    valid = int(counts.sum())
    if not valid:
        return pre.new_empty(cap, d), torch.zeros_like(w_in), torch.zeros_like(w_out)
    go_p, p = grad_out[:valid], pre[:valid]
    go = dequantize_packed(go_p, d)  # high-precision operand of the weight-gradient GEMM
    g_a = grouped_mm(go, dequantize_packed(w_out_t, d).transpose(-2, -1), counts).to(dtype)  # MXFP8 GEMM (along d)
    a, act_gate = ffn_activation_parts(p, activation, gated)
    g_w_out = grouped_mm(go.t(), a.float(), counts)  # fp32 operands
    g_pre = ffn_activation_backward(g_a, p, activation, gated, act_gate)
    g_recv = pad_rows(mx_grouped_mm(quantize_packed(g_pre, mode), w_in_t, counts, dtype), cap)
    x = dequantize_packed(recv[:valid], d)
    g_w_in = grouped_mm(g_pre.float().t(), x, counts)
    return g_recv, g_w_in.to(w_in.dtype), g_w_out.to(w_out.dtype)


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
