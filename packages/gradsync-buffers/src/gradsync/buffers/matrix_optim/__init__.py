"""Matrix optimizers that step gradsync's shards where they lie: Muon (Moonlight's formulation) and
block-diagonal Shampoo.

Each rank updates exactly the part of each param it holds (a DTensor's local tensor, or a plain tensor
taken as the whole param), with no data-parallel communication and no gather (Muon gathers only the
tensor-parallel shards of a TP-split matrix, by default): Muon needs its params whole on one rank,
block Shampoo needs whole tiles, and both refuse, naming the shard-alignment policy that fixes it, a part
that is not.
"""

from .local import ParamOrigin, mark_param_origin
from .muon import EMBEDDING_OR_HEAD_NAMES, NS_COEFFICIENTS, TP_MODES, Muon, muon_param_groups, newton_schulz
from .shampoo import BlockShampoo, inverse_fourth_root

__all__ = [
    "EMBEDDING_OR_HEAD_NAMES",
    "NS_COEFFICIENTS",
    "TP_MODES",
    "BlockShampoo",
    "Muon",
    "ParamOrigin",
    "inverse_fourth_root",
    "mark_param_origin",
    "muon_param_groups",
    "newton_schulz",
]
