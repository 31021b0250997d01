"""torch's meta-device flow and load pre-hooks through gradsync's ``fully_shard``.

Meta init as torchtitan does it: build under ``torch.device("meta")``, ``fully_shard`` each block and the
root, ``to_empty()``, then the model's own ``init_weights()`` on the DTensor params. With torch's own
``Shard(0)`` shards (``shard_alignment="chunk"``) the weights and the first loss equal torch FSDP2's from
the same seed (on the CPU each rank draws its shard from its own generator, so the shard shapes decide the
values); an init that does not depend on the shards trains like one process on every strategy, HSDP and
bf16 included.

A fused weight saved split into pieces (a state-dict post-hook) and merged back by a load pre-hook
(torchtitan's fused QKV) loads into the shards from a sharded and from a whole state dict, at a world where
some ranks own none of the fused rows, and the split itself (``chunk`` on the uneven DTensor) cuts the true
rows.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_testkit import max_relative_difference
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.fsdp import MegatronFSDP, uneven_dtensor_to_full_tensor
from gradsync.fsdp.fsdp2 import MixedPrecisionPolicy, fully_shard, megatron_fsdp_of
from gradsync.fsdp.torch_internals import SUBCLASS_DISPATCH
from gradsync.groups import FSDPDistributedIndex
from gradsync.groups.testing import run_distributed, test_device

GRADSYNC, TORCH = "gradsync.fsdp.fsdp2", "torch.distributed.fsdp"
VOCAB, DIM, HEADS = 19, 8, 2
TORCH_FSDP2_RUNS = test_device().type != "cpu" or hasattr(torch.cpu.Stream(), "record_event")
needs_torch_fsdp2 = pytest.mark.skipif(
    not TORCH_FSDP2_RUNS, reason="torch's own fully_shard does not run on this torch's CPU (2.6)"
)


class Attention(nn.Module):
    """A fused QKV projection saved as three keys, as torchtitan's checkpoints keep them."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM * 6)  # large enough that some ranks own no wqkv rows at 4 ranks
        self.register_state_dict_post_hook(Attention.split_qkv)
        self.register_load_state_dict_pre_hook(Attention.merge_qkv)

    @staticmethod
    def split_qkv(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        fused = state.pop(prefix + "wqkv.weight")
        for name, piece in zip("qkv", fused.chunk(3), strict=True):
            state[f"{prefix}w{name}"] = piece

    @staticmethod
    def merge_qkv(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        if prefix + "wq" in state:
            state[prefix + "wqkv.weight"] = torch.cat([state.pop(f"{prefix}w{name}") for name in "qkv"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).view(*x.shape[:2], 3, HEADS, DIM // HEADS).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(x.shape)).view(*x.shape, 6).mean(-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.attn = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class Model(nn.Module):
    """Embedding, two blocks, norm, head, and a non-persistent buffer the init computes (torchtitan's
    ``freqs_cis``). ``rank_independent``: every value is a function of the param's index, not drawn."""

    def __init__(self, rank_independent: bool = False) -> None:
        super().__init__()
        self.rank_independent = rank_independent
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("scale", torch.empty(DIM), persistent=False)

    def init_weights(self) -> None:
        with torch.no_grad():
            self.scale.copy_(torch.linspace(0.5, 1.5, DIM, device=self.scale.device))
            for index, (name, param) in enumerate(self.named_parameters()):
                if "norm" in name:
                    nn.init.ones_(param)
                elif self.rank_independent:
                    nn.init.constant_(param, 0.02 * (index % 7) - 0.05)
                elif name.endswith("bias"):
                    nn.init.zeros_(param)
                else:
                    nn.init.trunc_normal_(param, std=0.2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) * self.scale
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 6), generator=generator).to(test_device())


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (uneven_dtensor_to_full_tensor(p) if isinstance(p, DTensor) else p.detach()).float().cpu()
        for name, p in model.named_parameters()
    }


def meta_built(
    api: str, mesh: DeviceMesh, model: Model, reshard: bool, to_empty: bool = True, **kwargs: Any
) -> Model:
    """torchtitan's parallelize on a meta model, then ``to_empty`` and the init on the DTensors (gradsync's
    params have their storage already, so its init may come without ``to_empty``)."""
    shard = importlib.import_module(api).fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh, reshard_after_forward=reshard, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    if to_empty:
        model.to_empty(device=test_device())
    torch.manual_seed(7)
    model.init_weights()
    return model


def meta_init_by(api: str, param_dtype: torch.dtype | None) -> dict[str, Any]:
    mesh = init_device_mesh(test_device().type, (dist.get_world_size(),))
    with torch.device("meta"):
        model = Model()
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype)} if param_dtype else {}
    chunk = {"shard_alignment": "chunk"} if api == GRADSYNC else {}
    meta_built(api, mesh, model, True, **policy, **chunk)
    facts: dict[str, Any] = {"weights": whole(model), "buffer": model.scale.cpu()}
    facts["loss"] = model(batch(0, dist.get_rank())).detach().cpu()
    return facts


