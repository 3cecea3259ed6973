"""moe_check::index_range: an embedding lookup's indices, checked against its table's rows (see
passes/index_bounds.py, which inserts it)."""

from __future__ import annotations

import torch

from ..errors import OptionError


@torch.library.custom_op("moe_check::index_range", mutates_args=())
def index_range(idx: torch.Tensor, rows: int, table: str) -> torch.Tensor:
    """A copy of ``idx`` (the lookup reads the copy, so no compiler drops or reorders the check) after
    refusing any index outside [0, rows) — on CPU only: on a GPU the verdict would be a device→host sync
    per lookup, and torch's device-side assert fires there as it does in the plain model."""
    if idx.device.type == "cpu" and idx.numel():
        lo, hi = (int(v) for v in torch.aminmax(idx))
        if lo < 0 or hi >= rows:
            bad = lo if lo < 0 else hi
            raise OptionError(f"the embedding {table} has {rows} rows, but this batch looks up row {bad} (a "
                              f"sequence longer than a position table, or an index outside its range); index "
                              f"tensor of shape {tuple(idx.shape)}")
    return idx.clone()


@index_range.register_fake
def _(idx, rows, table):
    return torch.empty_like(idx)
