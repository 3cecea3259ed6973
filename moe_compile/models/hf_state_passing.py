"""Linear attention under context parallelism, sharded: each rank runs its own tokens and the ranks pass states.

The chunked delta rules transformers ships in plain torch (gated delta rule: Qwen3-Next, Qwen3.5-MoE,
Lara; Kimi delta attention: Kimi-Linear, Bailing-Hybrid) carry a state S [B, H, dk, dv] from token to
token. Each step maps it linearly and the same way for every value column (S ← D·S + β·k·vᵀ, D a
[dk, dk] decay and delta-rule product), so over a chunk of tokens

    leaving state  = S⁰ + A·S_in          output_t = o⁰_t + Q_t·S_in

with S⁰ and o⁰ the chunk's state and outputs from a zero state. One call of the rule itself gives all four:
the values widened by dk zero columns, the initial state [0 | I] (dk × (dv + dk)), so the last dk columns
of its final state are A and those of its outputs Q. Under cp > 1 a rank holds chunks r and 2cp−1−r of
2cp; for each it runs that call on its own tokens, the CP group all-gathers the [2, B, H, dk, dv + dk]
summaries (moe_cp::incoming_states, filled in by the CP pass: the scan S_{c+1} = S⁰_c + A_c·S_c in
sequence order), and each token's output gets Q_t·S_in added. Compute and saved activations shrink with
cp like attention's (plus dk state columns per head); backward is autograd's through the scan and the
all-gather's reduce-scatter, so every chunk gets the gradient that later chunks send back.

Mamba's selective scans (Jamba; Nemotron-H and GraniteMoE-Hybrid's Mamba-2) decay their states element by
element and pass them the same way, with diagonal transitions (models/hf_mamba_states.py).

MiniMax's lightning attention, written inside its module's forward, passes states by running that forward
from the states its chunks enter with (models/hf_lightning_states.py).

Installed per mixer instance: its forward, while compiled at cp > 1, runs with the rule's name bound to
the state-passing form (eagerly it is the class's own forward). Mixers that pass no states run on the
whole sequence instead (models/hf_mixers.py).
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
import torch.nn as nn

from .hf_lightning_states import use_lightning_states
from .hf_mamba_states import cached_state_error, halves, mamba1_form, mamba2_form, no_fused_path
from .hf_rebind import rebound


def _state_passing(rule, cp: int, path: str):
    """``rule`` (same signature) run on this rank's two sequence chunks with the states they enter with."""
    chunk = inspect.signature(inspect.unwrap(rule)).parameters.get("chunk_size")
    chunk = chunk.default if chunk is not None and isinstance(chunk.default, int) else None

    @functools.wraps(rule)
    def run(query, key, value, g, beta, *args, initial_state=None, output_final_state=False, **kwargs):
        if args or initial_state is not None:
            raise cached_state_error(path, cp)
        b, s, _, dk = key.shape
        h, dv = value.shape[-2:]
        parts = halves(s, path, cp)
        widened = torch.cat([value, value.new_zeros(b, s, h, dk)], -1)
        start = torch.cat([value.new_zeros(b, h, dk, dv),
                           torch.eye(dk, dtype=value.dtype, device=value.device).expand(b, h, dk, dk)], -1)
        if chunk is not None and "chunk_size" not in kwargs:  # a chunk shorter than the rule's chunks: not padded
            kwargs["chunk_size"] = min(chunk, s // 2)
        outs, summaries = [], []
        for part in parts:
            out, final = rule(query[:, part], key[:, part], widened[:, part], g[:, part], beta[:, part],
                              initial_state=start, output_final_state=True, **kwargs)
            outs.append(out)
            summaries.append(final)
        entering = torch.ops.moe_cp.incoming_states(torch.stack(summaries), s, cp)  # [2, b, h, dk, dv]
        out = torch.cat([(o[..., :dv].float() + torch.einsum("bshk,bhkv->bshv", o[..., dv:].float(), entering[i]))
                         .to(o.dtype) for i, o in enumerate(outs)], 1)
        if not output_final_state:
            return out, None
        # a cache asked for it (transformers makes one in training too): the state this rank's later chunk
        # leaves, the sequence's final state on rank 0, as the attention layers' caches hold the shard's keys
        last = summaries[1][..., :dv] + summaries[1][..., dv:] @ entering[1]
        return out, last

    return run


# the modeling modules' global names a mixer's forward calls → their state-passing forms
RULES = {"torch_chunk_gated_delta_rule": _state_passing, "chunk_kimi_delta_attention": _state_passing,
         "mamba_selective_scan": mamba1_form, "mamba2_chunk_scan": mamba2_form}
ALSO = {"mamba2_chunk_scan": {"mamba2_split_conv1d_scan_combined": no_fused_path}}  # rebound beside the rule


def _rule_name(fwd) -> str | None:
    code = inspect.unwrap(fwd).__code__
    return next((n for n in RULES if n in code.co_names), None)


def use_state_passing(m: nn.Module, cp: int, path: str) -> bool:
    """Make mixer ``m`` pass states over the CP group when compiled at ``cp`` > 1 (module docstring);
    False (nothing changed) when its forward calls none of RULES."""
    fwd = type(m).forward
    name = _rule_name(fwd)
    if name is None:
        return use_lightning_states(m, cp, path)
    inner = inspect.unwrap(fwd)
    forms = {n: form(inner.__globals__[n], cp, path)
             for n, form in {name: RULES[name], **ALSO.get(name, {})}.items() if n in inner.__globals__}
    sharded = rebound(fwd, "_moe_cp_state_passing", **forms)  # the forward with the rule's name rebound

    @functools.wraps(fwd)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return sharded(self, *args, **kwargs)
        return fwd(self, *args, **kwargs)

    m.forward = types.MethodType(forward, m)
    return True
