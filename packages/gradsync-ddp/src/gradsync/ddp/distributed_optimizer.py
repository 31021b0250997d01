"""DistributedOptimizer, and its state: sharded, gathered, merged and in DCP's form.

DistributedOptimizer checkpoints: gathered (full tensors by param name) and sharded (this rank's pieces).

Both forms are keyed by param name and full-param positions, not by rank or bucket, so they load at any
DP size: loading slices each rank's new pieces out of the full tensors.

DistributedOptimizer state through ``torch.distributed.checkpoint`` (DCP), resharding across DP sizes.

Every param's state is saved as a flat tensor of the param's numel elements (the distributed optimizer
shards buckets by element, not by row). With the distributed optimizer each rank's piece of it is a
``Shard(0)`` DTensor over the buffer's data-parallel group whose chunk is the piece's true element range
(:func:`gradsync.buffers.checkpointing.describe_chunk`); without it the whole param is a plain tensor,
replicated across DP, which DCP writes once. Either way a checkpoint loads at any DP size, sharded or not.

The state dict's tensors are the optimizer's own (views of the fp32 main params, the state tensors), so
``dcp.load`` fills them in place. Keys are param names, prefixed with the model-parallel position where
values differ between positions: ``tp<r>.pp<r>.`` for dense params, ``ep<r>.etp<r>.pp<r>.`` for experts
(only the dimensions larger than one).

`DistributedOptimizer`: any torch.optim optimizer over fp32 main params, sharded across DP or not.

With ``use_distributed_optimizer`` the grads are reduce-scattered, so each DP rank holds the reduced grad
only for its shard of each bucket. This optimizer keeps fp32 main params for exactly those pieces (so
optimizer state per rank is about 1/DP of the model's), steps them with the wrapped optimizer's class and
hyper-parameters, writes the results into the param buffer, and all-gathers the params (now, or
overlapped with the next forward through the DDP pre-hooks). Without it, the same machinery holds every
param whole: the fp32-main-params recipe for bf16 models that use all-reduce.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from gradsync.buffers import (
    DistributedDataParallelConfig,
    FullParamLayout,
    ParamSpec,
    compute_full_param_layout,
    is_expert_parallel,
)
from gradsync.buffers.checkpointing import describe_chunk, materialize_optimizer_state
from gradsync.buffers.matrix_optim.local import LocalOptimizer
from gradsync.buffers.shard_alignment import shard_alignment_of
from gradsync.groups.objects import all_gather_objects, gather_objects

from .distributed_data_parallel import DistributedDataParallel
from .grad_norm import clip_coefficient, global_grad_norm
from .main_shards import ShardPiece, build_bucket_shards, read_main_params_from_state_dict
from .training_loop import MegatronTrainingLoop

MAIN_PARAM_KEY = "param"


def is_elementwise(value: Any, numel: int) -> bool:
    """A state tensor with one entry per param element (exp_avg), as opposed to a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def refuse_structured_state(opt: DistributedOptimizer) -> None:
    """Checkpoints hold per-element state (shaped like its main param) and scalars; anything else (block
    Shampoo's per-tile statistics, one set per rank's piece) has no place in a per-param entry and would
    be merged wrongly, so it is refused before any collective. Every rank raises alike: the state's
    kinds come from the optimizer's class, the same on every rank."""
    for piece in opt.pieces:
        for key, value in opt.optimizer.state.get(piece.main, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != piece.main.shape:
                raise ValueError(
                    f"DistributedOptimizer checkpoints: {type(opt.optimizer).__name__}'s state {key!r} of "
                    f"{piece.name} has shape {tuple(value.shape)}, neither one value per element of its "
                    f"main param {tuple(piece.main.shape)} nor a scalar; gradsync-ddp cannot reshard it. "
                    "Checkpoint such optimizers under gradsync-fsdp with torch.distributed.checkpoint"
                )


def hyperparams(opt: DistributedOptimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]


def _elementwise_keys(opt: DistributedOptimizer, buffer_key: int, group: dist.ProcessGroup) -> list[str]:
    """The per-element state keys (exp_avg, ...) any rank of ``group`` holds for this buffer; every rank
    must agree on them before the per-key collectives."""
    local = {
        k
        for piece in opt.pieces
        if piece.buffer_key == buffer_key
        for k, v in opt.optimizer.state.get(piece.main, {}).items()
        if is_elementwise(v, piece.main.numel())
    }
    return sorted(set().union(*all_gather_objects(local, group)))


def _value(opt: DistributedOptimizer, piece: Any, key: str) -> torch.Tensor:
    if key == MAIN_PARAM_KEY:
        return piece.main.detach()  # type: ignore[no-any-return]
    return opt.optimizer.state[piece.main][key]  # type: ignore[no-any-return]


def _gather_bucket(
    opt: DistributedOptimizer, buffer_key: int, bucket: int, key: str, saver: int
) -> torch.Tensor | None:
    """This bucket's values of ``key`` on the saving rank (None elsewhere): each rank sends its shard."""
    buffer = opt.buffers[buffer_key]
    group = buffer.data_parallel_group
    start, end = buffer.bucket_indices[bucket]
    size = (end - start) // group.size()
    mine = start + group.rank() * size
    shard = torch.zeros(size, dtype=torch.float32, device=buffer.device)
    for piece in opt.pieces:
        if piece.buffer_key == buffer_key and buffer.param_to_bucket[piece.param].bucket_id == bucket:
            offset = buffer.param_index_map[piece.param][0] + piece.param_range[0] - mine
            shard[offset : offset + piece.main.numel()] = _value(opt, piece, key).reshape(-1)
    receiving = group.rank() == 0
    parts = [torch.empty_like(shard) for _ in range(group.size())] if receiving else None
    dist.gather(shard, parts, dst=saver, group=group)
    return torch.cat(parts) if parts is not None else None


def gather_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """The state of each buffer's params on rank 0 of its group, streamed one bucket at a time, so no
    rank ever holds more than one bucket per key beyond what it saves. Tensors come back on the CPU."""
    refuse_structured_state(opt)
    state: dict[str, dict[str, Any]] = {}
    for key, buffer in enumerate(opt.buffers):
        group = buffer.data_parallel_group
        if opt.sharded:
            saver = dist.get_global_rank(group, 0)
            for name in [MAIN_PARAM_KEY, *_elementwise_keys(opt, key, group)]:
                for bucket in buffer.buckets:
                    flat = _gather_bucket(opt, key, bucket.bucket_id, name, saver)
                    if flat is None:
                        continue
                    for param in bucket.params_list:
                        start, end = bucket.param_to_index[param]
                        entry = state.setdefault(opt.param_names[param], {})
                        entry[name] = flat[start:end].view(param.shape).cpu()
        else:
            for piece in (p for p in opt.pieces if p.buffer_key == key):
                entry = state.setdefault(
                    piece.name, {MAIN_PARAM_KEY: piece.main.detach().view(piece.param.shape).cpu()}
                )
                for name, value in opt.optimizer.state.get(piece.main, {}).items():
                    if is_elementwise(value, piece.main.numel()):
                        entry[name] = value.view(piece.param.shape).cpu()
        scalars = {  # on the CPU before pickling: a CUDA tensor would unpickle onto the sender's device
            piece.name: {
                k: v.cpu() if isinstance(v, torch.Tensor) else v
                for k, v in opt.optimizer.state.get(piece.main, {}).items()
                if not is_elementwise(v, piece.main.numel())
            }
            for piece in opt.pieces
            if piece.buffer_key == key
        }
        parts: list[dict[str, dict[str, Any]]] = [scalars]
        if opt.sharded:
            parts = gather_objects(scalars, dist.get_global_rank(group, 0), group) or []
        for part in parts:
            for param_name, values in part.items():
                state[param_name].update(values)
    return {"format": "gathered", "param_groups": hyperparams(opt), "state": state}


def shard_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """This rank's pieces: for each, the full param's shape, the piece's range and its state."""
    refuse_structured_state(opt)
    pieces = []
    for piece in opt.pieces:
        values = {MAIN_PARAM_KEY: piece.main.detach().clone()}
        values.update(opt.optimizer.state.get(piece.main, {}))
        pieces.append(
            {
                "name": piece.name,
                "shape": tuple(piece.param.shape),
                "range": piece.param_range,
                "state": {
                    k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()
                },
            }
        )
    return {"format": "sharded", "param_groups": hyperparams(opt), "pieces": pieces}


def merge_shards(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Assemble every rank's sharded state dict into the gathered form."""
    state: dict[str, dict[str, Any]] = {}
    covered: dict[str, int] = {}
    for shard in shards:
        if shard.get("format") != "sharded":
            raise ValueError("merge_shards takes the dicts returned by sharded_state_dict()")
        for piece in shard["pieces"]:
            start, end = piece["range"]
            numel = int(torch.Size(piece["shape"]).numel())
            entry = state.setdefault(piece["name"], {})
            covered[piece["name"]] = covered.get(piece["name"], 0) + end - start
            for key, value in piece["state"].items():
                if is_elementwise(value, end - start):
                    full = entry.setdefault(key, torch.zeros(numel, dtype=value.dtype))
                    full[start:end] = value.reshape(-1)  # shaped pieces (shard_alignment) too
                else:
                    entry[key] = value
    for name, entry in state.items():
        shape = next(s["shape"] for shard in shards for s in shard["pieces"] if s["name"] == name)
        if covered[name] != torch.Size(shape).numel():
            raise ValueError(
                f"the shards cover {covered[name]} of {torch.Size(shape).numel()} elements of {name}"
            )
        for key, value in entry.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() == 1
                and value.numel() == torch.Size(shape).numel()
            ):
                entry[key] = value.view(shape)
    return {"format": "gathered", "param_groups": shards[0]["param_groups"], "state": state}


def apply_hyperparams(opt: DistributedOptimizer, saved_groups: Sequence[dict[str, Any]]) -> None:
    """Set every param group's hyper-parameters from a checkpoint's (the groups are index-aligned)."""
    if len(saved_groups) != len(opt.optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} param groups, this optimizer "
            f"{len(opt.optimizer.param_groups)}"
        )
    for group, saved in zip(opt.optimizer.param_groups, saved_groups, strict=True):
        group.update(saved)


