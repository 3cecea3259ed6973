"""Expert-FFN inlining for dense fusion: moe::grouped_ffn and moe::grouped_ffn_backward become their
GEMMs as opaque ops (moe::expert_mm, moe::expert_mm_weight_grad) around the activation written in aten,
so inductor compiles the activation's elementwise work into one loop each way:

    grouped_ffn           pre = expert_mm(recv, w_inᵀ);  a = act(pre);  out = expert_mm(a, w_outᵀ)
    grouped_ffn_backward  g_a = expert_mm(g_out, w_out);  a, g_pre = act(pre), act'(pre)·g_a  (one loop)
                          g_w_out = expert_mm_weight_grad(g_out, a);  g_recv = expert_mm(g_pre, w_in)
                          g_w_in = expert_mm_weight_grad(g_pre, recv)

The ops' own kernels run the gated activation as 2 eager passes forward and 5 backward (act(gate), ·up,
their recompute, the two halves of the derivative), each over [rows, h] tensors that a CPU step faults
in and streams through memory; fused, each direction reads pre once and writes its outputs once. The
GEMMs are the same grouped GEMMs over the same valid prefix. Only the bias-free forms on CPU are inlined
(the biased backward is another op; see ``_applies`` for GPUs); the activation then runs over every row of the capacity-sized buffer,
those past the valid prefix included (their values are unspecified and nothing reads them), so dense
fusion inlines it only at ep_mp = 1, where the buffer is exactly the routed rows (under EP the dropless
buffer holds 1.5× to ep_mp× of them, and the trade has not been measured there).

Only for dense_fusion="inductor", on the executable copy (``row_decompositions.inline_row_ops``).
"""

from __future__ import annotations

import torch

from ..ops.activations import act_backward, ffn_activation_backward, ffn_activation_parts, is_plain


def _activation_grad(g_a, pre, activation: str, gated: bool, act_gate):
    """ffn_activation_backward without its ``out=`` writes into the halves of one buffer (inductor takes
    functional graphs; the cat below fuses into the loop that computes both halves)."""
    if not (gated and is_plain(activation)):
        return ffn_activation_backward(g_a, pre, activation, gated, act_gate)
    g, u = pre.chunk(2, dim=-1)
    return torch.cat([act_backward(activation, g_a * u, g), g_a * act_gate], dim=-1)


def _grouped_ffn(recv, counts, w_in, w_out, activation, gated):
    mm = torch.ops.moe.expert_mm
    pre = mm(recv, w_in.transpose(-2, -1), counts)
    a, _ = ffn_activation_parts(pre, activation, gated)
    return mm(a, w_out.transpose(-2, -1), counts), pre


def _grouped_ffn_backward(grad_out, recv, pre, counts, w_in, w_out, activation, gated):
    mm, wgrad = torch.ops.moe.expert_mm, torch.ops.moe.expert_mm_weight_grad
    g_a = mm(grad_out, w_out, counts)
    a, act_gate = ffn_activation_parts(pre, activation, gated)
    g_pre = _activation_grad(g_a, pre, activation, gated, act_gate)
    return mm(g_pre, w_in, counts), wgrad(g_pre, recv, counts), wgrad(grad_out, a, counts)


def _applies(arity: int, rows_arg: int):
    """Bias-free (``arity`` args) and on CPU: each expert_mm reads the valid row count on the host, a
    device sync per GEMM on a GPU, where the Triton kernels (codegen's GPU default) run the FFN anyway."""
    return lambda *args: len(args) == arity and args[rows_arg].device.type == "cpu"


# op name → (decomposition, whether it applies), over the node's args without the trailing block name
FFN_DECOMPOSITIONS = {
    "grouped_ffn": (_grouped_ffn, _applies(6, 0)),
    "grouped_ffn_backward": (_grouped_ffn_backward, _applies(8, 1)),
}
