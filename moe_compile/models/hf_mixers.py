"""Recurrent token mixers under context parallelism: those that pass no states run on the whole sequence.

Linear attention and Mamba layers carry a state from token to token, so a sequence shard (chunks r and
2cp−1−r of 2cp) cannot run them alone. The delta rules and Mamba scans transformers ships as plain torch
functions (Qwen3-Next, Qwen3.5-MoE, Lara, Kimi-Linear, Bailing-Hybrid; Jamba, Nemotron-H,
GraniteMoE-Hybrid) and MiniMax's lightning attention pass states between the ranks' chunks instead and
stay sharded (models/hf_state_passing.py, models/hf_lightning_states.py). Any other (none of the families
transformers ships today; a user's own) runs on the whole sequence: under cp > 1 its mixer module gets,
while compiled, the whole sequence's input in sequence order and hands back this rank's tokens:

    hidden_states (and any [B, S/cp, …] argument: the padding mask, positions) → moe_cp::whole_sequence
    its output (the first element of a tuple)                                  → moe_cp::own_tokens

The CP pass fills both markers in (an all-gather in sequence order; the inverse order, then this rank's
S/cp tokens). It is exact: forward as on one device, and backward reduce-scatters the gathered input's
gradient, so every rank's tokens get the gradient that the other ranks' later tokens send back through the
recurrence. The cost is not sharded: every rank of the CP group runs these layers over all S tokens
(compute and saved activations ×cp for them; attention, MoE and MLP layers stay sharded). Run eagerly
(not being compiled), the module runs as it was.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.nn as nn

from ..errors import UnsupportedFeatureError
from .hf_state_passing import use_state_passing

# config.layer_types / layers_block_type entries (transformers names Mamba layers "linear_attention" in
# layer_types too). The Mamba scans transformers ships pass states (models/hf_mamba_states.py).
RECURRENT_KINDS = ("linear_attention", "mamba")
MIXER_NAMES = ("linear_attn", "mixer", "mamba", "self_attn")  # the mixer child of such a decoder layer


def recurrent_layers(model: nn.Module) -> list[int]:
    """The decoder layers whose config kind is a recurrent token mixer."""
    cfg = getattr(model, "config", None)
    found = set()
    for kinds in (getattr(cfg, "layer_types", None), getattr(cfg, "layers_block_type", None)):
        found |= {i for i, k in enumerate(kinds or []) if str(k) in RECURRENT_KINDS}
    return sorted(found)


def recurrent_mixers(model: nn.Module) -> dict[int, tuple[str, nn.Module]] | None:
    """Layer index → (path, module) of each recurrent layer's mixer: a child named as in MIXER_NAMES whose
    forward takes ``hidden_states``; None when some recurrent layer has none."""
    layers = {int(m.group(2)): (p, mod) for p, mod in model.named_modules()
              if (m := re.search(r"(^|\.)layers\.(\d+)$", p))}
    out = {}
    for i in recurrent_layers(model):
        path, layer = layers.get(i, (None, None))
        child = next((n for n in MIXER_NAMES if isinstance(getattr(layer, n, None), nn.Module)
                      and "hidden_states" in inspect.signature(getattr(layer, n).forward).parameters), None)
        if child is None:
            return None
        out[i] = (f"{path}.{child}", getattr(layer, child))
    return out


def _whole(x, shard: int, cp: int):
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == shard:
        if x.dtype == torch.bool:  # gloo gathers no bool
            return torch.ops.moe_cp.whole_sequence(x.to(torch.uint8), 1, cp).bool()
        return torch.ops.moe_cp.whole_sequence(x, 1, cp)
    if isinstance(x, tuple | list) and x and all(isinstance(t, torch.Tensor) for t in x):
        return type(x)(_whole(t, shard, cp) for t in x)
    return x


def _before(m: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the whole sequence's input, while being compiled."""
    if not torch.compiler.is_compiling():
        return None
    cp, path = m._moe_cp_mixer
    bound = inspect.signature(type(m).forward).bind(m, *args, **kwargs)
    hidden = bound.arguments["hidden_states"]
    mask = bound.arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        raise UnsupportedFeatureError(
            f"{path}: a recurrent token mixer given a {mask.dim()}-D attention mask under context parallelism "
            f"(cp={cp}): it runs on the whole sequence with the [B, S] padding mask only; use cp=1")
    shard = hidden.shape[1]
    for name, value in list(bound.arguments.items()):
        if name not in ("self", "cache", "kwargs"):
            bound.arguments[name] = _whole(value, shard, cp)
    if isinstance(bound.arguments.get("kwargs"), dict):  # **kwargs: position_ids and the like
        bound.arguments["kwargs"] = {k: _whole(v, shard, cp) for k, v in bound.arguments["kwargs"].items()}
    return bound.args[1:], bound.kwargs


def _after(m: nn.Module, args: tuple, kwargs: dict, out):
    """Forward hook: this rank's tokens of the whole sequence's output."""
    if not torch.compiler.is_compiling():
        return None
    cp = m._moe_cp_mixer[0]
    if isinstance(out, tuple):
        return (torch.ops.moe_cp.own_tokens(out[0], 1, cp), *out[1:])
    return torch.ops.moe_cp.own_tokens(out, 1, cp)


def use_whole_sequence_mixers(model: nn.Module, cp: int) -> list[str]:
    """Run each recurrent layer's mixer of ``model`` on the whole sequence when compiled at ``cp`` > 1
    (module docstring), unless it passes states over the CP group instead (models/hf_state_passing.py);
    the module paths that run on the whole sequence."""
    paths = []
    for path, m in (recurrent_mixers(model) or {}).values():
        if use_state_passing(m, cp, path):  # sharded, the ranks pass states (hf_state_passing.py)
            continue
        if getattr(m, "_moe_cp_mixer", None) is None:
            m.register_forward_pre_hook(_before, with_kwargs=True)
            m.register_forward_hook(_after, with_kwargs=True)
        m._moe_cp_mixer = (cp, path)
        paths.append(path)
    return paths
