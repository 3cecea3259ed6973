"""index_bounds: every embedding lookup of a parameter table checks its indices against the table's rows.

The host check before a call (runtime/token_range.py) covers input_ids and labels against the vocabulary.
Other tables are indexed by what the batch's shape or its other inputs make: a learned position table by
arange(sequence length) or by position_ids. An index past such a table is an IndexError that names
neither the table nor the batch in the plain graph, and with dense_fusion="inductor" it aborts the whole
process (the compiled kernel's C++ exception ends in std::terminate). So the indices of each
``F.embedding`` / ``torch.embedding`` of a graph input go through ``moe_check::index_range``, which
refuses an index outside [0, rows) with an OptionError naming the table (CPU tensors; see the op).
Indices that are ``arange`` of constants (the position table's lookup when no position_ids are
passed) are checked here, at compile time: explain's meta tensors never reach the op, so a plan for
a sequence longer than the table would otherwise pass.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import OptionError
from ..ir import Stage
from .base import PassContext, moe_pass, propagate_fake

# target → (position of the indices, position of the table)
_LOOKUPS = {F.embedding: (0, 1), torch.embedding: (1, 0), torch.ops.aten.embedding.default: (1, 0)}


@moe_pass(requires=Stage.DENSE, ensures=Stage.DENSE)
def index_bounds(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Check each embedding lookup's indices against its table's rows before it runs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = {n: (ctx.input_names[i] if i < len(ctx.input_names) else None) or n.name
             for i, n in enumerate(placeholders)}
    for n in list(gm.graph.nodes):
        where = _LOOKUPS.get(n.target) if n.op == "call_function" else None
        if where is None or len(n.args) <= max(where):
            continue
        idx, table = n.args[where[0]], n.args[where[1]]
        val = table.meta.get("val") if isinstance(table, fx.Node) else None
        if not isinstance(idx, fx.Node) or table not in names or val is None or val.dim() != 2:
            continue
        _check_arange(idx, int(val.shape[0]), names[table])
        with gm.graph.inserting_before(n):
            checked = gm.graph.call_function(torch.ops.moe_check.index_range.default,
                                             (idx, int(val.shape[0]), names[table]))
        propagate_fake([checked])
        args = list(n.args)
        args[where[0]] = checked
        n.args = tuple(args)
    gm.graph.lint()
    gm.recompile()
    return gm


def _check_arange(idx: fx.Node, rows: int, table: str) -> None:
    """Refuse ``arange(start, end[, step])`` indices of constants that reach past the table's rows."""
    if idx.op != "call_function" or idx.target is not torch.arange:
        return
    ints = [a for a in idx.args if isinstance(a, int) and not isinstance(a, bool)]
    if len(ints) != len(idx.args) or not 1 <= len(ints) <= 3:
        return  # a symbolic or float bound: the run-time check covers it
    r = range(*ints)
    if len(r) and max(r[0], r[-1]) >= rows:
        spelled = ", ".join(map(str, ints))
        raise OptionError(f"the embedding {table} has {rows} rows, but this batch looks up row {max(r[0], r[-1])} "
                          f"(positions arange({spelled}): a sequence longer than the position table)")
