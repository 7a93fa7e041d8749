"""Loss aggregation: how per-token losses become the scalar that is differentiated.

Signature: `fn(loss, mask, *, total_tokens, total_seqs, l_max, **_) -> scalar`. Each call gets
one micro-batch's per-token `loss` and `mask` ([rows, time]) plus the WHOLE optimizer batch's
normalizers, so that summing the micro-batch results gives exactly the full-batch loss
(gradient accumulation equals one big batch):

- `total_tokens`: sum of the mask over the optimizer batch,
- `total_seqs`: number of rows (trajectories) in the optimizer batch, empty ones included,
- `l_max`: the fixed max number of generated tokens (Dr. GRPO's constant).

Every function takes all three and uses the ones it needs. A row is never split across
micro-batches, so per-row quantities (|o_i|) are computed locally.
"""

from __future__ import annotations

import torch

from tiller.train.algorithms.registry import AGGREGATIONS


@AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, *, total_tokens: float, **_) -> torch.Tensor:
    """sum_{i,t} m L / sum_{i,t} m, the denominator counted over the whole optimizer batch."""
    return (loss * mask).sum() / max(total_tokens, 1.0)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, *, total_seqs: int, **_
) -> torch.Tensor:
    """mean_i ( sum_t m L / |o_i| ) over the optimizer batch's rows; a row with |o_i| = 0
    contributes 0 (its |o_i| is clamped to 1)."""
    per_seq = (loss * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return per_seq.sum() / max(total_seqs, 1)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss: torch.Tensor, mask: torch.Tensor, *, total_seqs: int, **_
) -> torch.Tensor:
    """mean_i ( sum_t m L ) over the optimizer batch's rows."""
    return (loss * mask).sum() / max(total_seqs, 1)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, *, total_seqs: int, l_max: int, **_
) -> torch.Tensor:
    """sum_{i,t} m L / (N_seq * L_max), L_max a fixed constant (Dr. GRPO)."""
    return (loss * mask).sum() / (max(total_seqs, 1) * l_max)
