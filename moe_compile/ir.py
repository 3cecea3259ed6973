"""Node metadata of the canonical MoE IR and the graph stage.

Every MoE node (a ``moe::`` op in the FX graph) carries one frozen :class:`MoENodeMeta` under
``node.meta[MOE_META]``: the MoE block it came from (original module path), its role, and the spec
the pass decided for it. The ops themselves live in :mod:`moe_compile.ops`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx as fx

MOE_META = "moe_compile"  # node.meta key of MoENodeMeta
STAGE_KEY = "moe_stage"  # gm.meta key of Stage


class Stage(enum.IntEnum):
    """Graph stages, in order. A pass requires one stage and ensures the next."""

    DENSE = 0  # routed experts as one logical node per MoE block
    PARTITIONED = 1  # expert shards assigned; permute → dispatch → grouped FFN → combine → unpermute
    QUANTIZED = 2  # MXFP8 casts inserted where selected
    LEASED = 3  # joint graph: symmetric payload lifetimes planned


class Role(str, enum.Enum):
    ROUTER = "router"
    ROUTED_EXPERTS = "routed_experts"
    SHARED_EXPERT = "shared_expert"
    PERMUTE = "permute"
    DISPATCH = "dispatch"
    EXPERT_FFN = "expert_ffn"
    COMBINE = "combine"
    UNPERMUTE = "unpermute"
    LEASE = "lease"
    CAST = "cast"


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts this rank stores: experts [first, first + num_local) of num_experts."""

    num_experts: int
    ep_mp: int
    ep_rank: int

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_mp

    @property
    def first(self) -> int:
        return self.ep_rank * self.num_local


@dataclass(frozen=True)
class DispatchSpec:
    """Static shape of one MoE layer's transport: rows sent (T·K), receive capacity, top-k, group."""

    num_tokens: int  # T on this rank
    top_k: int  # K
    capacity: int  # receive-buffer rows (valid prefix + counts); T·K·ep_mp when dropless
    dropless: bool
    ep_mp: int
    group: str  # process-group name of the EP-MP group

    @property
    def num_rows(self) -> int:
        return self.num_tokens * self.top_k


@dataclass(frozen=True)
class MoENodeMeta:
    block: str  # original module path, e.g. "model.layers.0.mlp"
    role: Role
    layer_index: int  # order of the block in the model
    shard: ExpertShard | None = None
    dispatch: DispatchSpec | None = None
    mirror: bool = False  # backward mirror of a forward MoE op
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def with_(self, **kw: Any) -> MoENodeMeta:
        return replace(self, **kw)


def moe_meta(node: fx.Node) -> MoENodeMeta | None:
    return node.meta.get(MOE_META)


def get_stage(gm: fx.GraphModule) -> Stage:
    return gm.meta.get(STAGE_KEY, Stage.DENSE)


def set_stage(gm: fx.GraphModule, stage: Stage) -> None:
    gm.meta[STAGE_KEY] = stage
