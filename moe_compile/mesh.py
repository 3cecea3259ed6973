"""Dense mesh (pp, dp, cp) and MoE mesh (pp, ep_dp, ep_mp) over the same ranks.

Glossary: P (pp), D (dp), C (cp), D_E (ep_dp), M_E (ep_mp). Within a PP stage the folded dense pool
dp·cp equals the MoE pool ep_dp·ep_mp (DC = D_E·M_E).

Rank layout (row-major, last axis fastest)::

    rank = stage · (dp·cp) + j          j: index inside the PP stage
    dense:  j = dp_i · cp + cp_i
    MoE:    j = ep_dp_i · ep_mp + ep_mp_i

so an EP-MP group is ep_mp consecutive ranks (neighbours on one host / NVLink island) and an EP-DP
group strides over them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from .errors import MeshError

_AXES = ("dp", "cp", "pp", "ep_dp", "ep_mp")


@dataclass(frozen=True)
class MeshSpec:
    """Parallel degrees. Unset degrees (None) are derived from the world size by `resolve`."""

    dp: int | None = None
    cp: int = 1
    pp: int = 1
    ep_dp: int | None = None
    ep_mp: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise MeshError(f"MeshSpec.{f.name}={v!r}: every degree must be a positive integer")

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """Parse ``"dp=4,ep_mp=2"`` (commas or spaces between ``axis=degree`` pairs)."""
        kwargs: dict[str, int] = {}
        for part in re.split(r"[,\s]+", text.strip()):
            if not part:
                continue
            m = re.fullmatch(r"([a-z_]+)=(\d+)", part)
            if not m or m.group(1) not in _AXES:
                raise MeshError(f"mesh spec {text!r}: cannot read {part!r}; expected axis=degree with axis in {_AXES}")
            if m.group(1) in kwargs:
                raise MeshError(f"mesh spec {text!r}: axis {m.group(1)!r} given twice")
            kwargs[m.group(1)] = int(m.group(2))
        return cls(**kwargs)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in _AXES if getattr(self, a) is not None)

    # -- resolution and validation -------------------------------------------------------------
    def resolve(self, world_size: int) -> MeshSpec:
        """Fill in unset degrees from ``world_size`` and check that everything fits together."""
        if world_size < 1:
            raise MeshError(f"world size must be positive, got {world_size}")
        pp, cp = self.pp, self.cp
        dp = self.dp
        if dp is None:
            if world_size % (pp * cp):
                raise MeshError(
                    f"mesh {self}: world size {world_size} is not divisible by pp·cp = {pp}·{cp} = {pp * cp}, "
                    "so dp cannot be derived"
                )
            dp = world_size // (pp * cp)
        if pp * dp * cp != world_size:
            raise MeshError(
                f"mesh {self}: pp·dp·cp = {pp}·{dp}·{cp} = {pp * dp * cp} ranks, but the world has {world_size}"
            )
        stage = dp * cp
        ep_mp = self.ep_mp
        ep_dp = self.ep_dp
        if ep_dp is None:
            if stage % ep_mp:
                raise MeshError(
                    f"mesh {self}: ep_mp={ep_mp} does not divide dp·cp = {dp}·{cp} = {stage}, "
                    "so ep_dp cannot be derived"
                )
            ep_dp = stage // ep_mp
        if ep_dp * ep_mp != stage:
            raise MeshError(
                f"mesh {self}: within a PP stage dp·cp ({dp}·{cp} = {stage}) must equal "
                f"ep_dp·ep_mp ({ep_dp}·{ep_mp} = {ep_dp * ep_mp})"
            )
        return replace(self, dp=dp, ep_dp=ep_dp)

    @property
    def resolved(self) -> bool:
        return self.dp is not None and self.ep_dp is not None

    @property
    def world_size(self) -> int:
        self._need_resolved()
        return self.pp * self.dp * self.cp  # type: ignore[operator]

    @property
    def stage_size(self) -> int:
        self._need_resolved()
        return self.dp * self.cp  # type: ignore[operator]

    def _need_resolved(self) -> None:
        if not self.resolved:
            raise MeshError(f"mesh {self} is not resolved; call .resolve(world_size) first")

    # -- coordinates ----------------------------------------------------------------------------
    def dense_coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, cp) coordinates of ``rank``."""
        stage, j = divmod(rank, self.stage_size)
        return stage, j // self.cp, j % self.cp

    def moe_coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, ep_dp, ep_mp) coordinates of ``rank``."""
        stage, j = divmod(rank, self.stage_size)
        return stage, j // self.ep_mp, j % self.ep_mp

    def dense_mesh_tensor(self) -> torch.Tensor:
        return torch.arange(self.world_size).view(self.pp, self.dp, self.cp)  # type: ignore[arg-type]

    def moe_mesh_tensor(self) -> torch.Tensor:
        return torch.arange(self.world_size).view(self.pp, self.ep_dp, self.ep_mp)  # type: ignore[arg-type]

    def build(self, device_type: str | None = None) -> MeshGroups:
        """Create the process groups and DeviceMeshes (collective: every rank calls it)."""
        return MeshGroups.create(self, device_type)


def mesh_device_type(model_device: str | None, backend: str) -> str:
    """The device the mesh's collectives carry: the model's (``None``: CUDA where the backend is
    nccl-only, else CPU). The backend's name does not decide it: ``init_process_group()`` without
    a backend reports "undefined" (or "cpu:gloo,cuda:nccl") and serves both devices."""
    if model_device is None:
        return "cuda" if backend == "nccl" else "cpu"
    if model_device == "meta":  # explain plans meta weights over a fake group: nothing is moved
        return "cpu"
    if model_device not in ("cpu", "cuda"):
        raise MeshError(f"the model's parameters are on {model_device!r}; expert-parallel meshes run on cpu or cuda")
    if model_device == "cpu" and backend == "nccl":
        raise MeshError("the process group's backend is nccl, which carries no cpu tensors, but the model is "
                        "on cpu: move it to cuda, or init_process_group('gloo') (or with no backend)")
    return model_device


def _groups_along(mesh: torch.Tensor, axes: tuple[int, ...]) -> list[list[int]]:
    """Rank lists of the sub-meshes spanned by ``axes`` (the other axes fixed)."""
    keep = [a for a in range(mesh.dim()) if a not in axes]
    perm = keep + list(axes)
    flat = mesh.permute(perm).reshape(-1, int(torch.tensor([mesh.shape[a] for a in axes]).prod()))
    return [row.tolist() for row in flat]


@dataclass
class MeshGroups:
    """Process groups of one rank. ``dense`` reduces dense gradients (folded dp×cp), ``ep_mp`` moves
    tokens, ``ep_dp`` reduces routed-expert gradients. DeviceMeshes back the checkpoint views."""

    spec: MeshSpec
    rank: int
    device_type: str
    dense: dist.ProcessGroup
    ep_mp: dist.ProcessGroup
    ep_dp: dist.ProcessGroup
    dense_mesh: object  # DeviceMesh (pp, dp, cp)
    moe_mesh: object  # DeviceMesh (pp, ep_dp, ep_mp)
    pp: dist.ProcessGroup | None = None  # this rank's pipeline (same j in every stage); None at pp=1
    cp: dist.ProcessGroup | None = None  # this rank's context-parallel group (consecutive ranks); None at cp=1

    @classmethod
    def create(cls, spec: MeshSpec, device_type: str | None = None) -> MeshGroups:
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise MeshError("torch.distributed is not initialized: call dist.init_process_group() first")
        world = dist.get_world_size()
        spec = spec.resolve(world)
        rank = dist.get_rank()
        device_type = mesh_device_type(device_type, dist.get_backend())
        dense_t, moe_t = spec.dense_mesh_tensor(), spec.moe_mesh_tensor()

        def mine(rank_lists: list[list[int]]) -> dist.ProcessGroup:
            # new_group is collective over the world: every rank creates every group, in order.
            out = None
            for ranks in rank_lists:
                g = dist.new_group(ranks)
                if rank in ranks:
                    out = g
            assert out is not None
            return out

        dense = mine(_groups_along(dense_t, (1, 2)))
        ep_mp = mine(_groups_along(moe_t, (2,)))
        ep_dp = mine(_groups_along(moe_t, (1,)))
        pp = mine(_groups_along(dense_t, (0,))) if spec.pp > 1 else None
        cp = mine(_groups_along(dense_t, (2,))) if spec.cp > 1 else None
        dense_mesh = DeviceMesh(device_type, dense_t, mesh_dim_names=("pp", "dp", "cp"))
        moe_mesh = DeviceMesh(device_type, moe_t, mesh_dim_names=("pp", "ep_dp", "ep_mp"))
        return cls(spec, rank, device_type, dense, ep_mp, ep_dp, dense_mesh, moe_mesh, pp, cp)

    @property
    def ep_rank(self) -> int:
        return self.spec.moe_coords(self.rank)[2]

    @property
    def cp_rank(self) -> int:
        return self.spec.dense_coords(self.rank)[2]

    @property
    def pp_rank(self) -> int:
        return self.spec.dense_coords(self.rank)[0]

    @property
    def ep_dp_rank(self) -> int:
        return self.spec.moe_coords(self.rank)[1]
