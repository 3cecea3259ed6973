"""Cost ledger: symbolic formulas (sympy) for parameter counts, persistent training state, execution
working memory, traffic per process group and FLOPs, evaluated for a compiled model.

    >>> from moe_compile import ledger
    >>> ledger.formula("P_active")          # sympy expression in d, h_e, N, K, L, …
    >>> cm.ledger()["P_active"], cm.ledger().shorthand

The ledger reads the IR and the plans; it never drives execution.
"""

from .evaluate import Figure, Ledger, definition, evaluate, format_value, formula, ledger_for
from .formulas import FORMULAS
from .memory import GraphMemory, graph_memory
from .model_counts import LedgerError, MoEShape, ParamCounts, count_params, moe_shape
from .symbols import SYMBOLS

__all__ = [
    "FORMULAS",
    "SYMBOLS",
    "Figure",
    "GraphMemory",
    "Ledger",
    "LedgerError",
    "MoEShape",
    "ParamCounts",
    "count_params",
    "definition",
    "evaluate",
    "format_value",
    "formula",
    "graph_memory",
    "ledger_for",
    "moe_shape",
]
