"""How a trainer's passes walk a batch's rows: `Rows` (one process runs every micro-batch);
trainer ranks override it (`train.distributed.RankRows`). Its own module so that the policy's
trainer and the critic both use it without importing each other."""

from __future__ import annotations

import torch
from torch import nn

from tiller.config import TrainConfig
from tiller.train.batch import Batch, micro_batches


class Rows:
    """How a trainer's passes walk a batch's rows (the policy's and the critic's alike): here
    one process runs every micro-batch. A trainer rank's (`train.distributed.RankRows`) runs its
    share of them, sums its metrics over the ranks and shards the models it trains."""

    def __init__(self, train: TrainConfig):
        self.train = train

    def share(self, rows: torch.Tensor, lengths: torch.Tensor, size: int
              ) -> list[torch.Tensor]:
        """The micro-batches of `rows` this process runs (at most `size` rows, and
        `train.micro_batch_tokens` tokens packed or padded, like one rank's)."""
        return [rows[idx] for idx in micro_batches(lengths[rows], size,
                                                   self.train.micro_batch_tokens,
                                                   self.train.packing)]

    def pass_batch(self, batch: Batch, rows: torch.Tensor, device: torch.device) -> Batch:
        """The batch of one pass, on `device`."""
        return batch.rows(rows).to(device)

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums over every process that ran passes."""
        return sums

    def reduce_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """A [B, T] tensor whose rows each process filled for the rows it ran, whole."""
        return per_row

    def sharded(self, module: nn.Module) -> nn.Module:
        """A model this trainer trains or runs, as its processes hold it."""
        return module


def put_rows(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """A pass's per-row `values` [len(rows), W] written into the whole-batch tensor `out` at
    its batch `rows`, columns :W; an empty pass's rows (negative: another rank's row, see
    `train.sharding.rank_rows`) are left alone."""
    real = rows >= 0
    out[rows[real], : values.size(1)] = values.to(out.device)[real]
