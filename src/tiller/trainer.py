"""The trainer: recomputes log-probabilities on exactly the sampled ids and optimizes the policy.

`Batch.collate` right-pads trajectories into tensors; position t of `logp` is the policy's
log-probability of token t given tokens < t, so it lines up with `loss_mask` and the engine's
`rollout_logprobs` index for index. SFT and RL share that alignment and the same mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .algorithms import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from .algorithms.offpolicy import mismatch_stats
from .config import RLConfig
from .trajectory import Trajectory
from .weight_sync import WeightUpdate


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float, 1 on generated tokens
    rollout_logprobs: torch.Tensor  # [B, T] float, the engine's logprob on generated tokens
    advantages: torch.Tensor  # [B, T] float, broadcast per token

    @classmethod
    def collate(
        cls,
        trajectories: Sequence[Trajectory],
        pad_token_id: int,
        advantages: Sequence[float] | None = None,
    ) -> Batch:
        width = max(len(t.token_ids) for t in trajectories)
        n = len(trajectories)
        ids = torch.full((n, width), pad_token_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width))
        lp = torch.zeros((n, width))
        for i, t in enumerate(trajectories):
            k = len(t.token_ids)
            ids[i, :k] = torch.tensor(t.token_ids)
            attn[i, :k] = 1
            mask[i, :k] = torch.tensor(t.loss_mask, dtype=torch.float)
            lp[i, :k] = torch.tensor(t.logprobs)
        adv = torch.zeros((n, 1)) if advantages is None else torch.tensor(advantages)[:, None]
        return cls(ids, attn, mask, lp, adv.float() * mask)

    def rows(self, index: torch.Tensor) -> Batch:
        """A sub-batch, trimmed to its own longest row."""
        width = int(self.attention_mask[index].sum(-1).max())
        return Batch(*(getattr(self, f)[index, :width] for f in self.__dataclass_fields__))


def token_logprobs(
    model: nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token_t | tokens_<t) for every position (0 at t = 0), and optionally the entropy
    H_t = -sum_v p_v log p_v of the distribution that produced token t."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp_all = torch.log_softmax(logits[:, :-1].float() / max(temperature, 1e-8), dim=-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    pad = logp.new_zeros((logp.size(0), 1))
    logp = torch.cat([pad, logp], dim=1)
    if not with_entropy:
        return logp, None
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.cat([pad, ent], dim=1)


def _micro_batches(lengths: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Row indices in chunks of `size`, grouped by length so little compute goes to padding.

    Losses are normalized by whole-batch counts, so how rows are chunked never changes the
    gradient.
    """
    order = torch.argsort(lengths, stable=True)
    return [order[i : i + size] for i in range(0, len(order), size)]


