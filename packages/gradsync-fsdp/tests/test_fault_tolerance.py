"""MegatronFSDP under torchft: two replica groups of two ranks, each sharding the model (ZeRO-3 or ZeRO-1),
with torchft's manager as the outer replication. A group killed whole mid-backward (SIGKILL) restarts and
heals, each rank its own shard, while the other waits (a quorum needs two); at the end both hold
bit-identical weights and optimizer shards, and the weights equal one process that replays the committed
steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is an optional extra (torch >= 2.7)")

import ft_fsdp_replica  # (after the skip: it imports torchft)

from gradsync.groups.testing.replica_groups import ReplicaJob

SCRIPT = Path(__file__).with_name("ft_fsdp_replica.py")


def loss_of(model: torch.nn.Module, replica: int, step: int, rank: int) -> torch.Tensor:
    inputs, targets = ft_fsdp_replica.batch(replica, step, rank)
    return torch.nn.functional.mse_loss(model(inputs), targets)


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("strategy", "api"),
    [
        ("optim_grads_params", "megatron"),
        ("optim", "megatron"),
        ("optim_grads_params", "fsdp2"),
        ("optim_grads_params", "fsdp2-hook"),
    ],
)
def test_a_sharded_replica_group_killed_mid_backward_heals_each_rank_its_shard(
    tmp_path: Path, strategy: str, api: str
) -> None:
    """``api``: MegatronFSDP's ``fully_shard``; the FSDP2-style API through gradsync's
    ``register_fault_tolerant_hook``; or through torchft's FSDP2 pattern, an all-reduce hook on every FSDP
    module over the manager's process group (no layout check: its 56 bytes are not sent)."""
    options = {"strategy": strategy, "api": api}
    with ReplicaJob(tmp_path, SCRIPT, replicas=2, ranks=2, steps=5, **options) as job:
        for replica in range(2):
            job.launch(replica, "backward:2" if replica == 1 else "")
        job.launch(job.kill_when_stopped(1))
        job.finish()
    job.check_killed_steps_retried({1: 2})
    finals = {(r, k): torch.load(tmp_path / f"final_{r}_{k}.pt") for r in range(2) for k in range(2)}
    for (replica, rank), final in finals.items():
        reference = finals[0, rank]
        assert final["manager"]["step"] == reference["manager"]["step"]
        for index, state in reference["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(final["optimizer"]["state"][index][key], value), (
                    replica,
                    rank,
                    index,
                    key,
                )
        if rank == 0:
            for name, tensor in reference["model"].items():
                assert torch.equal(final["model"][name], tensor), (replica, name)
    # HSDP's traffic: each rank sends its own rows across groups (the two ranks' rows make the buckets,
    # padding included), plus the layout check's 7 float64s per step
    assert finals[0, 0]["rows"] + finals[0, 1]["rows"] == finals[0, 0]["whole"]
    for rank in range(2):
        sent = finals[0, rank]["sent"]
        assert sent, rank
        layout_check = 0 if api == "fsdp2-hook" else 7 * 8
        assert all(n == finals[0, rank]["rows"] + layout_check for n in sent), (rank, sent)
    model = ft_fsdp_replica.build_model()
    steps = job.replay(model, ft_fsdp_replica.build_optimizer(model.parameters()), loss_of)
    assert steps == list(range(finals[0, 0]["manager"]["step"]))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(finals[0, 0]["model"][name], tensor, rtol=1e-5, atol=1e-6)
