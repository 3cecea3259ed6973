"""Compile options: one explicit, validated object (no environment variables read at import)."""

from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass, fields
from typing import Any

from .errors import OptionError

TRANSPORTS = ("auto", "all_to_all", "symmetric")
CODEGENS = ("auto", "triton", "torch")
MXFP8_MODES = (None, "experts", "experts+shared", "all")
MXFP8_SCALE_MODES = ("rceil", "floor")
DENSE_FUSIONS = ("auto", "inductor", "none")  # see codegen/dense_fusion.py
GRAD_REDUCTIONS = ("in_graph", "hooks")
GRAD_TRANSPORTS = ("auto", "process_group", "host_shm")  # see train/shm_reduce.py
AC_MODES = (None, "selective", "moe", "full")  # see passes/activation_checkpointing.py


@dataclass(frozen=True)
class CompileOptions:
    capacity_factor: float | None = None  # None: dropless; else rank-level capacity with tail drop
    dropless_headroom: float = 1.5  # dropless: first receive factor h (buffers hold ⌈min(ep, h)·T·K⌉ rows;
    #                                 an overflow doubles it, recompiles and reruns the forward)
    transport: str = "auto"  # how dispatch/combine move rows: all_to_all | symmetric | auto (symmetric
    #                          on CPU ranks of one host, else all_to_all; symmetric on GPUs: NVSHMEM)
    lease_sharing: bool = True  # False: a fixed per-block cache per symmetric payload (no slot reuse)
    forwards_in_flight: int = 1  # forwards that may await their backward at once (e.g. summed losses of
    #                              k microbatches need k): lease slots are provisioned k times
    lease_debug: bool = False  # poison released symmetric slots (NaN) so stale reads show
    codegen: str = "auto"  # which kernels run the partitioned graph: auto (Triton on GPU, torch ops on
    #                        CPU) | triton (on CPU tensors: the Triton interpreter) | torch
    mxfp8: str | None = None  # which linears run in MXFP8: experts | experts+shared | all
    mxfp8_scale_mode: str = "rceil"  # E8M0 scale rule: rceil (no saturation) | floor (OCP)
    dense_fusion: str = "auto"  # the dense part of the fwd/bwd graphs compiled with inductor: inductor | none |
    #                             auto (per device, by measurement: none on CPU, CUDA unmeasured: none; see
    #                             codegen/dense_fusion.py); moe:: ops, leases and transport stay opaque
    debug_dir: str | None = None  # dump graphs before/after each pass here
    debug_pictures: bool = False  # with debug_dir: also render each dump as SVG (new nodes highlighted)
    fullgraph: bool = True  # the whole model must capture as one graph (lease planning spans layers)
    bucket_mb: float = 25.0  # gradient bucket size
    grad_reduction: str = "in_graph"  # where bucket all-reduces start: in_graph (nodes of the compiled backward,
    #                 overlapping it; forwards_in_flight > 1 keeps the hooks) | hooks (autograd hooks after the
    #                 compiled backward: for parameters also used outside the compiled graph)
    grad_transport: str = "auto"  # how bucket reductions move gradients: process_group (torch.distributed
    #                 all-reduce / reduce-scatter) | host_shm (CPU ranks of one x86-64 host: shared memory, each
    #                 member sums the peers' buckets) | auto (host_shm where it can run, else process_group)
    microbatches: int = 1  # m: microbatches of cm.train_step (pipeline schedule, or accumulation at pp=1)
    schedule: str = "1f1b"  # pipeline schedule (torch.distributed.pipelining): gpipe | 1f1b | interleaved_1f1b
    stages_per_rank: int | None = None  # v: pipeline stages per rank (None: 2 for interleaved_1f1b, else 1)
    pp_split: tuple[str, ...] | None = None  # first decoder layer of stages 1..S-1 (None: balance the cost)
    activation_checkpointing: str | None = None  # recompute in backward: None | selective (elementwise ops;
    #                     GEMM outputs kept) | moe (inside MoE blocks) | full (save layer outputs only); the
    #                     router's routing is saved in every mode

    def __post_init__(self) -> None:
        cf = self.capacity_factor
        if cf is not None and not positive_finite(cf):
            raise OptionError(f"capacity_factor={cf!r}: must be a positive number, or None for dropless")
        h = self.dropless_headroom
        if not positive_finite(h) or h < 1:
            raise OptionError(f"dropless_headroom={h!r}: must be a number ≥ 1 (receive rows per routed row)")
        if self.transport not in TRANSPORTS:
            raise OptionError(f"transport={self.transport!r}: supported values are {TRANSPORTS}")
        if self.codegen not in CODEGENS:
            raise OptionError(f"codegen={self.codegen!r}: supported values are {CODEGENS}")
        if self.dense_fusion not in DENSE_FUSIONS:
            raise OptionError(f"dense_fusion={self.dense_fusion!r}: supported values are {DENSE_FUSIONS}")
        if self.mxfp8 not in MXFP8_MODES:
            raise OptionError(f"mxfp8={self.mxfp8!r}: supported values are {MXFP8_MODES}")
        if self.mxfp8_scale_mode not in MXFP8_SCALE_MODES:
            raise OptionError(f"mxfp8_scale_mode={self.mxfp8_scale_mode!r}: supported values are {MXFP8_SCALE_MODES}")
        for name in ("lease_sharing", "lease_debug", "debug_pictures", "fullgraph"):  # "no" is truthy
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name}={getattr(self, name)!r}: must be True or False")
        if self.debug_pictures and self.debug_dir is None:
            raise OptionError("debug_pictures=True renders the debug dumps, which need debug_dir=...: give one")
        if self.debug_dir is not None and not isinstance(self.debug_dir, str | os.PathLike):
            raise OptionError(f"debug_dir={self.debug_dir!r}: must be a directory path (str or os.PathLike)")
        if self.debug_dir is not None and os.path.exists(self.debug_dir) and not os.path.isdir(self.debug_dir):
            raise OptionError(f"debug_dir={str(self.debug_dir)!r}: exists and is not a directory")
        fif = self.forwards_in_flight
        if as_integer(fif) is None or fif < 1:
            raise OptionError(f"forwards_in_flight={fif!r}: must be a positive integer")
        for name in ("microbatches",) + (("stages_per_rank",) if self.stages_per_rank is not None else ()):
            v = getattr(self, name)
            if as_integer(v) is None or v < 1:
                raise OptionError(f"{name}={v!r}: must be a positive integer")
        if self.pp_split is not None:
            if isinstance(self.pp_split, str) or not all(isinstance(x, str) for x in self.pp_split):
                raise OptionError(f"pp_split={self.pp_split!r}: must be a list of module paths")
            object.__setattr__(self, "pp_split", tuple(self.pp_split))
        if self.activation_checkpointing not in AC_MODES:
            raise OptionError(f"activation_checkpointing={self.activation_checkpointing!r}: supported values are "
                              f"{AC_MODES}")
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise OptionError(f"grad_reduction={self.grad_reduction!r}: supported values are {GRAD_REDUCTIONS}")
        if self.grad_transport not in GRAD_TRANSPORTS:
            raise OptionError(f"grad_transport={self.grad_transport!r}: supported values are {GRAD_TRANSPORTS}")
        if not positive_finite(self.bucket_mb):
            raise OptionError(f"bucket_mb={self.bucket_mb!r}: must be a positive number")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> CompileOptions:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise OptionError(f"unknown moe_compile option(s) {unknown}; known: {sorted(names)}")
        opts = cls(**kwargs)
        # an option set to another value than its default where the other options leave it without effect:
        # say so, not ignore it (its default passed along by a wrapper is fine)
        if opts.changed("dropless_headroom") and opts.capacity_factor is not None:
            raise OptionError(f"dropless_headroom={opts.dropless_headroom!r} sizes dropless receive buffers, but "
                              f"capacity_factor={opts.capacity_factor!r} fixes the capacity: drop one of them")
        if opts.changed("mxfp8_scale_mode") and opts.mxfp8 is None:
            raise OptionError(f"mxfp8_scale_mode={opts.mxfp8_scale_mode!r} without mxfp8=...: nothing is "
                              "quantised; set mxfp8 too")
        return opts

    def changed(self, name: str) -> bool:
        """Whether option ``name`` holds another value than its default."""
        return getattr(self, name) != next(f.default for f in fields(self) if f.name == name)


def schedule_without_pipeline(what: str) -> str:
    """The refusal of a pipeline schedule other than the default on a mesh with pp = 1 (where it would be
    ignored): moe_compile's, moe-compile train's and explain's."""
    return (f"{what}: the mesh has pp=1, so no pipeline schedule runs (the microbatches accumulate); drop it or "
            "set pp in the mesh")


def as_integer(v: Any) -> int | None:
    """``v`` as an int when it is an integer (Python or numpy; not bool, not float), else None."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def positive_finite(x: Any) -> bool:
    # NaN fails every comparison, so `x <= 0` alone lets it (and inf) through to the runtime.
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0
