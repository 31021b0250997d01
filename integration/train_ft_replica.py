"""One replica group of the fault-tolerant main job (``integration/train_ft.py`` starts, kills and restarts
it): the toy GPT under gradsync's DistributedDataParallel, its buckets reduced across replica groups by
torchft's manager (``gradsync.ddp.fault_tolerance``).

Each step the replica group trains on its own rows of the step's global batch. Its records (through
:class:`gradsync.groups.testing.replica_groups.ReplicaScript`) hold, per attempted step, the outcome, the
quorum's size, its loss, the wall time, and on a restarted life's first step how long the heal took.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a restart's cost is mostly theirs

import argparse  # noqa: E402

import torch  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402
from toygpt.data import Corpus, local_rows  # noqa: E402
from toygpt.model import GPTConfig, GPTStage, next_token_loss  # noqa: E402

from gradsync.buffers import DistributedDataParallelConfig  # noqa: E402
from gradsync.ddp import DistributedDataParallel  # noqa: E402
from gradsync.ddp.fault_tolerance import register_fault_tolerant_hook, replica_state  # noqa: E402
from gradsync.groups import initialize_model_parallel  # noqa: E402
from gradsync.groups.testing.replica_groups import ReplicaScript  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8, help="sequences per replica group per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=1 << 20)
    script = ReplicaScript(parser)
    args = script.args
    torch.set_num_threads(1)

    groups = initialize_model_parallel()  # the replica group's own world
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layer=args.n_layer, seed=args.seed)
    stage = GPTStage(cfg, groups)
    config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, grad_reduce_in_fp32=True, bucket_size=40_000
    )
    model = DistributedDataParallel(stage.config, config, stage, pg_collection=groups)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    state_dict, load_state_dict = replica_state(model, inner)
    manager = script.manager(state_dict, load_state_dict)
    register_fault_tolerant_hook(model, manager)
    optimizer = OptimizerWrapper(manager, inner)
    stage.wte.weight.register_hook(script.backward_hook())  # --stop backward:S (its grad comes last)
    corpus = Corpus.from_stdlib(args.corpus_bytes)

    script.start_together()
    first = True
    while True:
        model.zero_grad_buffer()
        quorum_from = time.perf_counter()
        optimizer.zero_grad()  # the quorum: a restarted replica group heals here
        quorum_s = time.perf_counter() - quorum_from
        step = manager.current_step()
        healed = first and step > 0
        tokens = corpus.batch(step, args.rows * args.replicas, args.seq_len, seed=args.seed)
        windows = local_rows(tokens, args.replica, args.replicas)
        loss = next_token_loss(model(windows[:, :-1]), windows)
        loss.backward()
        model.finish_grad_sync()
        script.reduced(step)
        participants = manager.num_participants()
        optimizer.step()  # only if every replica group in the quorum reduced every bucket
        committed = manager.current_step() == step + 1
        facts = {"loss": loss.item(), "t": time.time(), "life_started": STARTED}
        script.record(step, committed, participants, **facts, **({"heal_s": quorum_s} if healed else {}))
        first = False
        if script.done(committed, manager.current_step(), participants):
            break
    manager.shutdown(wait=False)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
