"""FSDPDistributedIndex on real ranks: shard, outer and hybrid groups resolve to the mesh's ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.testing import run_distributed, test_device


def ranks(group: dist.ProcessGroup | None) -> list[int]:
    assert group is not None
    return dist.get_process_group_ranks(group)


def hsdp_two_by_two() -> None:
    rank = dist.get_rank()
    outer, shard = divmod(rank, 2)  # mesh (dp_outer, dp_shard, tp) = (2, 2, 1), outer-major
    index = FSDPDistributedIndex.from_sizes(
        dp_shard=2, dp_outer=2, hsdp_outer_dp_shard=True, device_type=test_device().type
    )
    assert index.use_hybrid_fsdp
    assert ranks(index.get_fsdp_group()) == [2 * outer, 2 * outer + 1]
    assert ranks(index.get_outer_fsdp_group()) == [shard, shard + 2]
    assert ranks(index.get_dp_group()) == [0, 1, 2, 3]
    assert index.get_logical_hybrid_fsdp_rank() == shard * 2 + outer
    assert index.get_submesh(("dp_shard", "tp")).mesh.numel() == 2
    assert index.get_submesh("tp").mesh.numel() == 1
    assert index.get_root_mesh().mesh_dim_names == ("dp_outer", "dp_shard", "tp")
    with pytest.raises(ValueError, match=r"No sub-mesh \('cp',\)"):
        index.get_submesh("cp")
    with pytest.raises(ValueError, match="No expert FSDP shard group"):
        index.get_fsdp_group(is_expert_parallel=True)


def plain_fsdp_over_four() -> None:
    index = FSDPDistributedIndex.from_sizes(dp_shard=4, device_type=test_device().type)
    assert not index.use_hybrid_fsdp
    assert index.get_outer_fsdp_group() is None
    assert ranks(index.get_dp_group()) == [0, 1, 2, 3]
    assert index.get_dp_group() is index.get_fsdp_group()
    with pytest.raises(ValueError, match="hsdp_outer_dp_shard=True"):
        index.get_logical_hybrid_fsdp_rank()
    with pytest.raises(ValueError, match=r"dp_outer \(1\) x dp_shard \(2\) x tp \(1\) must equal"):
        FSDPDistributedIndex.from_sizes(dp_shard=2)


def from_an_existing_group() -> None:
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[dist.get_rank() % 2]
    index = FSDPDistributedIndex.from_group(mine, device_type=test_device().type)
    assert ranks(index.get_fsdp_group()) == [dist.get_rank() % 2, dist.get_rank() % 2 + 2]
    assert index.get_submesh("dp_shard").size() == 2


def explicit_meshes_with_experts() -> None:
    device_type = test_device().type
    mesh = init_device_mesh(device_type, (4, 1), mesh_dim_names=("dp_shard", "tp"))
    expert_mesh = init_device_mesh(device_type, (2, 2), mesh_dim_names=("dp_shard", "tp"))
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", tp_dim="tp", expt_device_mesh=expert_mesh)
    rank = dist.get_rank()
    assert ranks(index.get_fsdp_group(is_expert_parallel=True)) == [rank % 2, rank % 2 + 2]
    assert index.get_root_mesh(is_expert_parallel=True) is expert_mesh
    with pytest.raises(ValueError, match="requires an FSDP process group"):
        FSDPDistributedIndex(mesh)
    with pytest.raises(ValueError, match="requires hybrid_fsdp_group"):
        FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", dp_outer_dim="tp")


@pytest.mark.parametrize(
    "body", [hsdp_two_by_two, plain_fsdp_over_four, from_an_existing_group, explicit_meshes_with_experts]
)
def test_fsdp_index(body: object) -> None:
    run_distributed(body, 4)  # type: ignore[arg-type]
