"""cp_shard_positions — positions a module makes from the sequence's length become the shard's (cp > 1).

Glossary: C / CP, S. Under context parallelism each rank's graph runs on its shard of S/cp tokens,
chunks r and 2cp−1−r of 2cp (runtime/context_parallel.py), and takes their global ``position_ids``.
A module that makes positions from the length of what it sees, ``arange(S)``, would get 0 … S/cp − 1
on every rank instead. Llama 4's attention temperature tuning does: on its NoPE layers it scales each
query by log(⌊(pos + 1) / floor_scale⌋ + 1)·attn_scale + 1 with pos = arange over the hidden states'
length (transformers ignores ``position_ids`` there), so from position floor_scale − 1 on a shard's
queries were scaled for the wrong positions.

The program lists such modules (``Program.cp_length_positions``: module path → the first position
where a wrong one changes the result, api.cp_length_positions). In each listed module this pass
replaces ``arange(S/cp)`` by ``moe_cp::positions``: this rank's global positions, the same values the
dense model's arange(S) gives these tokens, so the shard computes what the whole sequence would.
A listed module in the graph without such an arange (its code changed) is refused at compile time when
the sequence reaches that position (shorter sequences are exact either way).

Requires DENSE, ensures DENSE. A no-op at cp = 1.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import UnsupportedFeatureError
from ..ir import Stage
from ..viz.graph import module_path
from .base import PassContext, moe_pass, propagate_fake

ARANGE = (torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start)


def _length(n: fx.Node) -> int | None:
    """S of ``arange(S)`` / ``arange(0, S)`` with a static S and unit step, else None."""
    args = list(n.args)
    if len(args) == 2 and args[0] == 0:
        args = args[1:]
    step = n.kwargs.get("step", 1)
    if len(args) != 1 or type(args[0]) is not int or step != 1 or n.kwargs.get("start", 0) != 0:
        return None
    return args[0]


def _owner(path: str | None, listed: dict[str, int]) -> str | None:
    """The listed module ``path`` lies in (itself or a child of it)."""
    if path is None:
        return None
    return next((m for m in listed if path == m or path.startswith(m + ".")), None)


@moe_pass(requires=Stage.DENSE, ensures=Stage.DENSE)
def cp_shard_positions(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    prog = ctx.program
    cp, listed = prog.mesh.cp, prog.cp_length_positions
    if cp == 1 or not listed:
        return gm
    g = gm.graph
    nodes = list(g.nodes)
    like = next((n for n in nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)), None)
    shard = _seq_len(nodes)
    seen: dict[str, int] = {}  # listed module → the shard length its aranges took (0: none)
    for n in nodes:
        owner = _owner(module_path(n), listed)
        if owner is None:
            continue
        seen.setdefault(owner, 0)
        if n.op != "call_function" or n.target not in ARANGE or like is None:
            continue
        s = _length(n)
        if s != shard:  # positions over the shard's tokens only (another length is not a position range)
            continue
        with g.inserting_before(n):
            pos = g.call_function(torch.ops.moe_cp.positions.default, (like, s * cp, cp, prog.cp_rank))
            flat = g.call_function(torch.select, (pos, 0, 0))
        propagate_fake([pos, flat])
        dtype = n.kwargs.get("dtype")
        if dtype is not None and dtype != torch.int64:
            with g.inserting_after(flat):
                flat = g.call_function(torch.Tensor.to, (flat, dtype))
            propagate_fake([flat])
        n.replace_all_uses_with(flat)
        g.erase_node(n)
        seen[owner] = s
    for owner, s in seen.items():
        if s:
            continue
        seq = shard * cp
        if seq > listed[owner]:
            raise UnsupportedFeatureError(
                f"{owner}: context parallelism (cp={cp}) gives each rank its shard's global position_ids, but this "
                "module makes positions from the length of what it sees (Llama 4's attention temperature tuning, "
                "config.attn_temperature_tuning, on its NoPE layers) in a form this pass does not recognise, and a "
                f"sequence of {seq} tokens reaches position {listed[owner]}, from which they change its result; use "
                "shorter sequences, attn_temperature_tuning=False or cp=1")
    gm.recompile()
    return gm


def _seq_len(nodes: list[fx.Node]) -> int:
    """The shard's length: the sequence dim of the graph's position ids (its input or moe_cp::positions)."""
    for n in nodes:
        if (n.op == "placeholder" and "position_ids" in n.name) or n.target is torch.ops.moe_cp.positions.default:
            return int(n.meta["val"].shape[-1])
    raise UnsupportedFeatureError("context parallelism: the captured graph takes no position_ids")
