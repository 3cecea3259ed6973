"""Kernel cache: one entry per specialisation, holding the launch config chosen for it.

Terms: a *specialisation* (:class:`KernelSpec`) is everything a generated kernel is compiled for —
its static sizes (capacity rows, d_model, h_e, num_local_experts, …), dtypes and fused-form flags.
A *plan* (:class:`LaunchPlan`) is the specialisation plus its candidate configs and its grid rule.

    plan   = family.plan_<kernel>(tensors or fake tensors)      # shapes and dtypes only
    entry  = CACHE[plan.spec]                                   # chosen once per specialisation
           | GPU, several candidates: time each (triton.testing.do_bench), keep the fastest
           | interpreter: the single fixed config (tiles ≥ 64 keep it fast enough)
    launch = kernel[plan.grid(entry.config)](…, **entry.config.meta)

Lowering builds the same plans from the graph's fake tensors, so ``CompiledMoE.kernels()`` can list
every launch (name, specialisation, grid) of every MoE layer. Triton keeps its own binary cache per
constexpr/dtype signature underneath; this cache is the compiler's inventory and tuning memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Config:
    meta: tuple[tuple[str, int], ...]  # constexpr tile sizes, e.g. (("BM", 64), ("BN", 64), ("BK", 64))
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def of(cls, num_warps: int = 4, num_stages: int = 3, **meta: int) -> Config:
        return cls(tuple(sorted(meta.items())), num_warps, num_stages)

    def __getitem__(self, key: str) -> int:
        return dict(self.meta)[key]

    def kwargs(self, interpret: bool) -> dict[str, int]:
        out = dict(self.meta)
        if not interpret:
            out.update(num_warps=self.num_warps, num_stages=self.num_stages)
        return out

    def describe(self) -> dict[str, int]:
        return dict(self.meta, num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class KernelSpec:
    family: str  # kernel file, e.g. "grouped_gemm"
    kernel: str  # the @triton.jit function, e.g. "grouped_mm_kernel"
    static: tuple[tuple[str, Any], ...]  # sizes, dtypes and flags the kernel is specialised on

    def describe(self) -> dict[str, Any]:
        return dict(self.static)


@dataclass(frozen=True)
class LaunchPlan:
    spec: KernelSpec
    configs: tuple[Config, ...]  # candidates; the first is the default
    grid: Callable[[Config], tuple[int, ...]]
    interpret: bool

    def config(self) -> Config | None:
        """The config chosen for this specialisation (None: not launched yet and still to be tuned)."""
        entry = CACHE.get(self.spec)
        if entry is not None:
            return entry.config
        return self.configs[0] if (self.interpret or len(self.configs) == 1) else None


@dataclass
class CacheEntry:
    config: Config
    launches: int = 0
    timings_ms: dict[Config, float] = field(default_factory=dict)  # autotuning results (GPU)


CACHE: dict[KernelSpec, CacheEntry] = {}


def make_spec(family: str, kernel: str, **static: Any) -> KernelSpec:
    return KernelSpec(family, kernel, tuple((k, _plain(v)) for k, v in static.items()))


def _plain(v: Any) -> Any:
    return str(v).replace("torch.", "") if not isinstance(v, int | float | str | bool | type(None)) else v


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << math.ceil(math.log2(n))


def launch(plan: LaunchPlan, run: Callable[[Config, tuple[int, ...]], Any]) -> Any:
    """Run ``run(config, grid)`` with the cached config of the plan's specialisation (tuning it first
    on a GPU when several candidates exist). ``run`` must be idempotent: tuning calls it repeatedly."""
    entry = CACHE.get(plan.spec)
    if entry is None:
        entry = _choose(plan, run) if not plan.interpret and len(plan.configs) > 1 else CacheEntry(plan.configs[0])
        CACHE[plan.spec] = entry
    entry.launches += 1
    return run(entry.config, plan.grid(entry.config))


def _choose(plan: LaunchPlan, run: Callable[[Config, tuple[int, ...]], Any]) -> CacheEntry:
    from triton.testing import do_bench

    timings: dict[Config, float] = {}
    errors: list[str] = []
    for cfg in plan.configs:
        try:
            timings[cfg] = float(do_bench(lambda cfg=cfg: run(cfg, plan.grid(cfg)), warmup=5, rep=20))
        except Exception as e:  # noqa: BLE001 - a candidate the device cannot run (e.g. shared memory)
            errors.append(f"{cfg.describe()}: {type(e).__name__}: {e}")
    if not timings:
        raise RuntimeError(f"no launch config of {plan.spec.kernel} {plan.spec.describe()} runs:\n" + "\n".join(errors))
    return CacheEntry(min(timings, key=timings.__getitem__), timings_ms=timings)


def describe_plan(plan: LaunchPlan, op: str, graph: str) -> dict[str, Any]:
    cfg = plan.config()
    return {
        "name": plan.spec.kernel,
        "family": plan.spec.family,
        "op": op,
        "graph": graph,
        "specialisation": plan.spec.describe(),
        "config": cfg.describe() if cfg is not None else "autotuned at first launch",
        "grid": plan.grid(cfg) if cfg is not None else None,
    }
