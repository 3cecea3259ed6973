"""Runtime counters: transport bytes per group and direction, expert token counts per MoE layer."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class RuntimeStats:
    # (group label, what) → bytes sent to other ranks / bytes including the rank's own rows
    peer_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    total_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    # MoE block path → (requested[N], kept[N]) token-k rows of this rank's tokens, last forward
    expert_counts: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def add_bytes(self, group: str, what: str, peer: int | torch.Tensor, total: int | torch.Tensor) -> None:
        """Byte counts may be 0-dim tensors (a sync-free transport counts rows without reading them):
        they are summed as tensors and read once, in :meth:`summary`."""
        self.peer_bytes[(group, what)] += peer
        self.total_bytes[(group, what)] += total
        self.calls[(group, what)] += 1

    def record_counts(self, block: str, requested: torch.Tensor, kept: torch.Tensor) -> None:
        self.expert_counts[block] = (requested.detach().clone(), kept.detach().clone())

    def reset(self) -> None:
        self.peer_bytes.clear()
        self.total_bytes.clear()
        self.calls.clear()
        self.expert_counts.clear()

    def summary(self) -> dict[str, object]:
        """Plain-Python snapshot: bytes per group, per (group, what), and call counts."""
        per_group: dict[str, int] = defaultdict(int)
        peer = {k: int(b) for k, b in self.peer_bytes.items()}  # tensor counts are read here, not per op
        for (g, _), b in peer.items():
            per_group[g] += b
        return {
            "bytes_sent": dict(per_group),
            "bytes_sent_by_kind": {f"{g}/{w}": b for (g, w), b in peer.items()},
            "bytes_moved_by_kind": {f"{g}/{w}": int(b) for (g, w), b in self.total_bytes.items()},
            "calls": {f"{g}/{w}": c for (g, w), c in self.calls.items()},
        }
