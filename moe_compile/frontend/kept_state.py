"""kept_state: a module's train/eval modes and buffer values, put back after a probe runs its forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def kept_state(module: nn.Module) -> Iterator[None]:
    """On exit, every submodule's own train/eval mode (``module.train(flag)`` would set one flag for all:
    a frozen part in eval inside a training model came back training) and every buffer's value (a load
    counter the forward updates) are as they were on entry. The probes that run a user's forward on
    random or dummy data use it: recognition's, the randomness check's, the pipeline's call-order one."""
    modes = {m: m.training for m in module.modules()}
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    try:
        yield
    finally:
        for m, t in modes.items():
            m.training = t
        with torch.no_grad():
            for n, b in module.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
