"""Runtime contexts: what a compiled program's ops reach at run time (transport, counters).

Custom ops take plain ints and strings, so a compiled graph refers to its context by id. Context 0 is
the single-process local context (EP-MP group of one rank), used by eager execution of the logical
graph and by the front end's recognition check.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..errors import RuntimeFault
from .lease_runtime import LeaseRuntime
from .stats import RuntimeStats
from .transport import LocalTransport, Transport


@dataclass
class RuntimeContext:
    transport: Transport
    stats: RuntimeStats = field(default_factory=RuntimeStats)
    ctx_id: int = -1
    leases: LeaseRuntime | None = None  # symmetric transport: lease pools over the symmetric heap
    weight_stores: dict[tuple[str, str], Any] = field(default_factory=dict)  # (block, which) → FP8WeightStore
    cp_group: Any = None  # context-parallel process group (K/V all-gather); None at cp = 1
    # a CP rank's whole-sequence aux loss is divided by this: cp at pp = 1 (the group's losses are summed),
    # 1 at pp > 1 (each rank's loss weighted by its share of the loss tokens: the shares sum to 1)
    cp_aux_divisor: int = 1

    def weight_store(self, block: str, which: str) -> Any:
        try:
            return self.weight_stores[(block, which)]
        except KeyError:
            raise RuntimeFault(f"{block}: no MXFP8 compute-weight cache for {which} (compiled without mxfp8?)") from None

    @property
    def ep_size(self) -> int:
        return self.transport.ep_size

    @property
    def ep_rank(self) -> int:
        return self.transport.ep_rank


_CONTEXTS: dict[int, RuntimeContext] = {}
_IDS = itertools.count(1)


def register_context(ctx: RuntimeContext) -> int:
    ctx.ctx_id = next(_IDS)
    _CONTEXTS[ctx.ctx_id] = ctx
    return ctx.ctx_id


def release_context(ctx_id: int) -> None:
    _CONTEXTS.pop(ctx_id, None)


def get_context(ctx_id: int) -> RuntimeContext:
    try:
        return _CONTEXTS[ctx_id]
    except KeyError:
        raise RuntimeFault(
            f"runtime context {ctx_id} does not exist in this process (was the CompiledMoE released, "
            "or is a graph compiled in another process being run here?)"
        ) from None


def _local() -> RuntimeContext:
    stats = RuntimeStats()
    ctx = RuntimeContext(LocalTransport(stats), stats, ctx_id=0)
    _CONTEXTS[0] = ctx
    return ctx


LOCAL_CONTEXT = _local()
