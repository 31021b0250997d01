"""`DistributedOptimizer`: any torch.optim optimizer, stepping only this rank's shard of every bucket.

With ``use_distributed_optimizer`` the grads are reduce-scattered, so each DP rank holds the reduced grad
only for its shard of each bucket. This optimizer keeps fp32 main params for exactly those pieces (so
optimizer state per rank is about 1/DP of the model's), steps them with the wrapped optimizer's class and
hyper-parameters, writes the results into the param buffer, and all-gathers the params (now, or
overlapped with the next forward through the DDP pre-hooks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .distributed_data_parallel import DistributedDataParallel
from .optimizer_state import gather_state, load_state, merge_shards, shard_state


@dataclass
class ShardPiece:
    """One param's slice owned by this rank, and the fp32 main param that stands for it."""

    name: str
    param: nn.Parameter
    main: nn.Parameter
    param_range: tuple[int, int]
    buffer_key: int
    group: dist.ProcessGroup

    def model_slice(self) -> torch.Tensor:
        return self.param.data.view(-1)[self.param_range[0] : self.param_range[1]]

    def grad_slice(self) -> torch.Tensor:
        main_grad: torch.Tensor = self.param.main_grad  # type: ignore[attr-defined]
        return main_grad.view(-1)[self.param_range[0] : self.param_range[1]]


def _same_kind(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``groups`` (which carry every hyper-parameter).

    ``defaults`` can hold keys the constructor does not take (AdamW's ``decoupled_weight_decay``), so
    only the accepted ones are passed; the groups' own values win either way.
    """
    accepted = inspect.signature(type(optimizer)).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


class DistributedOptimizer:
    """Shard-local optimizer over models wrapped with ``use_distributed_optimizer=True``.

    Pass a freshly built optimizer over the model's params: its class, defaults and per-group
    hyper-parameters are reused for an optimizer over this rank's fp32 shard pieces, and it is never
    stepped itself.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: DistributedDataParallel | Sequence[DistributedDataParallel],
    ) -> None:
        self.model_chunks = [model] if isinstance(model, DistributedDataParallel) else list(model)
        for chunk in self.model_chunks:
            if not chunk.ddp_config.use_distributed_optimizer:
                raise ValueError(
                    "DistributedOptimizer needs models wrapped with use_distributed_optimizer=True; use a "
                    "plain torch.optim optimizer otherwise"
                )
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.buffers = [b for chunk in self.model_chunks for b in chunk.grad_buffers.all_buffers]
        self.param_names: dict[nn.Parameter, str] = {}
        for index, chunk in enumerate(self.model_chunks):
            prefix = f"chunk{index}." if len(self.model_chunks) > 1 else ""
            self.param_names.update({p: prefix + n for p, n in chunk.param_to_name.items()})
        missing = [self.param_names[p] for p in self.param_names if p not in group_of]
        if missing:
            raise ValueError(f"the optimizer does not hold these trainable params: {sorted(missing)}")

        self.pieces: list[ShardPiece] = []
        pieces_by_group: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
        for key, buffer in enumerate(self.buffers):
            group = buffer.data_parallel_group
            for bucket in range(len(buffer.buckets)):
                for owned in buffer.layout.shard_param_ranges(bucket, group.rank(), group.size()):
                    param = buffer.params[owned.param_index]
                    start, end = owned.param_range
                    main = nn.Parameter(param.detach().view(-1)[start:end].clone().float())
                    self.pieces.append(
                        ShardPiece(self.param_names[param], param, main, (start, end), key, group)
                    )
                    pieces_by_group[group_of[param]].append(main)
        # Groups stay index-aligned with the given optimizer's, even where this rank owns nothing of one.
        new_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": mains}
            for g, mains in zip(optimizer.param_groups, pieces_by_group, strict=True)
        ]
        self.optimizer = _same_kind(optimizer, new_groups)
        pg = self.model_chunks[0].pg_collection
        self.norm_group = pg.intra_dist_opt or dist.group.WORLD
        self._grads_loaded = False  # shard grads read from main_grad for the current step
        self.tp_group = pg.tp

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The shard optimizer's param groups (for learning-rate schedulers)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shard grads. The grad buffers are the model's: ``zero_grad_buffer()`` on each chunk
        empties them, called alongside this at the start of every iteration, as in the reference."""
        for piece in self.pieces:
            piece.main.grad = None
        self._grads_loaded = False

    def _counted_in_norm(self, piece: ShardPiece) -> bool:
        """Params replicated across TP ranks are counted once (on TP rank 0)."""
        tp = self.tp_group
        if tp is None or tp.size() == 1:
            return True
        return bool(getattr(piece.param, "tensor_model_parallel", False)) or tp.rank() == 0

    def _ensure_grads_loaded(self) -> None:
        """Read this step's reduced grads once (clipping and stepping share them)."""
        if self._grads_loaded:
            return
        for piece in self.pieces:
            piece.main.grad = piece.grad_slice().float()
        self._grads_loaded = True

    def _write_shards_into_params(self) -> None:
        with torch.no_grad():
            for piece in self.pieces:
                piece.model_slice().copy_(piece.main)

    def get_grad_norm(self, norm_type: float = 2.0) -> float:
        """The global grad norm over every owned shard, across DP and the model-parallel groups."""
        grads = [p.main.grad for p in self.pieces if p.main.grad is not None and self._counted_in_norm(p)]
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
            total = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.norm_group)
            return float(total.item())
        local_sum = sum((float(g.double().norm(norm_type) ** norm_type) for g in grads), 0.0)
        total = torch.tensor([local_sum], dtype=torch.float64)
        dist.all_reduce(total, group=self.norm_group)
        return float(total.item() ** (1.0 / norm_type))

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale shard grads so the global norm is at most ``max_norm``; returns the norm before."""
        self._ensure_grads_loaded()
        total = self.get_grad_norm(norm_type)
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1.0:
            for piece in self.pieces:
                if piece.main.grad is not None:
                    piece.main.grad = piece.main.grad * coefficient
        return total

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Step the owned shards, write them into the param buffers, and gather the params."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        self._ensure_grads_loaded()
        self.optimizer.step()
        self._grads_loaded = False  # the next step reads fresh grads, even without zero_grad()
        self._write_shards_into_params()
        for chunk in self.model_chunks:
            if not chunk.ddp_config.overlap_param_gather or chunk.ddp_config.align_param_gather:
                chunk.start_param_sync()  # sync, or dispatched now for all groups with align_param_gather
            # otherwise the forward pre-hooks gather group by group, overlapped with the next forward

    # --- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state keyed by param name (a collective: call it on every rank; save the
        result on rank 0). Loads at any DP size."""
        return gather_state(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's pieces only (no communication); save one file per rank."""
        return shard_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a gathered state dict (from any DP size) on every rank, then gather the params."""
        load_state(self, state_dict)
        self._write_shards_into_params()
        for chunk in self.model_chunks:
            for group in chunk.grad_buffers.all_bucket_groups:
                if group.param_gather_handle is not None:
                    group.start_param_sync(force_sync=True)  # drain a gather still in flight
                group.start_param_sync(force_sync=True)  # gather the loaded values now

    def load_sharded_state_dict(self, shards: Sequence[dict[str, Any]]) -> None:
        """Load the sharded state dicts of every rank of the run that saved them (any DP size)."""
        self.load_state_dict(merge_shards(shards))
