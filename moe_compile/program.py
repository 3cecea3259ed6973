"""Program: everything the compiler decided for one CompiledMoE, shared by passes, backend and runtime."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch.fx as fx

from .frontend import MoEBlockSpec
from .mesh import MeshSpec
from .options import CompileOptions
from .passes.base import PassRecord


@dataclass
class Program:
    blocks: dict[str, MoEBlockSpec]  # by original module path
    options: CompileOptions
    mesh: MeshSpec  # resolved
    ctx_id: int  # runtime context the ops of this program reach
    ep_size: int
    ep_rank: int
    ep_group_name: str
    transport: str = "local"  # resolved: local | all_to_all | symmetric
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)  # last capture: captured … backward
    # the last training capture's graphs (the ledger's): an evaluation under no_grad compiles another
    # forward into ``graphs`` but no backward, and a ledger pairing them failed or counted the evaluation
    training_graphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    records: list[PassRecord] = field(default_factory=list)
    compiles: int = 0
    lease_plans: dict[str, object] = field(default_factory=dict)  # "training" / "inference" → LeasePlan
    param_names: dict[int, str] = field(default_factory=dict)  # id(parameter) → name in the compiled model
    dense_weight_stores: dict[str, object] = field(default_factory=dict)  # dense linears running in MXFP8
    codegen: str = "torch"  # resolved: torch | triton
    kernel_plans: dict[str, list] = field(default_factory=dict)  # graph kind → [(block, op, [LaunchPlan])]
    cp_rank: int = 0  # this rank's index in its context-parallel group
    # cp > 1: module path → first position where positions made from the shard's length would be wrong
    # (passes/cp_positions.py rewrites them to the shard's global ones)
    cp_length_positions: dict[str, int] = field(default_factory=dict)
    cp_windows: dict[str, int] = field(default_factory=dict)  # cp > 1: decoder layer ("*": all) → sliding window
    cp_chunks: dict[str, int] = field(default_factory=dict)  # cp > 1: decoder layer → attention chunk (Llama 4)
    cp_whole_mixers: tuple[str, ...] = ()  # cp > 1: linear-attention mixers run on the whole sequence (hf_mixers)
    pipeline_stage: int = 0  # the pipeline stage this program runs (lease pools are per stage)
    owned: set | None = None  # pp > 1: names of the parameters this rank's stages hold (None: all)
    tied_copies: set = field(default_factory=set)  # names of weights tied across stages another rank also holds
    #                                                and counts in the gradient norm (runtime/tied_weights.py)
    schedule: object = None  # moe_compile.schedules.ScheduleOrder of a pipeline, which plans are proven against
    # the gradient reducer the in-graph reduction nodes reach (None: ctx_id's); explain's plan of a stage
    # another rank holds: that rank's buckets (train/planned_buckets.py)
    reducer_id: int | None = None

    @property
    def num_local(self) -> dict[str, int]:
        return {p: s.experts.num_experts // self.ep_size for p, s in self.blocks.items()}

    def debug_path(self) -> Path | None:
        """Where this rank dumps graphs and kernels (options.debug_dir): the directory itself in one
        process, its ``rank<r>/`` subdirectory when several ranks share it (each rank's graphs differ:
        its experts, its pipeline stage; written to one place they overwrote each other)."""
        if not self.options.debug_dir:
            return None
        import torch.distributed as dist

        root = Path(self.options.debug_dir)
        if dist.is_initialized() and dist.get_world_size() > 1:
            return root / f"rank{dist.get_rank()}"
        return root
