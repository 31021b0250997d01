"""Embedded training data: the bytes of the Python standard library's own source files.

Every machine that runs gradsync has them, so nothing is downloaded. Files are read in sorted order up to
a size limit (ASCII files only: a byte that appears in a handful of windows has an output row that
Adam pushes down by about the learning rate every step, so a later batch holding it costs tens of nats
per token), and split deterministically: every tenth file goes to validation. Batches are a pure
function of (seed, step), so every layout and every resumed run sees the same global batch at a step, and
each data-parallel rank takes its contiguous slice of it.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

DEFAULT_LIMIT_BYTES = 4 << 20


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8
    val: torch.Tensor
    source: str

    @classmethod
    @lru_cache(maxsize=2)  # pooled test ranks train many times on the same corpus
    def from_stdlib(cls, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> Corpus:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
        if not files:
            raise FileNotFoundError(f"no Python sources under {root} to build the corpus from")
        train, val, total = bytearray(), bytearray(), 0
        kept = 0
        for path in files:
            data = path.read_bytes()
            if not data.isascii():
                continue
            (val if kept % 10 == 9 else train).extend(data)
            kept += 1
            total += len(data)
            if total >= limit_bytes:
                break
        return cls(
            torch.frombuffer(train, dtype=torch.uint8).clone(),
            torch.frombuffer(val, dtype=torch.uint8).clone(),
            f"{kept} ASCII .py files of {root} ({total / 2**20:.1f} MiB)",
        )

    def batch(
        self, step: int, batch_size: int, seq_len: int, split: str = "train", seed: int = 0
    ) -> torch.Tensor:
        """The global batch at ``step``: ``batch_size`` windows of ``seq_len + 1`` bytes (inputs + next)."""
        data = self.train if split == "train" else self.val
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
        return torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()


def local_rows(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's contiguous slice of the global batch."""
    if batch.shape[0] % dp_size:
        raise ValueError(f"global batch size {batch.shape[0]} is not divisible by the DP size {dp_size}")
    return batch.chunk(dp_size)[dp_rank]
