"""Random-number generator state in checkpoints: dropout draws from each rank's global generators, so a
resumed run matches an uninterrupted one only when every rank's generators resume where they stopped.

Saved: every rank's torch CPU generator state (and its CUDA generators', when CUDA is in use), gathered
to rank 0 and written as one file of the checkpoint (``rng_state.pt``; checksummed like the others).
Restored on load under the same world size: rank r takes rank r's state. Under another world size no
saved state belongs to a rank, so each rank is seeded from the saved states and its rank (reproducible,
different per rank) and the loader says so; a checkpoint without the file leaves the generators alone."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

RNG_FILE = "rng_state.pt"


def capture() -> dict[str, Any]:
    """This rank's generator states (small: about 5 KB for the CPU generator, 16 bytes per CUDA device)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": list(cuda)}


def write(path: Path, states: list[dict[str, Any]]) -> None:
    torch.save(states, path / RNG_FILE)


def read(path: Path) -> list[dict[str, Any]] | None:
    """The saved states, one per saving rank; None for a checkpoint saved before they were kept."""
    f = path / RNG_FILE
    if not f.is_file():
        return None
    states = torch.load(f, weights_only=True)
    if not isinstance(states, list) or not all(isinstance(s, dict) and "cpu" in s for s in states):
        raise ValueError(f"{f}: not a list of per-rank generator states")
    return states


def restore(states: list[dict[str, Any]], world: int, rank: int) -> str:
    """Set this rank's generators from ``states``; returns how: "restored" (same world size) or
    "reseeded" (another world size: a seed from the saved states and this rank)."""
    if len(states) == world:
        torch.set_rng_state(states[rank]["cpu"])
        cuda = states[rank]["cuda"]
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        return "restored"
    h = hashlib.sha256(b"".join(bytes(s["cpu"].numpy()) for s in states) + rank.to_bytes(8, "little"))
    torch.manual_seed(int.from_bytes(h.digest()[:8], "little") >> 1)  # manual_seed seeds CUDA too
    return "reseeded"
