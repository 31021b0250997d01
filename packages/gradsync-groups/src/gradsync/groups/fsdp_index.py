"""`FSDPDistributedIndex`: the process groups and sub-meshes of (hybrid) sharded data parallelism.

FSDP names mesh dimensions instead of group kinds: the shard dimension (``dp_shard``, often DP×CP
flattened), an optional outer replicate/shard dimension for HSDP (``dp_outer``), and TP. This index
resolves those names to groups once, for the dense mesh and optionally an expert mesh, so the FSDP
package never slices meshes itself. It can be built from existing meshes or from sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .backend import get_backend_capabilities
from .teardown import guard_group_teardown, release_at_exit
from .torch_internals import default_group, flatten_mesh

MeshKey = tuple[tuple[str, ...], bool]

_WORLD_MESHES: dict[tuple[str, int, int, int], tuple[object, DeviceMesh, dist.ProcessGroup | None]] = {}
"""(device type, sizes) -> (the default group it was built over, the mesh, its flattened HSDP group).
Dropped at exit (:func:`~gradsync.groups.teardown.release_groups_at_exit`)."""
release_at_exit(_WORLD_MESHES.clear)


def _world_mesh(
    device_type: str, dp_outer: int, dp_shard: int, tp: int
) -> tuple[DeviceMesh, dist.ProcessGroup | None]:
    """The ``(dp_outer, dp_shard, tp)`` mesh over the world, built once per default group: a new default
    group (after ``destroy_process_group``) builds anew."""
    default = default_group()
    key = (device_type, dp_outer, dp_shard, tp)
    cached = _WORLD_MESHES.get(key)
    if cached is not None and cached[0] is default:
        return cached[1], cached[2]
    for stale in [k for k, (world, _, _) in _WORLD_MESHES.items() if world is not default]:
        del _WORLD_MESHES[stale]  # built in a world that is gone: its groups with it
    mesh = init_device_mesh(
        device_type, (dp_outer, dp_shard, tp), mesh_dim_names=("dp_outer", "dp_shard", "tp")
    )
    hybrid_group = flatten_mesh(mesh["dp_outer", "dp_shard"], "hsdp").get_group() if dp_outer > 1 else None
    for group in [*mesh.get_all_groups(), hybrid_group]:
        guard_group_teardown(group)
    _WORLD_MESHES[key] = (default, mesh, hybrid_group)
    return mesh, hybrid_group


class FSDPDistributedIndex:
    """Groups and sub-meshes for Megatron-FSDP, keyed by dimension names.

    ``dp_outer_dim`` enables hybrid FSDP (HSDP); it must come with ``hybrid_fsdp_group``, the flattened
    outer × shard group gradients are reduced over.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        dp_shard_dim: str | None = None,
        dp_outer_dim: str | None = None,
        tp_dim: str | None = None,
        hybrid_fsdp_group: dist.ProcessGroup | None = None,
        hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
        hsdp_outer_dp_shard: bool = False,
        expt_device_mesh: DeviceMesh | None = None,
        fsdp_group_ag: dist.ProcessGroup | None = None,
        expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    ) -> None:
        self.device_mesh = device_mesh
        self.expt_device_mesh = expt_device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.use_hybrid_fsdp = dp_outer_dim is not None
        self.hsdp_outer_dp_shard = hsdp_outer_dp_shard
        self.hybrid_fsdp_group = hybrid_fsdp_group
        self.hybrid_fsdp_expt_group = hybrid_fsdp_expt_group
        self.fsdp_group_ag = fsdp_group_ag
        self.expt_fsdp_group_ag = expt_fsdp_group_ag

        if dp_shard_dim is None:
            raise ValueError(
                "FSDPDistributedIndex requires an FSDP process group (dp_shard_dim, fsdp_group): "
                "pass dp_shard_dim naming the sharding dimension of device_mesh"
            )
        self.fsdp_group = _dim_group(device_mesh, dp_shard_dim)
        self.expt_fsdp_group = (
            _dim_group(expt_device_mesh, dp_shard_dim) if expt_device_mesh is not None else None
        )
        self.outer_fsdp_group: dist.ProcessGroup | None = None
        self.expt_outer_fsdp_group: dist.ProcessGroup | None = None
        if dp_outer_dim is not None:
            if hybrid_fsdp_group is None:
                raise ValueError(
                    f"hybrid FSDP (dp_outer_dim={dp_outer_dim!r}) requires hybrid_fsdp_group, the "
                    "flattened outer x shard group"
                )
            self.outer_fsdp_group = _dim_group(device_mesh, dp_outer_dim)
            if expt_device_mesh is not None:
                self.expt_outer_fsdp_group = _dim_group(expt_device_mesh, dp_outer_dim)

        self.mesh_library: dict[MeshKey, DeviceMesh] = {}
        self._register(device_mesh, is_expert=False, outer_only=False)
        if expt_device_mesh is not None:
            self._register(device_mesh, is_expert=True, outer_only=True)
            self._register(expt_device_mesh, is_expert=True, outer_only=False)
        self._logical_rank: dict[bool, int] = {}

    @classmethod
    def from_sizes(
        cls,
        dp_shard: int,
        dp_outer: int = 1,
        tp: int = 1,
        *,
        hsdp_outer_dp_shard: bool = False,
        device_type: str | None = None,
    ) -> FSDPDistributedIndex:
        """Build a ``(dp_outer, dp_shard, tp)`` mesh over the world (outer-major) and index it.

        ``dp_outer > 1`` turns on HSDP. The device type follows the default group's backend. The mesh and
        its groups are built once per sizes and device type over the current default group and reused by
        later calls (a process wrapping many models would otherwise pile up groups and their threads).
        """
        world = dist.get_world_size()
        if dp_outer * dp_shard * tp != world:
            raise ValueError(
                f"dp_outer ({dp_outer}) x dp_shard ({dp_shard}) x tp ({tp}) must equal the world size "
                f"({world})"
            )
        if device_type is None:
            device_type = get_backend_capabilities().device_type
        mesh, hybrid_group = _world_mesh(device_type, dp_outer, dp_shard, tp)
        hybrid = dp_outer > 1
        return cls(
            mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer" if hybrid else None,
            tp_dim="tp",
            hybrid_fsdp_group=hybrid_group,
            hsdp_outer_dp_shard=hsdp_outer_dp_shard,
        )

    @classmethod
    def from_group(
        cls,
        group: dist.ProcessGroup,
        *,
        device_type: str | None = None,
        all_gather_group: dist.ProcessGroup | None = None,
    ) -> FSDPDistributedIndex:
        """Index a one-dimensional shard mesh over an existing group, such as the data-parallel group of a
        ProcessGroupCollection when FSDP runs beside tensor or pipeline parallelism. ``all_gather_group``:
        a second group over the same ranks for param all-gathers (the collection's ``dp_cp_ag``), so they
        do not queue behind grad reductions."""
        if device_type is None:
            device_type = get_backend_capabilities(group).device_type
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp_shard",))
        return cls(mesh, dp_shard_dim="dp_shard", fsdp_group_ag=all_gather_group)

    def _register(self, mesh: DeviceMesh, *, is_expert: bool, outer_only: bool) -> None:
        shard, outer, tp = self.dp_shard_dim, self.dp_outer_dim, self.tp_dim
        assert shard is not None
        candidates: list[tuple[str | None, ...]] = [(outer, shard), (outer, shard, tp)]
        if not outer_only:
            candidates += [(tp,), (shard, tp), (shard,)]
        for dims in candidates:
            if any(d is None for d in dims):
                continue
            names = tuple(d for d in dims if d is not None)
            self.mesh_library[(names, is_expert)] = mesh[names]

    def get_submesh(
        self, mesh_dim_names: str | Sequence[str], is_expert_parallel: bool = False
    ) -> DeviceMesh:
        """The registered sub-mesh over ``mesh_dim_names``."""
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        key = (names, is_expert_parallel)
        if key not in self.mesh_library:
            registered = sorted(k for k, e in self.mesh_library if e == is_expert_parallel)
            raise ValueError(
                f"No sub-mesh {names} (is_expert_parallel={is_expert_parallel}); registered: {registered}"
            )
        return self.mesh_library[key]

    def get_dp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup:
        """The group gradients are reduced over: the hybrid group with HSDP, else the shard group."""
        if self.use_hybrid_fsdp:
            group = self.hybrid_fsdp_expt_group if is_expert_parallel else self.hybrid_fsdp_group
        else:
            group = self.expt_fsdp_group if is_expert_parallel else self.fsdp_group
        return _require(group, "data-parallel", is_expert_parallel)

    def get_fsdp_group(
        self, is_expert_parallel: bool = False, independent_all_gather: bool = False
    ) -> dist.ProcessGroup:
        """The sharding group, or its separate all-gather communicator when asked and present."""
        if independent_all_gather:
            ag = self.expt_fsdp_group_ag if is_expert_parallel else self.fsdp_group_ag
            if ag is not None:
                return ag
        group = self.expt_fsdp_group if is_expert_parallel else self.fsdp_group
        return _require(group, "FSDP shard", is_expert_parallel)

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        """The HSDP outer group, or None without HSDP."""
        if not self.use_hybrid_fsdp:
            return None
        return self.expt_outer_fsdp_group if is_expert_parallel else self.outer_fsdp_group

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh:
        mesh = self.expt_device_mesh if is_expert_parallel else self.device_mesh
        if mesh is None:
            raise ValueError("No expert device mesh was given (expt_device_mesh=None)")
        return mesh

    def get_logical_hybrid_fsdp_rank(self, is_expert_parallel: bool = False) -> int:
        """This rank's position in the (inner, outer) order that outer-sharded HSDP lays shards in.

        With hybrid rank r = o·N + i (outer-major, N shard ranks, M outer ranks) it is i·M + o.
        """
        if not self.hsdp_outer_dp_shard:
            raise ValueError("get_logical_hybrid_fsdp_rank needs hsdp_outer_dp_shard=True")
        if is_expert_parallel not in self._logical_rank:
            hybrid = self.get_dp_group(is_expert_parallel)
            inner = self.get_fsdp_group(is_expert_parallel).size()
            outer = hybrid.size() // inner
            r = hybrid.rank()
            self._logical_rank[is_expert_parallel] = (r % inner) * outer + r // inner
        return self._logical_rank[is_expert_parallel]


def _dim_group(mesh: DeviceMesh, dim: str) -> dist.ProcessGroup:
    try:
        return mesh[dim].get_group()
    except (KeyError, RuntimeError, ValueError) as err:
        raise ValueError(f"device mesh {mesh.mesh_dim_names} has no dimension {dim!r}: {err}") from err


def _require(group: dist.ProcessGroup | None, what: str, is_expert: bool) -> dist.ProcessGroup:
    if group is None:
        kind = "expert " if is_expert else ""
        raise ValueError(f"No {kind}{what} group: pass expt_device_mesh (and its groups) for experts")
    return group
