"""FP8WeightStore: a trainable weight whose compute weights are derived MXFP8 caches.

Glossary: the *compute weight* is what forward/backward GEMMs consume — here two orientation-specific
MXFP8 caches (qdata–scale, packed): ``fwd`` is W [.., out, in] quantised along ``in`` (the forward
GEMM's contraction), ``t`` is Wᵀ [.., in, out] quantised along ``out`` (the input-gradient GEMM's).
They are derived from the FP32 main weight and refreshed after every optimizer step and every load
(*copy-back*); they are never checkpointed. The store is not an FP8 ``nn.Parameter``: the
``nn.Parameter`` stays high-precision and receives the high-precision gradients. Its values are the
*BF16 anchor*: they seed the caches, and once an optimizer holds the FP32 main weight the anchor
storage can be released (``release_anchor``); the main weight then feeds refreshes and checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..errors import MoECompileError
from ..mxfp8 import check_block_dim, quantize_packed

# Optimizer steps taken in this process (any torch.optim optimizer). Without a main weight the caches
# follow the anchor parameter, and some updates leave its version counter alone: fused optimizers
# (AdamW(fused=True) on CPU) and writes through ``.data``; a step counted here marks every cache stale.
_optimizer_steps = 0
_step_hook = None  # registered with the first store, so importing the package changes no optimizer


def _count_step(*_args) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizer_steps() -> None:
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_step)


class FP8WeightStore:
    def __init__(self, param: nn.Parameter, name: str, mode: str = "rceil") -> None:
        check_block_dim(param.shape[-1], f"{name} (forward contraction, shape {tuple(param.shape)})")
        check_block_dim(param.shape[-2], f"{name} (input-gradient contraction, shape {tuple(param.shape)})")
        _watch_optimizer_steps()
        self.param = param
        self.name = name
        self.mode = mode
        self.main: torch.Tensor | None = None  # the FP32 main weight, once an optimizer owns it
        self.anchor_released = False
        self.caches: dict[str, torch.Tensor] = {}
        self._seen: tuple[int, int, int] = (-1, -1, -1)
        self.refresh_from()

    def source(self) -> torch.Tensor:
        """The weight the caches derive from: the FP32 main weight, else the anchor parameter."""
        if self.main is not None:
            return self.main
        if self.anchor_released:
            raise MoECompileError(f"{self.name}: the BF16 anchor was released and no main weight is attached")
        return self.param

    def refresh_from(self, main: torch.Tensor | None = None) -> None:
        """Copy-back: rebuild both caches from ``main`` (or the current source). Once the anchor is
        released the store keeps its own copy of the main weight (checkpoints read it)."""
        if main is not None and self.anchor_released:
            self.main.copy_(main.view(self.main.shape))
        elif main is not None:
            self.main = main
        w = self.source().detach()
        self.caches["fwd"] = quantize_packed(w, self.mode)
        self.caches["t"] = quantize_packed(w.transpose(-2, -1).contiguous(), self.mode)
        self._seen = self._anchor_state()

    def _anchor_state(self) -> tuple[int, int, int]:
        """What tells an anchor update: its version (in-place writes), its storage (``p.data = ...``,
        vector_to_parameters; a new storage at the old address — two swaps between forwards under a caching
        allocator — is missed) and the process's optimizer steps (fused kernels, ``.data`` writes)."""
        return self.param._version, self.param.data_ptr(), _optimizer_steps

    def cache(self, orientation: str) -> torch.Tensor:
        # Without a main weight the caches derive from the anchor: refresh when it may have changed, so a
        # cache never lags the weight. Not seen: an in-place write through ``.data`` outside any optimizer
        # step (call cm.refresh_compute_weights() after one).
        if self.main is None and self._anchor_state() != self._seen:
            self.refresh_from()
        return self.caches[orientation]

    def release_anchor(self, main: torch.Tensor) -> None:
        """Drop the anchor's storage once ``main`` (the optimizer's FP32 copy) holds the weight. The
        parameter keeps its shape (stride-0 view of one element) for gradient accumulation."""
        if tuple(main.shape) != tuple(self.param.shape):
            raise MoECompileError(f"{self.name}: main weight shape {tuple(main.shape)} != {tuple(self.param.shape)}")
        self.refresh_from(main)
        self.param.data = torch.zeros(1, dtype=self.param.dtype, device=self.param.device).expand(self.param.shape)
        self.anchor_released = True
        self._seen = self._anchor_state()

    def value(self) -> torch.Tensor:
        """The full-precision weight (for checkpoint views and full_state_dict)."""
        return self.source().detach()
