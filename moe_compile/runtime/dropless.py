"""Dropless receive capacity that follows the load: headroom, overflow watch, geometric growth.

Terms: R = T·K routed rows per rank, ep = EP-MP group size, f = receive factor (capacity rows
C = ⌈min(ep, f)·R⌉), h = headroom (the first f), ρ = load imbalance = the most rows any rank of the
group receives / R (ρ = 1 uniform; ρ = ep: every row to one rank).

    compile          C = ⌈min(ep, f)·R⌉ rows per receive buffer            (f starts at h)
    every dispatch   need_dst = Σ_src,e requested[src, dst, e]            (tensors; same on every rank:
                     overflow |= any(need_dst > C_dst); high_water = max(need)   the counts are all-gathered)
    end of forward   if overflow (one host read per forward, on every rank alike):
                         f ← min(ep, h·2^⌈log2(ρ/h)⌉) (the smallest doubling of h that holds ρ), recorded;
                         recompile for the new C and run the same forward again (inputs and RNG restored)

Ranks routing different numbers of rows (batches of different shapes, all_to_all transport): rank r's
capacity is ⌈min(ep, f)·R_r⌉ for its own R_r, and each rank sends its capacity with its counts, so the
watch compares each destination's need with that destination's own capacity and the growth holds the
largest need_r / R_r (every rank reads every R_r off the same counts). A rank routing few rows can then
receive more than ep·R_r (up to the group's ΣR): only when a load needs it does f grow past ep
(``beyond_ep``), uncapped from then on, each buffer then bounded by the most rows the group has routed
in one dispatch (``group_rows``). A rank that runs a graph compiled before a growth (its batch shape's)
is taken at that graph's capacity; if it overflows, the forward reruns on freshly compiled graphs
without growing f.

An attempt that overflowed dropped tail rows, so its outputs are discarded, never returned: a returned
forward never dropped a token. Growth is geometric, at most ⌈log2(ep/h)⌉ recompiles over a run, each
one recorded in :attr:`DroplessState.growths` (and warned about); the capacity never shrinks.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from fractions import Fraction

import torch

DROPLESS_HEADROOM = Fraction(3, 2)  # h: the default first receive factor (CompileOptions.dropless_headroom)


def dropless_rows(rows: int, ep: int, factor: Fraction) -> int:
    """Receive rows ⌈min(ep, f)·rows⌉ (ep = 1: exactly rows — the local group's buffer is its input)."""
    return math.ceil(min(Fraction(ep), Fraction(factor)) * rows)


def grown_factor(headroom: Fraction, factor: Fraction, need: int, rows: int, ep: int, cap: bool = True) -> Fraction:
    """After an overflow at factor f: the smallest f·2^k (k ≥ 1) with f·2^k·rows ≥ need, capped at ep (where
    nothing can overflow). From f = h that is h·2^⌈log2(ρ/h)⌉, as :func:`factor_for_imbalance` predicts.
    ``cap=False``: ranks route different numbers of rows, and a rank routing few may receive more than ep
    times its own rows (up to the group's total): the doubling goes past ep."""
    target = Fraction(need, max(rows, 1))
    f = Fraction(factor) * 2
    while f < target:
        f *= 2
    return min(Fraction(ep), f) if cap else f


def factor_for_imbalance(headroom: Fraction, rho: float, ep: int) -> Fraction:
    """The receive factor the growth rule settles on for a load of imbalance ρ: h·2^⌈log2(ρ/h)⌉, ≥ h, ≤ ep."""
    f = Fraction(headroom)
    while f < Fraction(rho).limit_denominator(10**6):
        f *= 2
    return min(Fraction(ep), f)


@dataclass(frozen=True)
class Growth:
    forward: int  # how many forwards had run when the capacity grew
    need_rows: int  # the most rows one rank would have received
    rows: int  # R = T·K of the block that overflowed first
    factor_before: Fraction
    factor_after: Fraction


@dataclass
class DroplessState:
    """One compiled program's dropless capacity (per runtime context; identical on every EP-MP rank)."""

    ep: int
    headroom: Fraction = DROPLESS_HEADROOM
    factor: Fraction = DROPLESS_HEADROOM
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # block → (R rows, C capacity) compiled
    overflow: torch.Tensor | None = None  # [] bool: this forward, some rank would receive more than C
    need: torch.Tensor | None = None  # [] int64: most rows one rank would receive, this forward
    worst: torch.Tensor | None = None  # [2] int64: (need, rows) of the destination needing the largest factor
    total: torch.Tensor | None = None  # [] int64: most rows the whole group routed in one dispatch, this forward
    beyond_ep: bool = False  # the factor grew past ep (ranks routing different numbers of rows needed it)
    group_rows: int = 0  # most rows the whole group routed in one dispatch (host int; bounds C past ep)
    high_water: int = 0  # most rows one rank received, over every settled forward (host int)
    forwards: int = 0
    growths: list[Growth] = field(default_factory=list)
    # Ranks beyond the EP-MP group whose forwards are collective with this one (the CP group's K/V
    # all-gathers span EP-MP groups): they must rerun together, so the watch is agreed over this group
    sync_group: object = None
    ctx_id: int = -1

    @property
    def receive_factor(self) -> Fraction:
        """φ: every rank's capacity is ⌈φ·R⌉ for the R rows it routes. min(ep, f): with every rank routing
        R rows nobody receives more than ep·R; past ep only after ranks routing different R needed it."""
        return self.factor if self.beyond_ep else min(Fraction(self.ep), Fraction(self.factor))

    def capacity(self, block: str, rows: int) -> int:
        cap = math.ceil(self.receive_factor * rows)  # dropless_rows, or ⌈f·rows⌉ past ep
        if self.beyond_ep and self.group_rows:  # nobody receives more than the group routes in all
            cap = min(cap, self.group_rows)
        self.blocks[block] = (rows, cap)
        return cap

    def observe(self, requested: torch.Tensor, capacity: int | torch.Tensor) -> None:
        """Tensor ops only (no host sync): fold one dispatch's all-gathered counts into the watch.
        ``capacity``: each destination's receive rows ([ep], or one number for all)."""
        need_d = requested.sum(dim=(0, 2))  # [ep, ep, L] → rows each destination would receive
        rows_d = requested.sum(dim=(1, 2)).clamp(min=1)  # rows each rank routes (its capacity is φ·that)
        over = (need_d > capacity).any()
        # the destination that needs the largest factor, as exact integers (need, rows) for the growth rule
        w = torch.argmax(need_d.double() / rows_d.double()).view(1)
        worst = torch.stack([need_d, rows_d]).index_select(1, w).view(2)
        need = need_d.max()
        total = requested.sum()
        if self.need is not None:
            better = worst[0] * self.worst[1] > self.worst[0] * worst[1]
            worst = torch.where(better, worst, self.worst)
            need = torch.maximum(self.need, need)
            total = torch.maximum(self.total, total)
        self.need, self.worst, self.total = need, worst, total
        self.overflow = over if self.overflow is None else self.overflow | over

    def settle(self) -> bool:
        """End of a forward: True when it overflowed (the caller recompiles and reruns it). The one host
        read of the dropless path: one list (overflow, most rows, the worst destination's need and rows) per
        forward, not per layer."""
        over, need, worst, total = self.overflow, self.need, self.worst, self.total
        self.overflow = self.need = self.worst = self.total = None
        if self.ctx_id in _UNCOUNTED:  # a warm-up forward (outputs dropped): its load is not the run's
            return False
        self.forwards += 1
        if over is None or over.device.type == "meta":  # explain traces on meta tensors: nothing observed
            return False
        mine = torch.cat([over.to(need.dtype).view(1), need.view(1), worst, total.view(1)])
        if self.sync_group is not None:  # one rerun decision for every rank the forward talks to
            import torch.distributed as dist

            parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.sync_group))]
            dist.all_gather(parts, mine, group=self.sync_group)
        else:
            parts = [mine]
        # host read (necessary: a recompile is a host decision), once per forward
        seen = torch.stack(parts).tolist()
        need_rows = max(p[1] for p in seen)
        self.high_water = max(self.high_water, need_rows)
        self.group_rows = max(self.group_rows, max(p[4] for p in seen))
        if not any(p[0] for p in seen):
            return False
        target = max(Fraction(p[2], p[3]) for p in seen)  # the largest factor some destination needs
        if target <= self.receive_factor:  # a graph compiled for an older capacity (another shape's) or bound
            warnings.warn(f"dropless: a rank would receive {need_rows} rows > the capacity its graph was compiled "
                          f"for before; recompiling at receive factor {self.factor} and rerunning this forward",
                          stacklevel=2)
            return True
        before = self.factor
        self.factor = grown_factor(self.headroom, self.receive_factor, target.numerator, target.denominator,
                                   self.ep, cap=target <= self.ep and not self.beyond_ep)
        self.beyond_ep = self.beyond_ep or self.factor > self.ep
        rows = max(r for r, _ in self.blocks.values()) if self.blocks else 1
        self.growths.append(Growth(self.forwards, need_rows, rows, before, self.factor))
        warnings.warn(f"dropless: a rank would receive {need_rows} rows > capacity; receive factor grows "
                      f"{before} → {self.factor} (×T·K rows), recompiling and rerunning this forward",
                      stacklevel=2)
        return True

    @property
    def ledger_factor(self) -> Fraction:
        """The factor the ledger's C = ⌈c_f·T·K⌉ takes: min(ep, f); past ep the compiled buffers' own
        (bounded by the group's rows)."""
        if not self.beyond_ep or not self.blocks:
            return self.receive_factor
        return max(Fraction(c, max(r, 1)) for r, c in self.blocks.values())


