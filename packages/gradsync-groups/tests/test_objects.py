"""Object collectives without NumPy: every rank sends a different object (different sizes, so the padding
is exercised), and in processes where NumPy cannot be imported they work where torch's own fail."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

import torch
import torch.distributed as dist

from gradsync.groups.objects import all_gather_objects, broadcast_object, gather_objects
from gradsync.groups.testing import run_distributed


def payload(rank: int) -> dict[str, Any]:
    return {"rank": rank, "text": "x" * (300 * rank + 1), "tensor": torch.arange(rank + 2.0), "keys": {rank}}


def exchange() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = dist.new_group([r for r in range(world) if r % 2])  # group ranks != global ranks
    out: dict[str, Any] = {
        "gathered": all_gather_objects(payload(rank)),
        "broadcast": broadcast_object(payload(rank), src=world - 1),
        "to_one": gather_objects(payload(rank), dst=1),
    }
    if rank % 2:
        out["subgroup"] = all_gather_objects(payload(rank), odd)
        out["subgroup_broadcast"] = broadcast_object(payload(rank), src=3, group=odd)
        out["subgroup_to_3"] = gather_objects(payload(rank), dst=3, group=odd)  # a global rank
    # 3-12 MB: decoded a byte at a time (a storage's bytes()), this would run past the test's timeout
    big = bytes(range(256)) * (12_000 * (rank + 1))
    out["big"] = [hashlib.sha256(b).hexdigest() for b in all_gather_objects(big)]
    return out


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return {k: v for k, v in got.items() if k != "tensor"} == {
        k: v for k, v in want.items() if k != "tensor"
    } and torch.equal(got["tensor"], want["tensor"])


def test_objects_reach_every_rank_in_group_order() -> None:
    world = 4
    for rank, out in enumerate(run_distributed(exchange, world)):
        assert all(same(g, payload(r)) for r, g in enumerate(out["gathered"])), rank
        assert same(out["broadcast"], payload(world - 1)), rank
        if rank == 1:
            assert all(same(g, payload(r)) for r, g in enumerate(out["to_one"])), rank
        else:
            assert out["to_one"] is None, rank
        if rank % 2:
            assert [g["rank"] for g in out["subgroup"]] == [1, 3], rank
            assert same(out["subgroup_broadcast"], payload(3)), rank
            if rank == 3:
                assert [g["rank"] for g in out["subgroup_to_3"]] == [1, 3], rank
            else:
                assert out["subgroup_to_3"] is None, rank
        want = [hashlib.sha256(bytes(range(256)) * (12_000 * (r + 1))).hexdigest() for r in range(world)]
        assert out["big"] == want, rank


WITHOUT_NUMPY = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # as on an install without NumPy: importing it fails
    import torch
    import torch.distributed as dist
    from gradsync.groups.objects import all_gather_objects, broadcast_object, gather_objects

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        dist.all_gather_object([None, None], rank)
        torch_says = "worked"
    except RuntimeError as error:
        torch_says = str(error)
    gathered = all_gather_objects({"rank": rank, "pad": "y" * rank * 50})
    assert [g["rank"] for g in gathered] == [0, 1], gathered
    assert broadcast_object(("from", rank), src=1) == ("from", 1)
    assert gather_objects(rank, dst=0) == ([0, 1] if rank == 0 else None)
    print(f"rank {rank} ok; torch: {torch_says}")
    dist.destroy_process_group()
    """
)


def test_objects_move_where_numpy_is_missing() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", WITHOUT_NUMPY],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, output
        assert f"rank {rank} ok; torch: Numpy is not available" in output, output
