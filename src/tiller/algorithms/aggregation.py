"""Loss aggregation: how per-token losses become the scalar that is differentiated.

Signature: `fn(loss, mask, *, total_tokens, total_seqs, l_max) -> scalar`. Each call gets one
micro-batch's per-token `loss` and `mask` ([rows, time]) plus the WHOLE optimizer batch's
normalizers, so that summing the micro-batch results gives exactly the full-batch loss
(gradient accumulation equals one big batch):

- `total_tokens`: sum of the mask over the optimizer batch,
- `total_seqs`: number of rows (trajectories) in the optimizer batch with at least one loss
  token (the empty-row rule: a row masked out entirely, e.g. by `overlong: mask`, does not count,
  so it does not dilute the others; `batch.minibatches` computes it),
- `l_max`: the fixed max number of generated tokens (Dr. GRPO's constant).

The three normalizers are one interface: every mode takes all three and uses the ones its
formula has. A row is never split across micro-batches, so per-row quantities (|o_i|) are
computed locally. `seq-mean-token-sum-norm` declares the `l_max` knob (the config's ignored-knob
rule); its value arrives resolved in the normalizers.
"""

from __future__ import annotations

import torch

from tiller.algorithms.registry import AGGREGATIONS


@AGGREGATIONS.register("token-mean")
def token_mean(
    loss: torch.Tensor, mask: torch.Tensor, *, total_tokens: float, total_seqs: int, l_max: int
) -> torch.Tensor:
    """sum_{i,t} m L / sum_{i,t} m, the denominator counted over the whole optimizer batch."""
    return (loss * mask).sum() / max(total_tokens, 1.0)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, *, total_tokens: float, total_seqs: int, l_max: int
) -> torch.Tensor:
    """mean_i ( sum_t m L / |o_i| ) over the optimizer batch's non-empty rows; an empty row
    (|o_i| = 0) contributes 0 to the sum (its |o_i| is clamped to 1) and is not in N_seq."""
    per_seq = (loss * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return per_seq.sum() / max(total_seqs, 1)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss: torch.Tensor, mask: torch.Tensor, *, total_tokens: float, total_seqs: int, l_max: int
) -> torch.Tensor:
    """mean_i ( sum_t m L ) over the optimizer batch's non-empty rows."""
    return (loss * mask).sum() / max(total_seqs, 1)


@AGGREGATIONS.register("seq-mean-token-sum-norm", knobs=("l_max",))
def seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, *, total_tokens: float, total_seqs: int, l_max: int
) -> torch.Tensor:
    """sum_{i,t} m L / (N_seq * L_max), L_max a fixed constant (Dr. GRPO), N_seq the non-empty
    rows."""
    return (loss * mask).sum() / (max(total_seqs, 1) * l_max)


@AGGREGATIONS.register("token-sum")
def token_sum(
    loss: torch.Tensor, mask: torch.Tensor, *, total_tokens: float, total_seqs: int, l_max: int
) -> torch.Tensor:
    """sum_{i,t} m L, no normalizer: the gradient grows with the batch's token count, so the
    learning rate must be scaled with it."""
    return (loss * mask).sum()
