"""gradsync.finalize (layer 4): finalize_model_grads across DP, TP/sequence-parallel, PP-tied embeddings and
expert parallel.

Skeleton only for now: the package exists so that its tests, type check and layering run from day one.
"""

from .version import __version__

__all__ = ["__version__"]
