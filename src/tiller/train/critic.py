"""The critic of PPO (`advantage: gae`): a value model and its clipped-value-loss training.

Design: the value model is a *copy* of the policy's transformer (initialized from the policy's
weights at the start of RL) with a scalar head, not a value head on the policy's own trunk.
- The value loss never moves the policy's weights, so the weights the engine samples with, the
  KL to the reference and the policy's clip statistics mean what they say, and there is no
  policy-vs-value loss weight to tune.
- The critic has its own optimizer and learning rate (`critic.value_lr`); critics usually want
  a larger one than the policy.
- It costs a second copy of the weights and one more forward/backward per step, which is the
  usual price (OpenRLHF and verl keep a separate critic too); at tiller's scale it is small.

The head starts at zero, so the first values are 0 and the first GAE advantages are the plain
(discounted) rewards: the critic can only help from there. Values line up with tokens the way
log-probabilities do: position t holds V(s_t), the value of the state *before* token t, read
from the hidden state at t - 1.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Literal

import torch
from torch import nn
from transformers import PreTrainedModel

from tiller.algorithms import AGGREGATIONS
from tiller.algorithms.advantages import value_loss
from tiller.config import CriticConfig, RLConfig, TrainConfig
from tiller.train.batch import Batch, minibatches
from tiller.train.logprobs import flag_checkpointed_layers, hidden_states
from tiller.train.rows import Rows, put_rows


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over masked-in tokens: 1 when V predicts the returns exactly,
    0 when it does no better than their mean, negative when worse. NaN if Var[R] = 0."""
    on = mask > 0
    r, v = returns[on], values[on]
    var_r = float(r.var(unbiased=False)) if r.numel() else 0.0
    if var_r == 0.0:
        return float("nan")
    return 1.0 - float((r - v).var(unbiased=False)) / var_r


class ValueModel(nn.Module):
    """V(s_t) at every position: the policy's transformer (copied) and a zero-initialized
    linear head on its last hidden state. The copy trains whatever the policy's tensors say:
    under model.lora the critic is built from `Lora.merged`, whose tensors are frozen."""

    def __init__(self, policy: PreTrainedModel):
        super().__init__()
        self.backbone = copy.deepcopy(policy.base_model).requires_grad_(True)
        # the blocks FSDP2 shards one by one on trainer ranks (`train.sharding.shard`)
        self._no_split_modules = getattr(policy, "_no_split_modules", None)
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: Batch, packing: bool = False) -> torch.Tensor:
        """[B, T]: V(s_t) at t from the hidden state at t - 1 (0 at t = 0 and off each row's
        length), the transformer run packed or padded like the policy's (`train.logprobs`)."""
        hidden, rows, cols, flat = hidden_states(self.backbone, batch, packing)
        v = self.head(hidden[flat].float())[:, 0]
        return v.new_zeros(batch.input_ids.shape).index_put((rows, cols + 1), v)


class Critic:
    """The value model with its optimizer: `values` before the update (no grad), `update`
    after the policy's, on the same mini/micro-batch partition and loss aggregation, walking
    the rows like the policy (`rows`: the policy trainer's; on trainer ranks each rank runs its
    share of the rows, its value model sharded like the policy, the normalizers and the
    gradient clipping global)."""

    def __init__(self, policy: PreTrainedModel, cfg: CriticConfig,
                 dropout: Literal["keep", "off"] = "off", train: TrainConfig | None = None,
                 rows: Rows | None = None):
        self.cfg = cfg
        self.dropout = dropout  # model.dropout: "off" trains in eval mode, as the policy
        self.train = train or TrainConfig()  # packing, token budget, checkpointing: as the policy
        self.rows = rows or Rows(self.train)
        self.model = self.rows.sharded(ValueModel(policy).to(policy.device))  # policy's device
        if self.train.activation_checkpointing:
            self.model.backbone.activation_checkpointing_enable({"use_reentrant": False})
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.value_lr,
                                           betas=(0.9, 0.99))

    @property
    def device(self) -> torch.device:
        return self.model.head.weight.device

    @torch.no_grad()
    def values(self, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros_like(batch.loss_mask)
        lengths = batch.attention_mask.sum(-1)
        for rows in self.rows.share(torch.arange(len(lengths)), lengths, micro_batch_size):
            mb = self.rows.pass_batch(batch, rows, self.device)
            put_rows(out, rows, self.model(mb, self.train.packing))
        return self.rows.reduce_rows(out)

    def update(self, batch: Batch, returns: torch.Tensor, old_values: torch.Tensor,
               cfg: RLConfig, l_max: int) -> dict[str, float]:
        """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), aggregated like the policy
        loss and weighted per row like it (`loss_weight`), over the policy's partition:
        `cfg.ppo_epochs` passes of `cfg.mini_batches` optimizer steps. Logs the loss with the
        explained variance of the values the advantages used, and the gradient norm before
        clipping (mean over the optimizer steps)."""
        aggregate = AGGREGATIONS[cfg.algorithm.aggregation]
        mask = batch.loss_mask
        dev = self.device
        sums: dict[str, float] = defaultdict(float)
        self.model.train(self.dropout == "keep")
        if self.train.activation_checkpointing:
            flag_checkpointed_layers(self.model)
        steps = minibatches(batch, cfg.mini_batches, cfg.micro_batch_size, l_max)
        lengths = batch.attention_mask.sum(-1)
        norms = 0.0
        for _epoch in range(cfg.ppo_epochs):
            for mini, _, totals in steps:
                for rows in self.rows.share(mini, lengths, cfg.micro_batch_size):
                    mb = self.rows.pass_batch(batch, rows, dev)
                    width = mb.input_ids.size(1)
                    v = self.model(mb, self.train.packing)
                    loss_tok, stats = value_loss(v, old_values[rows, :width].to(dev),
                                                 returns[rows, :width].to(dev), mb.loss_mask,
                                                 self.cfg.value_clip)
                    loss = aggregate(loss_tok * mb.loss_weight[:, None], mb.loss_mask, **totals)
                    loss.backward()
                    sums["value_loss"] += float(loss.detach())
                    sums["clipped"] += float(stats["clipped"].sum())
                norms += float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                              cfg.max_grad_norm))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        sums = self.rows.reduce(sums)
        n_tok = max(float(mask.sum()), 1.0)
        updates = cfg.ppo_epochs * len(steps)
        return {
            "value_loss": sums["value_loss"] / updates,
            "value_grad_norm": norms / updates,
            "value_clip_frac": sums["clipped"] / (n_tok * cfg.ppo_epochs),
            "value_mean": float((old_values * mask).sum()) / n_tok,
            "explained_variance": explained_variance(old_values, returns, mask),
        }