_STATES: dict[int, DroplessState] = {}
_UNCOUNTED: set[int] = set()  # runtime contexts whose forwards settle nothing now (see uncounted)


@contextlib.contextmanager
def uncounted(ctx_id: int):
    """Forwards of context ``ctx_id`` inside the block leave its dropless state as it was: no growth, no
    rerun, no high-water. For the pipeline's warm-up forward on zero activations, whose output is dropped:
    every token alike routes to the same top-k experts (imbalance ep), which would grow the receive
    capacity to ep·T·K for the rest of the run. Every rank of the group enters the block alike (the
    overflow watch's collective is skipped on all of them)."""
    _UNCOUNTED.add(ctx_id)
    try:
        yield
    finally:
        _UNCOUNTED.discard(ctx_id)


def dropless_state(ctx_id: int, ep: int, headroom: float | Fraction | None = None) -> DroplessState:
    """The dropless state of runtime context ``ctx_id`` (created on first use, starting at ``headroom``)."""
    s = _STATES.get(ctx_id)
    if s is None or s.ep != ep:
        h = DROPLESS_HEADROOM if headroom is None else Fraction(headroom).limit_denominator(1000)
        s = _STATES[ctx_id] = DroplessState(ep, headroom=h, factor=h, ctx_id=ctx_id)
    return s


def find_dropless_state(ctx_id: int) -> DroplessState | None:
    return _STATES.get(ctx_id)


class DroplessEntry:
    """The callable the backend returns for a program with dropless dispatches on an EP-MP group > 1:
    runs the compiled forward, settles the overflow watch, and on overflow recompiles (``build``) and
    reruns with the same inputs and RNG state. Cross-group consistency: every rank of the group reads the
    same all-gathered counts, so all of them rerun (and recompile) together."""

    MAX_ATTEMPTS = 64  # far above ⌈log2(ep/h)⌉ + 1; reaching it is a bug, not a load

    def __init__(self, state: DroplessState, build) -> None:
        self.state = state
        self.build = build
        self.fn = build()

    def __call__(self, *args):
        rng = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        for _ in range(self.MAX_ATTEMPTS):
            self.state.overflow = self.state.need = None
            out = self.fn(*args)
            if not self.state.settle():
                return out
            del out  # dropped rows: never returned (its autograd graph and leases end here)
            torch.set_rng_state(rng)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)
            self.fn = self.build()
        raise RuntimeError(f"dropless: still overflowing after {self.MAX_ATTEMPTS} capacity growths")
