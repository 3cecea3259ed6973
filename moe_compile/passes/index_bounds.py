"""index_bounds: every embedding lookup of a parameter table checks its indices against the table's rows.

The host check before a call (runtime/token_range.py) covers input_ids and labels against the vocabulary.
Other tables are indexed by what the batch's shape or its other inputs make: a learned position table by
arange(sequence length) or by position_ids. An index past such a table is an IndexError that names
neither the table nor the batch in the plain graph, and with dense_fusion="inductor" it aborts the whole
process (the compiled kernel's C++ exception ends in std::terminate). So the indices of each
``F.embedding`` / ``torch.embedding`` of a graph input go through ``moe_check::index_range``, which
refuses an index outside [0, rows) with an OptionError naming the table (CPU tensors; see the op).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

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
