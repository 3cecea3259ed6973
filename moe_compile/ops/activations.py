"""Expert activations by name: forward and the exact aten backward kernels autograd would use.

An activation is a name, or a name with parameters as ``name(k=v,...)`` (ExpertsSpec.op_activation):

    silu | gelu | gelu_tanh | relu       act(gate)·up (gated) or act(x)
    relu2                                relu(x)² (Nemotron-H's ungated experts)
    clamped_swiglu(alpha, limit, up_offset)
                                         g = min(gate, limit), u = clamp(up, ±limit):
                                         (u + up_offset) · g·σ(alpha·g)   (gpt-oss, MiniMax-M3; HY-V4: α=1, offset 0)
    softcap_swiglu(gate_cap, up_cap)     cap(gate)·σ(gate)·cap(up), cap(x) = c·tanh(x/c), in fp32 (Inkling 2)

The first four (the "plain" ones) are what the Triton and MXFP8 kernels implement.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")  # plain: every kernel implements them
UNGATED_ONLY = ("relu2",)
GATED_ONLY = ("clamped_swiglu", "softcap_swiglu")


@functools.cache
def parse_activation(activation: str) -> tuple[str, dict[str, float]]:
    """("clamped_swiglu", {"alpha": 1.702, …}) from "clamped_swiglu(alpha=1.702,…)"."""
    if "(" not in activation:
        return activation, {}
    name, rest = activation.rstrip(")").split("(", 1)
    return name, {k: float(v) for k, v in (kv.split("=") for kv in rest.split(",") if kv)}


def is_plain(activation: str) -> bool:
    return activation in ACTIVATIONS


def act_forward(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    if name == "relu2":
        return torch.square(F.relu(x))
    raise ValueError(f"unknown expert activation {name!r}; supported: {ACTIVATIONS + UNGATED_ONLY}")


def act_backward(name: str, grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """d act(x)/dx · grad, with the same aten kernels eager autograd calls; written into ``out`` (which
    may be a strided view, e.g. one half of [gate | up]) when given."""
    if name == "relu2":  # square'(r) = 2r, then relu's threshold backward (as autograd chains them)
        r = F.relu(x)
        g = torch.ops.aten.threshold_backward.default(grad * (2 * r), r, 0)
        return g if out is None else out.copy_(g)
    if name == "silu":
        op, args, kw = torch.ops.aten.silu_backward, (grad, x), {}
    elif name == "gelu":
        op, args, kw = torch.ops.aten.gelu_backward, (grad, x), {}
    elif name == "gelu_tanh":
        op, args, kw = torch.ops.aten.gelu_backward, (grad, x), {"approximate": "tanh"}
    elif name == "relu":
        op, args, kw = torch.ops.aten.threshold_backward, (grad, F.relu(x), 0), {}
    else:
        raise ValueError(f"unknown expert activation {name!r}; supported: {ACTIVATIONS + UNGATED_ONLY}")
    if out is None:
        return op.default(*args, **kw)
    return op.grad_input(*args, **kw, grad_input=out)


def ffn_activation(pre: torch.Tensor, activation: str, gated: bool) -> torch.Tensor:
    """The expert FFN's hidden activation from the first GEMM's output: act(gate)·up (gated, pre =
    [gate | up]) or act(pre)."""
    return ffn_activation_parts(pre, activation, gated)[0]


def ffn_activation_parts(pre: torch.Tensor, activation: str, gated: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a, act(gate)) — the activation and, for gated FFNs, the activated gate its backward reuses
    (None for the parametrised gated forms, whose backward recomputes what it needs)."""
    name, p = parse_activation(activation)
    if name in GATED_ONLY:
        g, u = pre.chunk(2, dim=-1)
        return (_clamped_swiglu(g, u, **p) if name == "clamped_swiglu" else _softcap_swiglu(g, u, **p)), None
    if not gated:
        return act_forward(name, pre), None
    g, u = pre.chunk(2, dim=-1)
    ag = act_forward(name, g)
    return ag * u, ag


def ffn_activation_backward(grad_a: torch.Tensor, pre: torch.Tensor, activation: str, gated: bool,
                            act_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient w.r.t. ``pre`` of ``ffn_activation``, as eager autograd computes it ([gate | up] side
    by side, without a cat); ``act_gate`` = act(gate) if already computed."""
    name, p = parse_activation(activation)
    if name in GATED_ONLY:
        g, u = pre.chunk(2, dim=-1)
        fn = _clamped_swiglu_backward if name == "clamped_swiglu" else _softcap_swiglu_backward
        return torch.cat(fn(grad_a, g, u, **p), dim=-1)
    if not gated:
        return act_backward(name, grad_a, pre)
    g, u = pre.chunk(2, dim=-1)
    h = g.shape[1]
    out = pre.new_empty(pre.shape)
    act_backward(name, grad_a * u, g, out=out[:, :h])
    torch.mul(grad_a, act_gate if act_gate is not None else act_forward(name, g), out=out[:, h:])
    return out


# -- parametrised gated forms (same operation order as the transformers forwards) ---------------


def _clamped_swiglu(g, u, alpha: float, limit: float, up_offset: float):
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    if alpha == 1.0 and up_offset == 0.0:  # silu(g)·u, with silu's own kernel (HY-V4)
        return F.silu(gc) * uc
    return (uc + up_offset) * (gc * torch.sigmoid(gc * alpha))


def _clamped_swiglu_backward(grad, g, u, alpha: float, limit: float, up_offset: float):
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    s = torch.sigmoid(gc * alpha)
    g_glu = grad * (uc + up_offset)
    if alpha == 1.0 and up_offset == 0.0:
        g_gc = torch.ops.aten.silu_backward.default(g_glu, gc)
    else:
        g_gc = g_glu * s + torch.ops.aten.sigmoid_backward.default(g_glu * gc, s) * alpha
    g_g = torch.where(g <= limit, g_gc, 0.0)  # clamp passes the gradient where it did not clamp
    g_u = torch.where((u >= -limit) & (u <= limit), grad * (gc * s), 0.0)
    return g_g, g_u


def _cap(x, c: float):
    return torch.tanh(x / c) * c


def _softcap_swiglu(g, u, gate_cap: float, up_cap: float):
    dtype = g.dtype
    g, u = g.float(), u.float()
    return (_cap(g, gate_cap) * torch.sigmoid(g) * _cap(u, up_cap)).to(dtype)


def _softcap_swiglu_backward(grad, g, u, gate_cap: float, up_cap: float):
    dtype = g.dtype
    grad, g, u = grad.float(), g.float(), u.float()
    tg, tu, s = torch.tanh(g / gate_cap), torch.tanh(u / up_cap), torch.sigmoid(g)
    cg, cu = tg * gate_cap, tu * up_cap
    g_cg = grad * cu * s
    g_s = grad * cu * cg
    g_g = torch.ops.aten.tanh_backward.default(g_cg * gate_cap, tg) / gate_cap + torch.ops.aten.sigmoid_backward.default(g_s, s)
    g_u = torch.ops.aten.tanh_backward.default(grad * (cg * s) * up_cap, tu) / up_cap
    return g_g.to(dtype), g_u.to(dtype)
