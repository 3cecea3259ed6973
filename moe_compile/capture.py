"""Entry functions for torch.compile with a code object of their own.

Dynamo keeps its cache entries, recompile counts and frame decisions (skip, run-only) on code
objects. Every function torch.compile captures for moe_compile (a whole model, a pipeline stage, a
recording capture) gets a fresh code object, so that no other compile in the process — another
instance, another stage of the same pipeline — can use up its recompile limit or decide its frames.
"""

from __future__ import annotations

import itertools
import types

# Recompiles of one entry (input shapes, train/eval, grad mode) before torch.compile gives up on it;
# with fullgraph (the default) going past it is a FailOnRecompileLimitHit, never a silent eager run.
RECOMPILE_LIMIT = 64
_ids = itertools.count()


def fresh(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own (same body, globals and closure)."""
    code = fn.__code__
    name = f"{code.co_name}_{next(_ids)}"
    code = code.replace(co_name=name, **({"co_qualname": name} if hasattr(code, "co_qualname") else {}))
    return types.FunctionType(code, fn.__globals__, name, None, fn.__closure__)
