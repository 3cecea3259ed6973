"""Count host syncs: Python-level reads of tensor values (``.item()``, ``.tolist()``, ``nonzero``,
``bool()``/``int()``/``float()``/``__index__`` conversions) made from moe_compile's own code.

On a GPU each is a device→host synchronisation; on CPU they are cheap but show where one would be.
Used by tests/test_host_syncs.py and benchmarks/scale.py around one training step (after a warm-up
step, so that compilation is not counted). Reads inside torch's C++ kernels are not seen (and a kernel
such as boolean-mask indexing that syncs internally would be missed: the transport path avoids them).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

PACKAGE = str(Path(__file__).resolve().parents[1])
METHODS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


def _site() -> str | None:
    """'module.py:function' of the first moe_compile frame above the patched method, or None."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(PACKAGE) and not name.endswith("host_syncs.py"):
            return f"{Path(name).relative_to(PACKAGE).as_posix()}:{f.f_code.co_name}"
        f = f.f_back
    return None


@contextlib.contextmanager
def count_host_syncs() -> Iterator[Counter]:
    """Within the block, count value reads by (site, method); yields the Counter (filled as it runs)."""
    counts: Counter = Counter()
    saved = {m: getattr(torch.Tensor, m) for m in METHODS}
    saved_nonzero = torch.nonzero

    def wrap(method, orig):
        def patched(self, *a, **kw):
            site = _site()
            if site is not None:
                counts[(site, method)] += 1
            return orig(self, *a, **kw)
        return patched

    def nonzero(t, *a, **kw):
        site = _site()
        if site is not None:
            counts[(site, "nonzero")] += 1
        return saved_nonzero(t, *a, **kw)

    try:
        for m, orig in saved.items():
            setattr(torch.Tensor, m, wrap(m, orig))
        torch.nonzero = nonzero
        yield counts
    finally:
        for m, orig in saved.items():
            setattr(torch.Tensor, m, orig)
        torch.nonzero = saved_nonzero
