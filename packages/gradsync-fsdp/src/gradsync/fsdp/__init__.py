"""gradsync.fsdp (layer 3): MegatronFSDP, sharding strategies and userbuffer / double-buffer allocators.

Skeleton only for now: the package exists so that its tests, type check and layering run from day one.
"""

from .version import __version__

__all__ = ["__version__"]
