"""The process groups a DistributedDataParallel reduces over, resolved from what its caller passed.

Resolved before anything else is built, so that a config saying model-parallel with no groups to match is
refused before a single collective runs.
"""

from __future__ import annotations

import torch.distributed as dist

from gradsync.groups import ModelParallelConfigProtocol, ProcessGroupCollection
from gradsync.groups.model_config import describe_model_parallel


def resolve_process_groups(
    pg_collection: ProcessGroupCollection | None, config: ModelParallelConfigProtocol
) -> ProcessGroupCollection:
    """The groups DDP uses: pure DP over the default world when none are given; otherwise the given
    collection (never modified), with dp_cp defaulting to dp when there is no context parallelism.

    Without groups every rank is a DP replica, so a config that says model-parallel is refused: averaging
    TP shards or pipeline stages as if they were replicas would give silently wrong grads.
    """
    if pg_collection is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel: torch.distributed is not initialized and no pg_collection was "
                "given: call torch.distributed.init_process_group(backend) first (gloo on CPU, nccl on CUDA; "
                "under torchrun it reads the rank and world size from the environment)"
            )
        sizes = describe_model_parallel(config)
        if sizes:
            raise ValueError(
                f"DistributedDataParallel: the config says {sizes} but no pg_collection was given, so every "
                "rank would be treated as a data-parallel replica. Pass "
                "pg_collection=gradsync.groups.initialize_model_parallel(...) (or a ProcessGroupCollection "
                "with dp, dp_cp, tp, pp, ...), or set those sizes to 1."
            )
        world = dist.group.WORLD
        return ProcessGroupCollection(
            dp=world,
            dp_cp=world,
            intra_dp_cp=world,
            expt_dp=world,
            intra_expt_dp=world,
            intra_dist_opt=world,
        )
    given = dict(vars(pg_collection))
    if given.get("dp") is None:
        raise ValueError("dp process group is required but not provided in pg_collection")
    if given.get("dp_cp") is None:
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError(
                "dp_cp process group is required when context_parallel_size > 1 but not provided in "
                "pg_collection"
            )
        given["dp_cp"] = given["dp"]
    return ProcessGroupCollection(**given)
