"""`ProcessGroupCollection`: every process group a parallel training step may need, in one object.

It mirrors Megatron-Core's collection at HEAD so that code written against Megatron can swap imports:
keyword-only construction, unknown names rejected, unset declared fields read as None, and a repr that shows
group sizes. Unlike Megatron's `use_mpu_process_groups`, there is no global state to read from: collections
are built by :func:`gradsync.groups.initialize_model_parallel` or assembled by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from torch.distributed import ProcessGroup


@dataclass(init=False, repr=False, eq=True)
class ProcessGroupCollection:
    """Named process groups; each rank stores the one group of each kind that contains it.

    Construction takes keyword arguments only, each a declared field (``ValueError`` otherwise). A field
    never set reads as ``None``; ``name in vars(pgc)`` tells "explicitly set" from "never set". Instances
    are compared field by field and are unhashable, as in the reference.
    """

    tp: ProcessGroup | None = field(init=False)
    """Tensor-parallel group."""
    pp: ProcessGroup | None = field(init=False)
    """Pipeline-parallel group."""
    mp: ProcessGroup | None = field(init=False)
    """Model-parallel group (tp × pp)."""
    embd: ProcessGroup | None = field(init=False)
    """Word-embedding group: the first and last stage of this rank's pipeline (None in middle stages)."""
    pos_embd: ProcessGroup | None = field(init=False)
    """Position-embedding group: the first pipeline stage (None elsewhere)."""
    cp: ProcessGroup | None = field(init=False)
    """Context-parallel group."""
    tp_cp: ProcessGroup | None = field(init=False)
    """Tensor × context-parallel group."""
    hcp: list[ProcessGroup] | None = field(init=False)
    """Hierarchical context-parallel groups, one per level (a list)."""
    ep: ProcessGroup | None = field(init=False)
    """Expert-parallel group."""
    expt_tp: ProcessGroup | None = field(init=False)
    """Expert tensor-parallel group."""
    tp_ep: ProcessGroup | None = field(init=False)
    """Expert tensor × expert-parallel group."""
    tp_ep_pp: ProcessGroup | None = field(init=False)
    """Expert tensor × expert × pipeline-parallel group."""
    tp_ep_pp_with_egtp_remat: ProcessGroup | None = field(init=False)
    """GTP variant of ``tp_ep_pp`` (the same group while GTP is off)."""
    tp_dp_cp: ProcessGroup | None = field(init=False)
    """Tensor × data × context-parallel group: every rank of one pipeline stage."""
    dp: ProcessGroup | None = field(init=False)
    """Data-parallel (replica) group."""
    dp_cp: ProcessGroup | None = field(init=False)
    """Data × context-parallel group: the group dense gradients are reduced over."""
    dp_cp_gtp_remat: ProcessGroup | None = field(init=False)
    """GTP variant of ``dp_cp`` (the same group while GTP is off)."""
    dp_cp_ag: ProcessGroup | None = field(init=False)
    """Optional second communicator over the ``dp_cp`` ranks for param all-gathers."""
    gtp_remat: ProcessGroup | None = field(init=False)
    """GTP weight-rematerialisation group (unused while GTP is off)."""
    expt_gtp_remat: ProcessGroup | None = field(init=False)
    """Expert GTP weight-rematerialisation group (unused while GTP is off)."""
    expt_dp: ProcessGroup | None = field(init=False)
    """Expert data-parallel group: the group expert gradients are reduced over."""
    expt_dp_gtp_remat: ProcessGroup | None = field(init=False)
    """GTP variant of ``expt_dp`` (the same group while GTP is off)."""
    expt_dp_ag: ProcessGroup | None = field(init=False)
    """Optional second communicator over the ``expt_dp`` ranks for param all-gathers."""
    intra_dp_cp: ProcessGroup | None = field(init=False)
    """``dp_cp`` ranks of one distributed-optimizer instance (``dp_cp`` itself with one instance)."""
    intra_expt_dp: ProcessGroup | None = field(init=False)
    """``expt_dp`` ranks of one distributed-optimizer instance (``expt_dp`` itself with one instance)."""
    inter_dist_opt: ProcessGroup | None = field(init=False)
    """Peers of this rank in the other distributed-optimizer instances (None with one instance)."""
    intra_dist_opt: ProcessGroup | None = field(init=False)
    """Every rank of this rank's distributed-optimizer instance (the world with one instance)."""

    def __init__(self, **kwargs: Any) -> None:
        known = self.field_names()
        for name, value in kwargs.items():
            if name not in known:
                raise ValueError(
                    f"Unknown attribute: {name} (ProcessGroupCollection fields are: {', '.join(known)})"
                )
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Runs only when normal lookup fails: a declared field that was never set reads as None.
        if name in type(self).field_names():
            return None
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The declared group names, in declaration order."""
        return tuple(f.name for f in fields(cls))

    def __repr__(self) -> str:
        parts = []
        for name in self.field_names():
            value = vars(self).get(name)
            if value is None:
                continue
            if isinstance(value, list):
                parts.append(f"{name}([{', '.join(str(g.size()) for g in value)}])")
            else:
                parts.append(f"{name}({value.size()})")
        return f"ProcessGroupCollection({', '.join(parts) if parts else 'empty'})"
