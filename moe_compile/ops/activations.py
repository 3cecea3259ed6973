"""Expert activations by name: forward and the exact aten backward kernels autograd would use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def act_forward(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unknown expert activation {name!r}; supported: {ACTIVATIONS}")


def act_backward(name: str, grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """d act(x)/dx · grad, with the same aten kernels eager autograd calls; written into ``out`` (which
    may be a strided view, e.g. one half of [gate | up]) when given."""
    if name == "silu":
        op, args, kw = torch.ops.aten.silu_backward, (grad, x), {}
    elif name == "gelu":
        op, args, kw = torch.ops.aten.gelu_backward, (grad, x), {}
    elif name == "gelu_tanh":
        op, args, kw = torch.ops.aten.gelu_backward, (grad, x), {"approximate": "tanh"}
    elif name == "relu":
        op, args, kw = torch.ops.aten.threshold_backward, (grad, F.relu(x), 0), {}
    else:
        raise ValueError(f"unknown expert activation {name!r}; supported: {ACTIVATIONS}")
    if out is None:
        return op.default(*args, **kw)
    return op.grad_input(*args, **kw, grad_input=out)


def ffn_activation(pre: torch.Tensor, activation: str, gated: bool) -> torch.Tensor:
    """The expert FFN's hidden activation from the first GEMM's output: act(gate)·up (gated, pre =
    [gate | up]) or act(pre)."""
    return ffn_activation_parts(pre, activation, gated)[0]


def ffn_activation_parts(pre: torch.Tensor, activation: str, gated: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a, act(gate)) — the activation and, for gated FFNs, the activated gate its backward reuses."""
    if not gated:
        return act_forward(activation, pre), None
    g, u = pre.chunk(2, dim=-1)
    ag = act_forward(activation, g)
    return ag * u, ag


def ffn_activation_backward(grad_a: torch.Tensor, pre: torch.Tensor, activation: str, gated: bool,
                            act_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient w.r.t. ``pre`` of ``ffn_activation``, as eager autograd computes it ([gate | up] side
    by side, without a cat); ``act_gate`` = act(gate) if already computed."""
    if not gated:
        return act_backward(activation, grad_a, pre)
    g, u = pre.chunk(2, dim=-1)
    h = g.shape[1]
    out = pre.new_empty(pre.shape)
    act_backward(activation, grad_a * u, g, out=out[:, :h])
    torch.mul(grad_a, act_gate if act_gate is not None else act_forward(activation, g), out=out[:, h:])
    return out
