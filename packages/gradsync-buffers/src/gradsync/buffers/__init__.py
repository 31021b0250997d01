"""gradsync.buffers (layer 2): DistributedDataParallelConfig, flat param/grad buffers, bucketing and bucket-
group collectives.

Skeleton only for now: the package exists so that its tests, type check and layering run from day one.
"""

from .version import __version__

__all__ = ["__version__"]
