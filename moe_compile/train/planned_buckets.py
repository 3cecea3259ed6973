"""PlannedBuckets: another rank's gradient buckets, for compiling its pipeline stages here (explain).

Terms: bucket, slot (train/ddp.py), in-graph reduction (passes/grad_reduction.py). A rank's reducer
holds its own stages' parameters only, so a stage that explain plans on a rank that does not hold it
used to compile without reduction nodes: its backward returned every gradient at its end, and its
high-water counted them all (2.85 GB more for OLMoE-1B-7B's last stage at pp=2, seq 256). This stand-in
buckets that stage's owner's parameters by the same rule (ddp.bucket_layout) so that the pass places
the nodes where the owner's graph has them; the nodes do nothing here (no storage, no collectives).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

from .ddp import _REDUCERS, MultiGroupDistributedDataParallel, ParamFamily, bucket_layout

_IDS = itertools.count(-1, -1)  # reducer ids of their own: below every runtime context id (≥ 0)


class PlannedBuckets:
    def __init__(self, families: list[ParamFamily], names: dict[int, str], bucket_bytes: int,
                 grad_dtype: torch.dtype | None) -> None:
        self.families, self.bucket_bytes, self.grad_dtype = families, bucket_bytes, grad_dtype
        self.slots = [p for fam in families for p in fam.params if p.requires_grad]
        self._names = [names[id(p)] for p in self.slots]
        self._slot_of = {id(p): k for k, p in enumerate(self.slots)}
        self._rank: dict[int, int] = {}
        self.id = next(_IDS)
        _REDUCERS[self.id] = self  # weakly: whoever compiles with this id keeps the object

    slot = MultiGroupDistributedDataParallel.slot  # by name, over this object's _names

    def claim(self, produced: list[int]) -> list[list[int]]:
        """As MultiGroupDistributedDataParallel.claim: the slots grouped by bucket, in bucket order."""
        for k in produced:
            self._rank.setdefault(k, len(self._rank))
        layout = bucket_layout(self.families, lambda p: self._rank.get(self._slot_of[id(p)]),
                               self.bucket_bytes, self.grad_dtype)
        bucket = {self._slot_of[id(p)]: j for j, (_, _, params) in enumerate(layout) for p in params}
        groups: dict[int, list[int]] = {}
        for k in produced:
            groups.setdefault(bucket[k], []).append(k)
        return [groups[j] for j in sorted(groups)]

    def graph_ready(self, slots: list[int], grads: list[torch.Tensor]) -> None:
        pass  # planning: the owner's reducer takes these gradients, not this rank

    def graph_finish(self) -> None:
        pass


def planned_buckets(like, params: list[tuple[str, nn.Parameter]], expert_names: set[str]) -> PlannedBuckets:
    """Buckets over ``params`` (another rank's stages' parameters, in registration order) as ``like``
    (this rank's MultiGroupDistributedDataParallel) would build them: dense and expert families, its
    bucket size and gradient dtype."""
    dense = [p for n, p in params if n not in expert_names]
    expert = [p for n, p in params if n in expert_names]
    fams = [ParamFamily("dense", dense, None, 1.0), ParamFamily("expert", expert, None, 1.0)]
    return PlannedBuckets(fams, {id(p): n for n, p in params}, like.bucket_bytes, like.grad_dtype)
