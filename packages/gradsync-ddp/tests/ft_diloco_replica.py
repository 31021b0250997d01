"""One replica of DiLoCo under torchft (gradsync's DiLoCo with ``manager=``, over gradsync DDP within the
replica group); run as a script by test_fault_tolerance.py through
:class:`gradsync.groups.testing.replica_groups.ReplicaScript`.

Each round it takes ``INNER_STEPS`` plain SGD steps on its own batches, then syncs. It records, per
round, that it trained (``reduced``) and the sync's outcome with the number of replicas whose moves the
sync averaged; at the end it writes its synced weights, outer momentum and model. With ``--fragments F``
(Streaming DiLoCo) each fragment syncs every ``F * INNER_STEPS`` steps, so a round's sync is one
fragment's, in turn.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from gradsync.buffers import DistributedDataParallelConfig
from gradsync.ddp import DiLoCo, DistributedDataParallel
from gradsync.groups import ModelParallelConfig, initialize_model_parallel
from gradsync.groups.testing.replica_groups import ReplicaScript

INNER_STEPS = 3
INNER_LR = 0.05
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(replica: int, round_: int, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * round_ + 100 * replica + inner)
    inputs = torch.randn(4, 8, generator=generator)
    return inputs, inputs[:, :4].sin()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fragments", type=int, default=1)
    script = ReplicaScript(parser)
    fragments = script.args.fragments
    module = build_model(script.replica)  # apart: the manager's step-0 sync must make the replicas one
    config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100)
    pgs = initialize_model_parallel()
    model = DistributedDataParallel(ModelParallelConfig(), config, module, pg_collection=pgs)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    manager = script.manager(None, None)  # DiLoCo registers its own state
    module[0].weight.register_hook(script.backward_hook())  # --stop backward:S: in round S's first step

    script.start_together()
    diloco = DiLoCo(
        model.parameters(),
        inner,
        INNER_STEPS * fragments,
        manager=manager,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
        fragments=fragments,
    )  # the first sync: torchft's step-0 sync, or a restarted replica's heal
    start = script.out / f"start_{script.replica}.pt"
    if not start.exists():  # the first life's
        torch.save(
            {"step": manager.current_step(), "synced": [s.detach().clone() for s in diloco.synced]}, start
        )
    while True:
        round_ = manager.current_step()
        for inner_step in range(INNER_STEPS):
            model.zero_grad_buffer()
            diloco.zero_grad()
            inputs, targets = batch(script.replica, round_, inner_step)
            F.mse_loss(model(inputs), targets).backward()
            model.finish_grad_sync()
            if inner_step == INNER_STEPS - 1:
                script.reduced(round_)  # trained the round: its move goes into this sync
            diloco.step()  # the last one syncs
        committed = manager.current_step() == round_ + 1
        participants = manager.num_participants()
        script.record(round_, committed, participants, trained=diloco.trained_replicas)
        # over once every replica trained a round: a restarted one's first sync only heals it
        if script.done(committed, manager.current_step(), diloco.trained_replicas):
            break

    final = {
        "synced": [s.detach().clone() for s in diloco.synced],
        "momentum": [diloco.outer_optimizer.state[s]["momentum_buffer"] for s in diloco.synced],
        "model": model.module.state_dict(),
        "step": manager.current_step(),
        "peak_sync_bytes": diloco.peak_sync_bytes,
        "last_synced": [f.offset for f in diloco.fragments].index(diloco.local_steps % diloco.sync_every),
    }
    torch.save(final, script.out / f"final_{script.replica}.pt")
    manager.shutdown(wait=False)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