def load_state(opt: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
    """Slice this rank's pieces out of a gathered state dict."""
    if state_dict.get("format") != "gathered":
        raise ValueError(
            "load_state_dict takes a gathered state dict; use load_sharded_state_dict for shards"
        )
    apply_hyperparams(opt, state_dict["param_groups"])
    for piece in opt.pieces:
        if piece.name not in state_dict["state"]:
            raise ValueError(f"the checkpoint has no optimizer state for {piece.name}")
        saved = state_dict["state"][piece.name]
        start, end = piece.param_range
        restored: dict[str, Any] = {}
        for key, value in saved.items():
            if is_elementwise(value, piece.param.numel()):
                sliced = value.reshape(-1)[start:end].to(piece.main.device).view(piece.shape)
                if key == MAIN_PARAM_KEY:
                    with torch.no_grad():
                        piece.main.copy_(sliced)
                    continue
                restored[key] = sliced.clone()
            else:
                restored[key] = (
                    value.clone() if isinstance(value, torch.Tensor) else value
                )  # keeps its device
        if restored:
            opt.optimizer.state[piece.main] = restored


def _position(opt: DistributedOptimizer, piece: ShardPiece) -> str:
    """The key prefix naming where this param's values live in the model-parallel layout."""
    pg = opt.model_chunks[0].pg_collection
    axes = (
        (("ep", pg.ep), ("etp", pg.expt_tp), ("pp", pg.pp))
        if is_expert_parallel(piece.param)
        else (("tp", pg.tp), ("pp", pg.pp))
    )
    return "".join(f"{n}{g.rank()}." for n, g in axes if g is not None and g.size() > 1)


def dcp_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """``{"param_groups": [...], "state": {key: {"param": ..., "exp_avg": ..., "step": ...}}}`` for
    ``dcp.save`` / ``dcp.load``, with this rank's pieces (materialising the state if nothing has stepped)."""
    if not opt.optimizer.state:  # nothing stepped yet: give the load tensors to fill
        materialize_optimizer_state(opt.optimizer)
    refuse_structured_state(opt)
    meshes: dict[dist.ProcessGroup, DeviceMesh] = {}
    state: dict[str, dict[str, Any]] = {}
    for piece in opt.pieces:
        values = {MAIN_PARAM_KEY: piece.main.detach(), **opt.optimizer.state.get(piece.main, {})}
        entry: dict[str, Any] = {}
        for key, value in values.items():
            if is_elementwise(value, piece.main.numel()):
                entry[key] = _flat_global(opt, piece, value.view(-1), meshes)
            else:
                entry[key] = value
        state[_position(opt, piece) + piece.name] = entry
    return {"param_groups": hyperparams(opt), "state": state}


def _flat_global(
    opt: DistributedOptimizer,
    piece: ShardPiece,
    local: torch.Tensor,
    meshes: dict[dist.ProcessGroup, DeviceMesh],
) -> torch.Tensor:
    """``local`` (this rank's piece) as part of the flattened param: itself when it is the whole param,
    else a DTensor shard at the piece's offset."""
    if not opt.sharded:
        return local
    if piece.group not in meshes:
        meshes[piece.group] = DeviceMesh.from_group(piece.group, local.device.type)
    numel = piece.param.numel()
    global_tensor = DTensor.from_local(
        local, meshes[piece.group], [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
    )
    return describe_chunk(global_tensor, [piece.param_range[0]])


def load_dcp_state(opt: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
    """Adopt a state dict that ``dcp.load`` filled (one built by :func:`dcp_state`): hyper-parameters,
    the state's non-tensor values, and any tensor that is not already the optimizer's own."""
    apply_hyperparams(opt, state_dict["param_groups"])
    for piece in opt.pieces:
        key = _position(opt, piece) + piece.name
        if key not in state_dict["state"]:
            raise ValueError(
                f"load_dcp_state_dict: no optimizer state for {key!r}; pass the dict dcp_state_dict() "
                "returned, after dcp.load filled it"
            )
        current = opt.optimizer.state.setdefault(piece.main, {})
        for name, value in state_dict["state"][key].items():
            local = value.to_local() if isinstance(value, DTensor) else value
            target = piece.main.detach() if name == MAIN_PARAM_KEY else current.get(name)
            if isinstance(target, torch.Tensor) and isinstance(local, torch.Tensor):
                if local.data_ptr() != target.data_ptr():
                    with torch.no_grad():
                        target.copy_(local.view_as(target))
            else:
                current[name] = value


def _same_kind(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class over ``groups`` (which carry every hyper-parameter).

    ``defaults`` can hold keys the constructor does not take (AdamW's ``decoupled_weight_decay``), so
    only the accepted ones are passed; the groups' own values win either way. A constructor argument kept
    as an attribute instead (Muon's ``tp_group``, a process group no state dict should hold) is passed on.
    """
    accepted = inspect.signature(type(optimizer)).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    kwargs |= {
        k: getattr(optimizer, k)
        for k in accepted
        if k not in kwargs and k != "params" and hasattr(optimizer, k)
    }
    return type(optimizer)(groups, **kwargs)


def _refuse_policies_it_cannot_step(optimizer: LocalOptimizer) -> None:
    """A matrix optimizer (gradsync-buffers' Muon, BlockShampoo) checks every model param's
    shard-alignment policy before any piece is built: every rank holds every model param, so every rank
    refuses alike (a rank holding no piece of a cut matrix would otherwise go on into the gather)."""
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.check_policy(index, param, shard_alignment_of(param), group)
            index += 1


class DistributedOptimizer(MegatronTrainingLoop, torch.optim.Optimizer):  # type: ignore[misc]
    """Mixed-precision optimizer over DDP-wrapped models: fp32 main params, sharded or not.

    With ``use_distributed_optimizer=True`` it holds (and steps) only this rank's shard of every bucket,
    as Megatron's DistributedOptimizer; with sharding off it holds every param whole, which is Megatron's
    ``Float16OptimizerWithFloat16Params`` recipe for bf16 models: fp32 main params and fp32 steps, the
    result cast into the model's weights.

    Pass a freshly built optimizer over the model's params: its class, defaults and per-group
    hyper-parameters are reused for an optimizer over the fp32 main params, and it is never stepped itself.
    This object is a ``torch.optim.Optimizer`` whose ``param_groups`` and ``state`` are that inner
    optimizer's own, so LR schedulers and ``param_groups`` edits act on what is stepped.

    ``config`` (optional) is an OptimizerConfig-shaped object, Megatron's own included: ``step()`` then
    clips with its ``clip_grad``, counts zeros with ``log_num_zeros_in_grad`` and scales the loss as its
    ``loss_scale`` / ``fp16`` ask (see :mod:`gradsync.ddp.training_loop`). ``step()`` returns Megatron's
    ``(update_successful, grad_norm, num_zeros_in_grad)`` either way.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: DistributedDataParallel | Sequence[DistributedDataParallel],
        config: Any = None,
    ) -> None:
        self.model_chunks = [model] if isinstance(model, DistributedDataParallel) else list(model)
        sharding = {chunk.ddp_config.use_distributed_optimizer for chunk in self.model_chunks}
        if len(sharding) != 1:
            raise ValueError(
                "DistributedOptimizer: every model chunk must have the same use_distributed_optimizer"
            )
        self.sharded = sharding.pop()
        """True: this rank's shard of every bucket (reduce-scattered grads); False: every param whole."""
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.buffers = [b for chunk in self.model_chunks for b in chunk.grad_buffers.all_buffers]
        self.param_names: dict[nn.Parameter, str] = {}
        for index, chunk in enumerate(self.model_chunks):
            prefix = f"chunk{index}." if len(self.model_chunks) > 1 else ""
            self.param_names.update({p: prefix + n for p, n in chunk.param_to_name.items()})
        missing = [self.param_names[p] for p in self.param_names if p not in group_of]
        if missing:
            raise ValueError(f"the optimizer does not hold these trainable params: {sorted(missing)}")

        if self.sharded and isinstance(optimizer, LocalOptimizer):
            _refuse_policies_it_cannot_step(optimizer)
        self.shards = build_bucket_shards(self.buffers, self.sharded, self.param_names)
        self.pieces: list[ShardPiece] = [piece for shard in self.shards for piece in shard.pieces]
        pieces_by_group: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
        for piece in self.pieces:
            pieces_by_group[group_of[piece.param]].append(piece.main)
        # Groups stay index-aligned with the given optimizer's, even where this rank owns nothing of one.
        new_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": mains}
            for g, mains in zip(optimizer.param_groups, pieces_by_group, strict=True)
        ]
        self.optimizer = _same_kind(optimizer, new_groups)
        # torch.optim.Optimizer's own set-up (step hooks, profiling), then share the inner optimizer's
        # groups and state, so that what schedulers and users edit is what gets stepped.
        super().__init__([{"params": []}], dict(optimizer.defaults))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        pg = self.model_chunks[0].pg_collection
        self.norm_group = pg.intra_dist_opt or dist.group.WORLD
        self.tp_group = pg.tp
        self.pp_group = pg.pp
        self._grads_loaded = False  # main grads read from the grad buffers for the current step
        self._device = self.buffers[0].grad_data.device if self.buffers else torch.device("cpu")
        self._norm_grads = [
            p.main.grad
            for p in self.pieces
            if p.main.grad is not None and p.main.numel() and self._counted_in_norm(p)
        ]
        self._model_versions = self._current_model_versions()
        self._init_training_loop(config)
        self._built = True

    @staticmethod
    def compute_full_param_layout(
        params: Sequence[torch.Tensor],
        bucket_size: int | None,
        data_parallel_world_size: int,
        ddp_config: DistributedDataParallelConfig,
        expert_data_parallel_world_size: int | None = None,
    ) -> FullParamLayout[torch.Tensor]:
        """The padded layout of every buffer DistributedDataParallel will build for ``params`` (its
        trainable params in ``named_parameters()`` order), for its ``full_param_layout`` argument; expert
        buffers pad for the expert DP size. Each buffer's ``param_index_map`` is keyed by the param, as
        the reference's is."""
        return compute_full_param_layout(
            [ParamSpec.of(p) for p in params],
            bucket_size,
            grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32,
            padded=True,
            data_parallel_world_size=data_parallel_world_size,
            expert_data_parallel_world_size=expert_data_parallel_world_size,
            pad_for_high_nccl_busbw=ddp_config.pad_buckets_for_high_nccl_busbw,
        ).keyed_by(params)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise NotImplementedError(
                "DistributedOptimizer builds its param groups from the wrapped optimizer's: add the group "
                "to that optimizer before wrapping it"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's main grads: the next clip or step reads them again from the grad buffers.
        The main params keep their grads attached (views into one fp32 tensor per bucket), so that
        reading them costs one copy per bucket; ``zero_grad_buffer()`` on each chunk empties the grad
        buffers, called alongside this at the start of every iteration, as in the reference."""
        self._grads_loaded = False

    # --- model weights ---------------------------------------------------------------------------

    def _current_model_versions(self) -> list[int]:
        return [chunk.model_params_version for chunk in self.model_chunks]

    def reload_model_params(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Copy the model's current weights into the fp32 main params (after ``model.load_state_dict``
        or any other change of the weights made after this optimizer was built).

        With ``state_dict`` (a model state dict keyed by param name, as Megatron's argument), the main
        params are read from its tensors instead, so fp32 checkpoint values survive bf16 weights; the
        model's weights are then written from them."""
        with torch.no_grad():
            for shard in self.shards:
                shard.read_weights()
            if state_dict is not None:
                read_main_params_from_state_dict(self.pieces, state_dict)
                self._write_shards_into_params()
                self._gather_params()
        self._model_versions = self._current_model_versions()

    def _refuse_stale_main_params(self) -> None:
        if self._current_model_versions() != self._model_versions:
            raise RuntimeError(
                "DistributedOptimizer: weights were loaded into the model (load_state_dict) after this "
                "optimizer copied them into its fp32 main params; stepping would write the old weights "
                "back. Call optimizer.reload_model_params() to adopt the loaded weights, or load the "
                "optimizer's own checkpoint (load_state_dict) after the model's."
            )

    def _write_shards_into_params(self) -> None:
        with torch.no_grad():
            for shard in self.shards:
                shard.write_weights()

    def _gather_params(self) -> None:
        """Refill every rank's full params from the owners' shards (sharded mode only)."""
        if not self.sharded:
            return  # every rank stepped every param with the same all-reduced grads
        for chunk in self.model_chunks:
            if not chunk.ddp_config.overlap_param_gather or chunk.ddp_config.align_param_gather:
                chunk.start_param_sync()  # sync, or dispatched now for all groups with align_param_gather
            # otherwise the forward pre-hooks gather group by group, overlapped with the next forward

    # --- gradients -------------------------------------------------------------------------------

    def _counted_in_norm(self, piece: ShardPiece) -> bool:
        """Count every grad element once across the norm group, as Megatron does.

        Unsharded, every DP replica holds every grad: only DP rank 0 of the param's group counts it.
        Params replicated across TP ranks count on TP rank 0; a param marked ``shared`` (Megatron's
        marker for the last stage's copy of the tied embedding) does not count, and neither does a
        ``shared_embedding`` param outside pipeline stage 0, so the tied embedding counts once.
        """
        if not self.sharded and piece.group.rank() != 0:
            return False
        param = piece.param
        if getattr(param, "shared", False):
            return False
        pp = self.pp_group
        if getattr(param, "shared_embedding", False) and pp is not None and pp.rank() != 0:
            return False
        tp = self.tp_group
        return tp is None or tp.rank() == 0 or bool(getattr(param, "tensor_model_parallel", False))

    def _ensure_grads_loaded(self) -> None:
        """Read this step's reduced grads once (clipping and stepping share them)."""
        if self._grads_loaded:
            return
        for chunk in self.model_chunks:
            chunk.refuse_unsynced_step()
        for shard in self.shards:
            shard.load_grads()
        self._grads_loaded = True

    def _total_norm(self, norm_type: float) -> float:
        """The global grad norm, in Megatron's order (``get_grad_norm_fp32``): this rank's
        ``norm ** norm_type`` in fp32, summed over the norm group by one all-reduce, read back once and
        rooted in Python double (the max for the inf-norm)."""
        self._ensure_grads_loaded()
        return global_grad_norm(self._norm_grads, norm_type, self.norm_group, self._device)

    def get_grad_norm(self, norm_type: float = 2.0) -> float:
        """The global grad norm over every owned main grad, across DP and the model-parallel groups."""
        return self._total_norm(norm_type)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale main grads so the global norm is at most ``max_norm``; returns the norm before.

        The coefficient is Megatron's: ``max_norm / (norm + 1e-6)`` in Python double, applied only when
        below 1. ``max_norm <= 0`` turns clipping off (Megatron's ``clip_grad=0``): only the norm is
        computed.
        """
        total = self._total_norm(norm_type)
        if max_norm > 0:
            coefficient = clip_coefficient(max_norm, total)
            if coefficient < 1.0:
                for shard in self.shards:
                    shard.grad.mul_(coefficient)
        return total

    def _main_grads(self) -> list[torch.Tensor]:
        return [shard.grad for shard in self.shards]

    def _counted_grads(self) -> list[torch.Tensor]:
        return self._norm_grads

    def step_with_ready_grads(self) -> bool:
        """Step the main params on the grads read, write them into the model's weights and gather the
        params (the last part of :meth:`step`, Megatron's name). Returns True."""
        self._refuse_stale_main_params()
        self._ensure_grads_loaded()
        self.optimizer.step()
        self._grads_loaded = False  # the next step reads fresh grads, even without zero_grad()
        self._write_shards_into_params()
        self._gather_params()
        return True

    # --- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state keyed by param name, as CPU tensors, loadable at any DP size.

        A collective: call it on every rank. Each buffer's state is gathered, one bucket at a time, to
        rank 0 of that buffer's data-parallel group; other ranks get none of it. So with dense params
        only, DP rank 0 of each (TP, PP) position saves the file; expert params' state lands on rank 0
        of each expert-data-parallel group, which saves its own part too. Without sharding every rank
        holds everything and no communication happens.
        """
        state = gather_state(self)
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def sharded_state_dict(
        self, model_sharded_state_dict: Any = None, is_loading: bool = False, metadata: Any = None
    ) -> dict[str, Any]:
        """This rank's pieces only (no communication); save one file per rank and load them with
        :meth:`load_sharded_state_dict`. Megatron's arguments are accepted for its call shape and not
        used: gradsync's pieces are keyed by param name, not by the model's sharded tensors (for
        ``torch.distributed.checkpoint`` use :meth:`dcp_state_dict`)."""
        return shard_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a gathered state dict (from any DP size) on every rank; the loaded main params become the
        model's weights (on every rank, gathered now in sharded mode)."""
        scaler_state = state_dict.get("grad_scaler")
        if scaler_state is not None and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(scaler_state)
        load_state(self, {k: v for k, v in state_dict.items() if k != "grad_scaler"})
        self._adopt_loaded_main_params()

    def dcp_state_dict(self) -> dict[str, Any]:
        """This rank's state for ``torch.distributed.checkpoint``: flat per-param tensors, DTensor shards
        with their true offsets with the distributed optimizer, so ``dcp.save`` / ``dcp.load`` reshard
        across DP sizes (and between sharded and unsharded). The tensors are the optimizer's own, and
        its state is materialised first if nothing has stepped, so ``dcp.load`` fills it in place; then
        call :meth:`load_dcp_state_dict` with the same dict. No communication."""
        return dcp_state(self)

    def load_dcp_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Finish a ``dcp.load`` into :meth:`dcp_state_dict`'s dict: hyper-parameters and non-tensor
        state adopted, the loaded main params written into the model's weights (gathered now in sharded
        mode)."""
        load_dcp_state(self, state_dict)
        self._adopt_loaded_main_params()

    def _adopt_loaded_main_params(self) -> None:
        self._write_shards_into_params()
        self._model_versions = self._current_model_versions()
        if not self.sharded:
            return
        for chunk in self.model_chunks:
            for group in chunk.grad_buffers.all_bucket_groups:
                if group.param_gather_handle is not None:
                    group.start_param_sync(force_sync=True)  # drain a gather still in flight
                group.start_param_sync(force_sync=True)  # gather the loaded values now

    def load_sharded_state_dict(self, shards: Sequence[dict[str, Any]]) -> None:
        """Load the sharded state dicts of every rank of the run that saved them (any DP size)."""
        self.load_state_dict(merge_shards(shards))
