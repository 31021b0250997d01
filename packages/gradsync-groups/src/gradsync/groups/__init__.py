"""gradsync.groups: process groups for data, tensor, pipeline, context and expert parallelism.

Layer 1 of gradsync. Holds the :class:`ProcessGroupCollection`, Megatron's rank layout as pure functions,
a builder that creates the groups, FSDP device-mesh indexing, backend capabilities and the
model-parallel config protocol. The multi-rank test harness lives in :mod:`gradsync.groups.testing`.
"""

from .backend import (
    BackendCapabilities,
    capabilities_of,
    default_backend,
    device_for_group,
    get_backend_capabilities,
)
from .builder import build_process_groups, destroy_process_groups, initialize_model_parallel
from .collection import ProcessGroupCollection
from .fsdp_index import FSDPDistributedIndex
from .layout import (
    DEFAULT_ORDER,
    ParallelLayoutError,
    RankGenerator,
    RankLayout,
    compute_rank_layout,
    default_embedding_ranks,
    default_position_embedding_ranks,
    generate_masked_orthogonal_rank_groups,
    hierarchical_rank_groups,
)
from .model_config import ModelParallelConfig, ModelParallelConfigProtocol
from .teardown import guard_group_teardown, release_at_exit
from .version import __version__

__all__ = [
    "DEFAULT_ORDER",
    "BackendCapabilities",
    "FSDPDistributedIndex",
    "ModelParallelConfig",
    "ModelParallelConfigProtocol",
    "ParallelLayoutError",
    "ProcessGroupCollection",
    "RankGenerator",
    "RankLayout",
    "__version__",
    "build_process_groups",
    "capabilities_of",
    "compute_rank_layout",
    "default_backend",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "destroy_process_groups",
    "device_for_group",
    "generate_masked_orthogonal_rank_groups",
    "get_backend_capabilities",
    "guard_group_teardown",
    "hierarchical_rank_groups",
    "initialize_model_parallel",
    "release_at_exit",
]
