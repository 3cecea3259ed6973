"""``moe_triton::`` ops: the Triton-backed twins of the moe:: ops that lowering swaps in.

Each has the schema of the moe:: op it replaces (taken from it) and its fake kernel (the moe:: op
run on fake tensors), so lowered graphs stay traceable and shape-checked; its kernel launches the
generated Triton kernels (kernels/), imported only when first run. A *plan function* per op lists the
launches it makes for given (fake) arguments: lowering records them for ``CompiledMoE.kernels()``.

    moe_triton::permute             route_map (histogram, scan, route rows) + permute gather
    moe_triton::permute_backward    invert order + unpermute (unweighted)
    moe_triton::grouped_ffn         grouped GEMM (up) → grouped GEMM (down, activation fused in its prologue)
    moe_triton::grouped_ffn_backward  grouped GEMM (grad a, activation backward fused in its epilogue),
                                    weight-gradient GEMMs (down: activation recomputed in the prologue; up),
                                    grouped GEMM (grad input)
    moe_triton::unpermute           invert order + unpermute (router-weighted, deterministic)
    moe_triton::unpermute_backward  unpermute backward
    moe_triton::quantize_mx         MXFP8 quantise (kernels/mxfp8.py)
    moe_triton::grouped_ffn_mx      MXFP8 grouped GEMM (tl.dot_scaled) → activation fused with quantise →
                                    MXFP8 grouped GEMM; its backward stays on the emulated torch path

Rows past the valid prefix of capacity-sized outputs are left unwritten (never read), as in moe::.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kernel_cache import LaunchPlan
from .lowering_table import register_triton_lowering
from .triton_mode import kernel_module as _k

# -- kernels of each op ------------------------------------------------------------------------------


def permute_impl(x, idx, num_experts, block):
    return _k("permute").permute(x, idx, num_experts)


def plan_permute(x, idx, num_experts, block) -> list[LaunchPlan]:
    rm, flat = _k("route_map"), idx.reshape(-1)
    return [rm.plan_histogram(flat, num_experts), rm.plan_scan(flat, num_experts),
            rm.plan_route_rows(flat, num_experts), _k("permute").plan_gather(x, idx.numel(), idx.shape[1])]


def permute_backward_impl(grad_xs, order, num_tokens, top_k, block):
    return _k("unpermute").permute_backward(grad_xs, order, num_tokens, top_k)


def plan_permute_backward(grad_xs, order, num_tokens, top_k, block) -> list[LaunchPlan]:
    return [_k("route_map").plan_invert(order), _k("unpermute").plan_unpermute(grad_xs, num_tokens, top_k, False)]


def unpermute_impl(back, order, weights, block):
    return _k("unpermute").unpermute(back, order, weights)


def plan_unpermute(back, order, weights, block) -> list[LaunchPlan]:
    t, k = weights.shape
    return [_k("route_map").plan_invert(order), _k("unpermute").plan_unpermute(back, t, k, True)]


def unpermute_backward_impl(grad_y, back, order, weights, block):
    return _k("unpermute").unpermute_backward(grad_y, back, order, weights)


def plan_unpermute_backward(grad_y, back, order, weights, block) -> list[LaunchPlan]:
    return [_k("unpermute").plan_unpermute_backward(back, weights)]


def _prologue(gated: bool) -> str:
    return "gated" if gated else "act"


def grouped_ffn_impl(recv, counts, w_in, w_out, activation, gated, block):
    gg = _k("grouped_gemm")
    pre = gg.grouped_mm(recv, w_in.transpose(1, 2), counts)
    out = gg.grouped_mm(pre, w_out.transpose(1, 2), counts, prologue=_prologue(gated), activation=activation)
    return out, pre


def plan_grouped_ffn(recv, counts, w_in, w_out, activation, gated, block) -> list[LaunchPlan]:
    gg = _k("grouped_gemm")
    pre = recv.new_empty(recv.shape[0], w_in.shape[1])
    return [gg.plan_grouped_mm(recv, w_in.transpose(1, 2), counts),
            gg.plan_grouped_mm(pre, w_out.transpose(1, 2), counts, _prologue(gated), "none", activation)]


def grouped_ffn_backward_impl(grad_out, recv, pre, counts, w_in, w_out, activation, gated, block):
    gg = _k("grouped_gemm")
    epilogue = "gated_backward" if gated else "act_backward"
    g_pre = gg.grouped_mm(grad_out, w_out, counts, epilogue=epilogue, activation=activation, e=pre)
    g_w_out = gg.grouped_mm_wgrad(grad_out, pre, counts, prologue=_prologue(gated), activation=activation)
    g_recv = gg.grouped_mm(g_pre, w_in, counts)
    g_w_in = gg.grouped_mm_wgrad(g_pre, recv, counts)
    return g_recv, g_w_in, g_w_out


def plan_grouped_ffn_backward(grad_out, recv, pre, counts, w_in, w_out, activation, gated, block) -> list[LaunchPlan]:
    gg = _k("grouped_gemm")
    epilogue = "gated_backward" if gated else "act_backward"
    return [gg.plan_grouped_mm(grad_out, w_out, counts, "none", epilogue, activation),
            gg.plan_grouped_mm_wgrad(grad_out, pre, counts, _prologue(gated), activation),
            gg.plan_grouped_mm(pre, w_in, counts),
            gg.plan_grouped_mm_wgrad(pre, recv, counts)]


# -- MXFP8 (issue 3's kernels: quantise, activation fused with quantise, tl.dot_scaled grouped GEMM) ------


def quantize_mx_impl(x, mode, block):
    return _k("mxfp8").quantize(x, mode)


def plan_quantize_mx(x, mode, block) -> list[LaunchPlan]:
    return [_k("mxfp8").plan_quantize(x, mode)]


def grouped_ffn_mx_impl(recv, counts, w_in, w_out, activation, gated, block, mode, dtype):
    mx = _k("mxfp8")
    pre = mx.grouped_gemm(recv, w_in, counts, dtype)
    a = mx.quantize(pre, mode, activation, gated)  # the activation fused into the quantise
    return mx.grouped_gemm(a, w_out, counts, dtype), pre


def plan_grouped_ffn_mx(recv, counts, w_in, w_out, activation, gated, block, mode, dtype) -> list[LaunchPlan]:
    mx = _k("mxfp8")
    pre = recv.new_empty(recv.shape[0], w_in.shape[1], dtype=dtype)
    a = recv.new_empty(recv.shape[0], w_out.shape[2], dtype=torch.uint8)
    return [mx.plan_grouped_gemm(recv, w_in, dtype), mx.plan_quantize(pre, mode, activation, gated),
            mx.plan_grouped_gemm(a, w_out, dtype)]


# -- registration: moe_triton::<name> with moe::<name>'s schema and fake kernel -----------------------

IMPLS: dict[str, tuple[Callable, Callable[..., list[LaunchPlan]]]] = {
    "permute": (permute_impl, plan_permute),
    "permute_backward": (permute_backward_impl, plan_permute_backward),
    "grouped_ffn": (grouped_ffn_impl, plan_grouped_ffn),
    "grouped_ffn_backward": (grouped_ffn_backward_impl, plan_grouped_ffn_backward),
    "unpermute": (unpermute_impl, plan_unpermute),
    "unpermute_backward": (unpermute_backward_impl, plan_unpermute_backward),
    "quantize_mx": (quantize_mx_impl, plan_quantize_mx),
    "grouped_ffn_mx": (grouped_ffn_mx_impl, plan_grouped_ffn_mx),
}


def _schema_of(name: str) -> str:
    """moe::<name>'s schema without its name: '(Tensor x, …) -> (Tensor, …)'."""
    s = str(getattr(torch.ops.moe, name).default._schema)
    return s[s.index("("):]


def _register(name: str, impl: Callable) -> None:
    op = torch.library.custom_op(f"moe_triton::{name}", impl, mutates_args=(), schema=_schema_of(name))
    reference = getattr(torch.ops.moe, name).default
    op.register_fake(lambda *args, _ref=reference: _ref(*args))


for _name, (_impl, _plan) in IMPLS.items():
    _register(_name, _impl)
    register_triton_lowering(_name, f"moe_triton::{_name}", _plan)