@needs_torch_fsdp2
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_meta_init_gives_torch_fsdp2s_weights_and_loss(param_dtype: torch.dtype | None) -> None:
    ours = run_distributed(meta_init_by, 2, args=(GRADSYNC, param_dtype))
    theirs = run_distributed(meta_init_by, 2, args=(TORCH, param_dtype))
    for mine, torch_s in zip(ours, theirs, strict=True):
        assert mine["weights"].keys() == torch_s["weights"].keys()
        for name, value in mine["weights"].items():
            assert torch.equal(value, torch_s["weights"][name]), name
        assert torch.equal(mine["buffer"], torch_s["buffer"])
        assert torch.equal(mine["loss"], torch_s["loss"])
    # the draws differ per shard (each rank's own generator): the ranks' shards are not copies
    embedding = ours[0]["weights"]["embedding.weight"]
    assert not torch.equal(embedding[: VOCAB // 2], embedding[VOCAB // 2 : 2 * (VOCAB // 2)])


def trained(
    shape: tuple[int, ...], reshard: bool, param_dtype: torch.dtype | None, to_empty: bool = True
) -> dict[str, torch.Tensor]:
    """Three steps from a meta init on ``shape`` (HSDP when 2-D), or, without a group, in one process."""
    ranks = range(dist.get_world_size()) if dist.is_initialized() else range(math.prod(shape))
    if dist.is_initialized():
        names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
        mesh = init_device_mesh(test_device().type, shape, mesh_dim_names=names)
        with torch.device("meta"):
            model = Model(rank_independent=True)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype) if param_dtype else MixedPrecisionPolicy()
        meta_built(GRADSYNC, mesh, model, reshard, to_empty, mp_policy=policy)
        assert megatron_fsdp_of(model).data_parallel_sharding_strategy == (
            "optim_grads_params" if reshard else "optim_grads"
        )
        local = [batch(step, dist.get_rank()) for step in range(3)]
    else:  # bf16: torch's recipe in one process, fp32 main weights stepped with the bf16 grads
        model = Model(rank_independent=True).to(test_device())
        model.init_weights()
        local = [torch.cat([batch(step, rank) for rank in ranks]) for step in range(3)]
        mains = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        model.to(param_dtype or torch.float32)
    params = list(model.parameters()) if dist.is_initialized() else mains
    optimizer = torch.optim.SGD(params, lr=0.2, momentum=0.9)
    for tokens in local:
        model(tokens).backward()
        if not dist.is_initialized():
            for main, param in zip(mains, model.parameters(), strict=True):
                assert param.grad is not None
                main.grad, param.grad = param.grad.float(), None
        optimizer.step()
        optimizer.zero_grad()
        if not dist.is_initialized():
            with torch.no_grad():
                for main, param in zip(mains, model.parameters(), strict=True):
                    param.copy_(main)
    return (
        whole(model)
        if dist.is_initialized()
        else {n: m.detach().cpu() for (n, _), m in zip(model.named_parameters(), mains, strict=True)}
    )


@pytest.mark.parametrize(
    ("shape", "reshard", "param_dtype", "to_empty"),
    [
        ((2,), True, None, True),
        ((2,), False, None, True),
        ((2,), False, None, False),
        ((2, 2), True, None, True),
        ((2,), True, torch.bfloat16, True),
    ],
    ids=["zero3", "zero2", "zero2-without-to_empty", "hsdp-2x2", "zero3-bf16"],
)
def test_meta_init_trains_like_one_process(
    shape: tuple[int, ...], reshard: bool, param_dtype: torch.dtype | None, to_empty: bool
) -> None:
    reference = trained(shape, reshard, param_dtype)
    # bf16: against the same recipe in one process (torch 2.6's bf16 CPU kernels land 7.5e-2 from fp32)
    bound = 1e-6 if param_dtype is None else 2e-3
    for weights in run_distributed(trained, math.prod(shape), args=(shape, reshard, param_dtype, to_empty)):
        print("DIFF", max_relative_difference(weights, reference))
        assert max_relative_difference(weights, reference) <= bound


def seeded(seed: int) -> Model:
    torch.manual_seed(seed)
    model = Model().to(test_device())
    model.init_weights()
    return model


def blocks_then_root(model: Model) -> Model:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def fused_round_trip() -> dict[str, float]:
    """Save and load a model whose load pre-hook merges the split QKV keys, at 4 ranks (where some ranks
    own no rows of a fused weight): a sharded state dict from gradsync itself, a whole one from an
    unsharded model; each loaded into a differently seeded model, through ``fully_shard``'s root and
    through MegatronFSDP's own ``load_state_dict``, and compared with the saved one."""
    original = seeded(0)
    expected = {name: p.detach().cpu() for name, p in original.named_parameters()}
    tokens = batch(0, 0)
    want = original(tokens).detach()
    source = blocks_then_root(seeded(0))
    fused = source.blocks[0].attn.wqkv.weight
    facts = {"empty fused shards": float(sum(1 for r in range(4) if _owned_rows(fused, r) == 0))}
    states = {"whole": original.state_dict()}
    if SUBCLASS_DISPATCH:  # torch 2.11 splits an uneven shard as even chunks: a documented limit
        states["sharded"] = source.state_dict()
        pieces = zip("qkv", expected["blocks.0.attn.wqkv.weight"].chunk(3), strict=True)
        facts["split pieces"] = max(
            (uneven_dtensor_to_full_tensor(states["sharded"][f"blocks.0.attn.w{n}"]).cpu() - piece)
            .abs()
            .max()
            .item()
            for n, piece in pieces
        )
    for label, state in states.items():
        target = blocks_then_root(seeded(1))
        result = target.load_state_dict(state)
        assert not result.missing_keys, result
        assert not result.unexpected_keys, result
        got = whole(target)
        facts[f"{label} weights"] = max((got[k] - v).abs().max().item() for k, v in expected.items())
        facts[f"{label} loss"] = (target(tokens).detach() - want).abs().item()
        config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"
        )
        index = FSDPDistributedIndex.from_sizes(dist.get_world_size(), device_type=test_device().type)
        megatron = MegatronFSDP(seeded(1), index, config, fsdp_unit_modules=[Block])
        megatron.load_state_dict({f"module.{key}": value for key, value in state.items()})
        facts[f"{label} loss, MegatronFSDP"] = (megatron(tokens).detach() - want).abs().item()
    return facts


def _owned_rows(param: DTensor, rank: int) -> int:
    sizes = [torch.zeros((), dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor(param.to_local().shape[0]))
    return int(sizes[rank])


def test_a_load_pre_hook_merging_split_keys_loads_into_the_shards() -> None:
    for facts in run_distributed(fused_round_trip, 4):
        assert facts["empty fused shards"] >= 1, "the layout no longer leaves a rank without fused rows"
        assert facts["whole weights"] == 0.0
        assert facts["whole loss"] == 0.0
        assert facts["whole loss, MegatronFSDP"] == 0.0
        if SUBCLASS_DISPATCH:
            assert facts == {
                **facts,
                "split pieces": 0.0,
                "sharded weights": 0.0,
                "sharded loss": 0.0,
                "sharded loss, MegatronFSDP": 0.0,
            }