class Trainer:
    """Owns the policy's optimizer and weight version; publishes `WeightUpdate`s."""

    def __init__(self, model: nn.Module, temperature: float = 1.0):
        self.model = model
        self.temperature = temperature
        self.version = 0
        self.optimizer: torch.optim.Optimizer | None = None

    def set_optimizer(self, lr: float, weight_decay: float = 0.0) -> None:
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99)
        )

    def weight_update(self) -> WeightUpdate:
        return WeightUpdate.full(self.model, self.version)

    def _step(self, max_grad_norm: float) -> float:
        assert self.optimizer is not None, "call set_optimizer first"
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return float(norm)

    def sft_step(self, batch: Batch, micro_batch_size: int, max_grad_norm: float = 1.0) -> dict:
        """Cross-entropy on generated (assistant) tokens only: the mask RL uses."""
        self.model.train()
        total = float(batch.loss_mask.sum())
        loss_sum = 0.0
        for idx in _micro_batches(batch.attention_mask.sum(-1), micro_batch_size):
            mb = batch.rows(idx)
            logp, _ = token_logprobs(self.model, mb, 1.0)
            loss = -(logp * mb.loss_mask).sum() / max(total, 1.0)
            loss.backward()
            loss_sum += float(loss.detach())
        return {"sft_loss": loss_sum, "grad_norm": self._step(max_grad_norm), "tokens": total}

    @torch.no_grad()
    def _logprobs(self, model: nn.Module, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        model.eval()
        out = torch.zeros_like(batch.loss_mask)
        for idx in _micro_batches(batch.attention_mask.sum(-1), micro_batch_size):
            mb = batch.rows(idx)
            out[idx, : mb.input_ids.size(1)] = token_logprobs(model, mb, self.temperature)[0]
        return out

    def rl_step(
        self, batch: Batch, cfg: RLConfig, l_max: int, ref_model: nn.Module | None = None
    ) -> dict:
        """One policy-gradient update from a rollout batch (`cfg.mini_batches` optimizer steps).

        logp_old is recomputed with the weights that sampled the batch; its gap to the engine's
        logprobs is the rollout-vs-trainer mismatch metric. With one mini-batch the weights do
        not move before the gradient pass, so that pass's own (detached) logprobs are logp_old
        and the separate no-grad pass is skipped.
        """
        alg = cfg.algorithm
        mask = batch.loss_mask
        prepass = cfg.mini_batches > 1
        logp_old = (
            self._logprobs(self.model, batch, cfg.micro_batch_size)
            if prepass
            else torch.zeros_like(mask)
        )
        logp_ref = (
            self._logprobs(ref_model, batch, cfg.micro_batch_size)
            if alg.kl_beta > 0 and ref_model is not None
            else None
        )
        n_tok = float(mask.sum())
        policy_loss = POLICY_LOSSES[alg.policy_loss]
        aggregate = AGGREGATIONS[alg.aggregation]
        sums = {"loss": 0.0, "clip_frac": 0.0, "entropy": 0.0, "kl": 0.0, "grad_norm": 0.0}
        self.model.train()
        n = len(batch.input_ids)
        minis = [torch.arange(n)[i :: cfg.mini_batches] for i in range(cfg.mini_batches)]
        for mini in minis:
            mini_tokens = float(mask[mini].sum())
            for idx in _micro_batches(batch.attention_mask[mini].sum(-1), cfg.micro_batch_size):
                rows = mini[idx]
                mb = batch.rows(rows)
                width = mb.input_ids.size(1)
                logp, ent = token_logprobs(self.model, mb, self.temperature, with_entropy=True)
                if not prepass:
                    logp_old[rows, :width] = logp.detach()
                old = logp_old[rows, :width]
                m = mb.loss_mask
                loss_tok, stats = policy_loss(
                    logp, old, mb.advantages, m, eps_low=alg.eps_low, eps_high=alg.eps_high
                )
                if logp_ref is not None:
                    kl = KL_ESTIMATORS[alg.kl_estimator](logp, logp_ref[rows, :width])
                    loss_tok = loss_tok + alg.kl_beta * kl
                    sums["kl"] += float((kl.detach() * m).sum())
                loss = aggregate(loss_tok, m, total_tokens=mini_tokens, total_seqs=len(mini),
                                 l_max=l_max)
                loss.backward()
                sums["loss"] += float(loss.detach())
                sums["clip_frac"] += float((stats["clipped"].detach() * m).sum())
                sums["entropy"] += float((ent.detach() * m).sum())
            sums["grad_norm"] += self._step(cfg.max_grad_norm)
        metrics = {
            **mismatch_stats(batch.rollout_logprobs, logp_old, mask),
            "loss": sums["loss"] / len(minis),
            "grad_norm": sums["grad_norm"] / len(minis),
            "clip_frac": sums["clip_frac"] / max(n_tok, 1.0),
            "entropy": sums["entropy"] / max(n_tok, 1.0),
        }
        if logp_ref is not None:
            metrics["kl"] = sums["kl"] / max(n_tok, 1.0)
        return metrics
