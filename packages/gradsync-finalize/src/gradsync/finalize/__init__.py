"""gradsync.finalize (layer 4): finalize_model_grads across DP, TP/sequence-parallel, PP-tied embeddings and
expert parallel.

It works on any data-parallel wrapper that meets the Protocols in :mod:`.protocol`; it imports neither
gradsync-ddp nor gradsync-fsdp.
"""

from .finalize import finalize_model_grads, get_model_config
from .protocol import EmbeddingOwner, FinalizableChunk, GradSyncConfig
from .reductions import reset_model_temporary_tensors
from .version import __version__

__all__ = [
    "EmbeddingOwner",
    "FinalizableChunk",
    "GradSyncConfig",
    "__version__",
    "finalize_model_grads",
    "get_model_config",
    "reset_model_temporary_tensors",
]
