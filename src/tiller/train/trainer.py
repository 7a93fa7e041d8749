"""The trainer: recomputes log-probabilities on exactly the sampled ids (`train.batch`) and
optimizes the policy; advantages by the configured estimator, the policy loss, KL and critic."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from tiller.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    OFF_POLICY,
    POLICY_LOSSES,
)
from tiller.algorithms.advantages import last_token_rewards
from tiller.algorithms.credit import turn_credit, turn_sums
from tiller.algorithms.kl import kl_beta_at, kl_in_reward
from tiller.algorithms.losses import entropy_bonus
from tiller.algorithms.offpolicy import correction_stats, mismatch_stats, staleness_stats
from tiller.config import AlgorithmConfig, CriticConfig, RLConfig, TrainConfig
from tiller.engine.updates import WeightUpdate
from tiller.train.batch import Batch, minibatches
from tiller.train.logprobs import (
    PassShape,
    check_plain_head,
    flag_checkpointed_layers,
    token_logprobs,
)
from tiller.train.rows import Rows, put_rows

if TYPE_CHECKING:
    from tiller.train.critic import Critic


def _at_turn_ends(turn_values: torch.Tensor, spans: Sequence[Sequence[tuple[int, int]]],
                  width: int) -> torch.Tensor:
    """[B, width]: each turn's value on that turn's last generated token, 0 elsewhere."""
    out = turn_values.new_zeros((turn_values.size(0), width))
    for i, row in enumerate(spans):
        for k, (start, end) in enumerate(row):
            if end > start:
                out[i, end - 1] += turn_values[i, k]
    return out


def compute_advantages(
    batch: Batch,
    alg: AlgorithmConfig,
    values: torch.Tensor | None = None,
    kl_reward: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token advantages [B, T] (0 off the loss mask) and, for a per-token estimator with a
    critic (`gae`), the value targets.

    The estimator gets exactly the inputs and knobs it declares in `ADVANTAGES`; what it
    declares, never its name, says which rewards it sees. `kl_reward` is the per-token
    KL-in-reward term -beta * k1 (`kl_in_reward`), or None; every path sees the same penalty:
    - per-token estimators (declare `token_rewards`): outcome on the last generated token +
      per-turn rewards on each turn's last token + kl_reward;
    - outcome estimators, when the batch has `turn_rewards`: wrapped in turn-level credit
      (`credit.turn_credit`); turn k's reward is its per-turn reward (+ the outcome on the last
      turn) + the turn's summed kl_reward;
    - outcome estimators otherwise: r_i + sum_t kl_reward_{i,t}, broadcast to the row's tokens.
    """
    mask = batch.loss_mask
    name = alg.advantage
    eps = alg.advantage_eps  # None for the estimators that take no eps
    episodes = batch.episode_index
    split = len(episodes) > 0 and int(episodes.max()) + 1 < len(episodes)
    if split and (batch.turn_rewards is not None or "token_rewards" in ADVANTAGES.inputs[name]):
        raise ValueError(f"advantage {name!r} with per-token or per-turn rewards cannot train "
                         "episodes split into several sequences (agent.history: template, or "
                         "a rewritten history): use an outcome estimator such as grpo")
    if "token_rewards" in ADVANTAGES.inputs[name]:
        token_rewards = last_token_rewards(batch.rewards, mask)
        if batch.turn_rewards is not None:
            token_rewards = token_rewards + _at_turn_ends(batch.turn_rewards, batch.turn_spans,
                                                          mask.size(1))
        if kl_reward is not None:
            token_rewards = token_rewards + kl_reward
        return ADVANTAGES.call(name, alg, token_rewards=token_rewards, values=values, mask=mask,
                               eps=eps)
    estimate = partial(ADVANTAGES.call, name, alg, eps=eps)
    if batch.turn_rewards is not None:
        turns = batch.turn_rewards.size(1)
        counts = torch.tensor([len(s) for s in batch.turn_spans])
        per_turn = batch.turn_rewards.clone()
        has_turn = counts > 0
        per_turn[has_turn, counts[has_turn] - 1] += batch.rewards[has_turn]
        if kl_reward is not None:
            per_turn = per_turn + turn_sums(kl_reward, batch.turn_spans, turns)
        credit = alg.credit
        adv = turn_credit(estimate, per_turn, batch.turn_spans, batch.group_index, mask,
                          credit.gamma_turn, credit.turn_baseline)
        return adv, None
    # one estimate per episode (the rows of a split episode are one sample of its group),
    # broadcast to its rows' tokens
    n = int(episodes.max()) + 1 if len(episodes) else 0
    first = torch.full((n,), len(episodes), dtype=torch.long).scatter_reduce(
        0, episodes, torch.arange(len(episodes)), "amin")
    rewards = batch.rewards[first]
    if kl_reward is not None:
        rewards = rewards + torch.zeros(n).index_add(0, episodes, kl_reward.sum(-1))
    tokens = torch.zeros(n).index_add(0, episodes, mask.sum(-1))
    adv = estimate(rewards=rewards, group_index=batch.group_index[first], tokens=tokens)
    return adv[episodes][:, None] * mask, None


def _on(x: torch.Tensor, rows: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """One micro-batch's slice of a whole-batch (host) tensor, on the model's device. An empty
    pass's rows (index < 0, another rank's row) read 0: its logprobs are 0 too (no loss
    token), so its ratio is exp(0 - 0) = 1 and its advantage and KL are 0. Reading the real
    row's logp_old there would give exp(0 - logp_old), inf below -88.7, and a NaN gradient."""
    part = x[rows, :width]
    return torch.where((rows >= 0)[:, None], part, torch.zeros((), dtype=part.dtype)).to(device)


class RLStepTensors(NamedTuple):
    """What the last `rl_step` computed per token, [B, T] on the host, row i = the batch's row
    i (0 off each row's length): kept for the traces (`observe.traces`), never read back."""

    logp_old: torch.Tensor  # the trainer's logprobs at train start (the proximal policy)
    advantages: torch.Tensor  # 0 off the loss mask


class _RLInputs(NamedTuple):
    """What one `rl_step` fixes before its first update; [B, T] tensors on the host."""

    beta: float  # the KL coefficient at this step (0: no KL, no reference pass)
    kl_in_loss: bool  # the KL term is in the loss (else, with beta > 0, in the reward)
    prepass: bool  # logp_old came from a no-grad pass before any update
    logp_old: torch.Tensor  # without the prepass, filled by the (single) gradient pass
    logp_ref: torch.Tensor | None  # the reference model's logprobs, when beta > 0
    values: torch.Tensor | None  # the critic's
    kl_reward: torch.Tensor | None  # -beta * k1 per token, with the KL in the reward
    advantages: torch.Tensor  # 0 off the loss mask
    returns: torch.Tensor | None  # the critic's value targets
    row_staleness: torch.Tensor  # [B] trainer version - sample version (-1: unknown)


class PolicyTrainer:
    """Owns the policy's optimizer and weight version; runs the SFT and RL steps and publishes
    `WeightUpdate`s. (`tiller.Trainer`, in api.py, is the user's entry point to a whole run.)

    `model` holds the master weights the optimizer steps, fp32 in a run whatever `model.dtype`
    says: AdamW updates of RL's learning rates (~1e-6) are far below bf16's resolution
    (2^-8 relative) and would round away. With `compute_dtype` bfloat16 the forward passes run
    under bf16 autocast; the engine keeps its own copy of the weights in that dtype.

    Devices: the batch and every whole-batch tensor (logp_old, advantages, values) stay on the
    host, where the advantages are computed; each micro-batch moves to the model's device for
    its pass, and its results come back.

    `dropout` (model.dropout): "off" runs the gradient passes (SFT and RL) in eval mode, so they
    compute the same function as the engine and the no-grad passes (dropout and any other
    train-only randomness off; gradients flow as usual) and rho = 1 before an update; "keep"
    runs them in train mode.

    `train` (`TrainConfig`) lays out the passes: packed or padded, micro-batches by rows and
    tokens, logprobs in chunks, activation checkpointing; none of it changes a loss.
    """

    def __init__(self, model: nn.Module, temperature: float = 1.0,
                 compute_dtype: torch.dtype = torch.float32, top_k: int = 0,
                 top_p: float = 1.0, dropout: Literal["keep", "off"] = "off",
                 train: TrainConfig | None = None):
        self.model = model
        if not isinstance(model, FSDPModule):  # a rank's shards: its full model was checked
            check_plain_head(model)
        self.train = train or TrainConfig()
        self.rows = Rows(self.train)  # a trainer rank's: its share (`train.distributed`)
        self.shape = PassShape(self.train.packing, self.train.logprob_chunk_tokens)
        if self.train.activation_checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        self.temperature = temperature
        self.compute_dtype = compute_dtype
        # RL's logprobs are of the distribution the engine samples from: truncated like it
        # (`logprobs.token_logprobs`); 0 and 1.0 = untruncated (sampling.logprobs: untruncated)
        self.top_k, self.top_p = top_k, top_p
        self.dropout = dropout
        self.version = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.last_rl: RLStepTensors | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def set_optimizer(self, lr: float, weight_decay: float = 0.0,
                      betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8) -> None:
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: adapters
        self.optimizer = torch.optim.AdamW(
            trainable, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps
        )

    def weight_update(self) -> WeightUpdate:
        return WeightUpdate.full(self.model, self.version)

    @property
    def publisher(self) -> PolicyTrainer:
        """What weight sync reads: the full weights, their version and the parity probe (a
        sharded trainer's gathered copy: `train.distributed.RankTrainer`)."""
        return self

    def reference(self) -> nn.Module:
        """The KL reference: a frozen copy of the policy now (at RL start), in the compute
        dtype (under LoRA the policy with a frozen copy of its adapter: `LoraTrainer`; on
        trainer ranks a sharded copy: `train.distributed.RankTrainer`)."""
        return copy.deepcopy(self.model).to(self.compute_dtype).requires_grad_(False).eval()

    def drop_reference(self) -> None:
        """The KL term is off for good: what `reference` made is freed (the caller drops its
        handle; under LoRA the reference adapter goes)."""

    def new_critic(self, cfg: CriticConfig) -> Critic:
        """The critic, from the policy's plain weights now (the merged ones under LoRA),
        walking this trainer's rows (`Rows`: on trainer ranks each its share, sharded)."""
        from tiller.train.critic import Critic

        return Critic(self.publisher.model, cfg, self.dropout, self.train, self.rows)

    @torch.no_grad()
    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) at temperature 1 for i >= 1 under the trainer's weights,
        through `_forward` (the training passes' autocast): the trainer's side of the parity
        check after a weight sync."""
        was_training = self.model.training
        self.model.eval()
        ids = torch.tensor([token_ids], device=self.device)
        zeros = torch.zeros(ids.shape)
        probe = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=zeros,
                      rollout_logprobs=zeros, rewards=torch.zeros(1),
                      group_index=torch.zeros(1, dtype=torch.long))
        try:
            logp, _ = self._forward(self.model, probe, 1.0, truncate=False, loss_only=False)
        finally:
            self.model.train(was_training)
        return logp[0, 1:].float().tolist()

    def _forward(self, model: nn.Module, mb: Batch, temperature: float,
                 with_entropy: bool = False, truncate: bool = True, loss_only: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`token_logprobs` of a micro-batch already on the model's device, under bf16
        autocast when that is the compute dtype (log-softmax stays fp32 either way); with the
        sampler's truncation unless `truncate` is False (SFT, the parity probe); on the
        positions of the loss mask only (0 elsewhere) unless `loss_only` is False (the parity
        probe, whose every position is compared)."""
        bf16 = self.compute_dtype == torch.bfloat16
        top_k, top_p = (self.top_k, self.top_p) if truncate else (0, 1.0)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            return token_logprobs(model, mb, temperature, with_entropy, top_k, top_p,
                                  self.shape, loss_only)

    def _train_mode(self) -> None:
        """The mode of a gradient pass: train (dropout on) only with dropout "keep"; with
        activation checkpointing, the layers flagged (`flag_checkpointed_layers`)."""
        self.model.train(self.dropout == "keep")
        if self.train.activation_checkpointing:
            flag_checkpointed_layers(self.model)

    def _step(self, max_grad_norm: float) -> float:
        assert self.optimizer is not None, "call set_optimizer first"
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return float(norm)

    def sft_step(self, batch: Batch, micro_batch_size: int, max_grad_norm: float = 1.0) -> dict:
        """Cross-entropy on generated (assistant) tokens only: the mask RL uses."""
        self._train_mode()
        total = float(batch.loss_mask.sum())
        loss_sum = 0.0
        lengths = batch.attention_mask.sum(-1)
        for idx in self.rows.share(torch.arange(len(lengths)), lengths, micro_batch_size):
            mb = self.rows.pass_batch(batch, idx, self.device)
            # SFT: the data's likelihood at T = 1, untruncated
            logp, _ = self._forward(self.model, mb, 1.0, truncate=False)
            loss = -(logp * mb.loss_mask).sum() / max(total, 1.0)
            loss.backward()
            loss_sum += float(loss.detach())
        loss_sum = self.rows.reduce({"sft_loss": loss_sum})["sft_loss"]
        return {"sft_loss": loss_sum, "grad_norm": self._step(max_grad_norm), "tokens": total}

    @torch.no_grad()
    def _logprobs(self, model: nn.Module, batch: Batch, micro_batch_size: int) -> torch.Tensor:
        model.eval()
        out = torch.zeros_like(batch.loss_mask)
        lengths = batch.attention_mask.sum(-1)
        for idx in self.rows.share(torch.arange(len(lengths)), lengths, micro_batch_size):
            mb = self.rows.pass_batch(batch, idx, self.device)
            put_rows(out, idx, self._forward(model, mb, self.temperature)[0])
        return self.rows.reduce_rows(out)

    def _reference_logprobs(self, ref: nn.Module, batch: Batch, micro_batch_size: int
                            ) -> torch.Tensor:
        """The reference model's logprobs (under LoRA the policy with its reference adapter:
        `train.lora.LoraTrainer`)."""
        return self._logprobs(ref, batch, micro_batch_size)

    def rl_step(
        self,
        batch: Batch,
        cfg: RLConfig,
        l_max: int,
        ref_model: nn.Module | None = None,
        critic: Critic | None = None,
        step: int = 0,
    ) -> dict[str, float]:
        """One update from a rollout batch: advantages by the configured estimator, then
        `cfg.ppo_epochs` passes over the batch, each split into `cfg.mini_batches` optimizer
        steps, with the policy loss times the off-policy weight (`rl.algorithm.off_policy`),
        plus the entropy bonus and KL term, times each row's `loss_weight`, aggregated over the
        optimizer batch; the critic, when there is one, learns after on the same epochs and
        mini-batches.

        logp_old is computed once, before the first update, with the weights at train start
        (the proximal policy; in sync mode also the weights that sampled the batch), so from
        the second optimizer step on rho = exp(logp - logp_old) moves away from 1 and the clip
        acts; its gap to the engine's logprobs is the rollout-vs-trainer mismatch metric. With a
        single optimizer step (one mini-batch, one epoch), no KL in the reward and a correction
        that does not declare `logp_prox` (`decoupled` and `decoupled_tis` do), the weights do
        not move before the gradient pass, so that pass's own (detached) logprobs are logp_old,
        the separate no-grad pass is skipped, and rho = 1 exactly (with dropout "off", also
        before the first update otherwise). Logprobs are of the sampler's truncated distribution.
        The reference model runs only while the KL coefficient (`kl_beta_at(step)`) is above 0.
        Staleness metrics compare `batch.sample_version` with the version at train start.
        """
        x = self._rl_inputs(batch, cfg, ref_model, critic, step)
        sums, updates = self._rl_updates(batch, cfg, l_max, x)
        metrics = _rl_metrics(batch, cfg, x, sums, updates)
        if critic is not None:
            assert x.values is not None and x.returns is not None
            metrics.update(critic.update(batch, x.returns, x.values, cfg, l_max))
        self.last_rl = RLStepTensors(x.logp_old, x.advantages)
        return metrics

    def _rl_inputs(self, batch: Batch, cfg: RLConfig, ref_model: nn.Module | None,
                   critic: Critic | None, step: int) -> _RLInputs:
        """What `rl_step` fixes before its first update (see `_RLInputs`)."""
        alg = cfg.algorithm
        mask = batch.loss_mask
        beta = kl_beta_at(step, alg.kl.beta, alg.kl.off_after)
        if beta > 0 and ref_model is None:
            raise ValueError("rl.algorithm.kl.beta > 0 needs a reference model")
        kl_in_rew = beta > 0 and alg.kl.placement == "reward"
        one_update = cfg.mini_batches == 1 and cfg.ppo_epochs == 1
        # a no-grad prepass fixes logp_old before any update: several updates anchor on it, the
        # reward penalty needs it first, and a correction declaring the proximal policy gets it
        proximal = "logp_prox" in OFF_POLICY.inputs[alg.off_policy]
        prepass = not one_update or kl_in_rew or proximal
        row_staleness = _row_staleness(self.version, batch.sample_version)
        micro = cfg.micro_batch_size
        logp_old = self._logprobs(self.model, batch, micro) if prepass else torch.zeros_like(mask)
        logp_ref = self._reference_logprobs(ref_model, batch, micro) if beta > 0 else None
        values = critic.values(batch, micro) if critic is not None else None
        kl_reward = None
        if kl_in_rew:
            kl_reward = kl_in_reward(torch.zeros_like(mask), logp_old, logp_ref, beta, mask)
        advantages, returns = compute_advantages(batch, alg, values, kl_reward)
        return _RLInputs(beta, beta > 0 and alg.kl.placement == "loss", prepass, logp_old,
                         logp_ref, values, kl_reward, advantages, returns, row_staleness)

    def _rl_updates(self, batch: Batch, cfg: RLConfig, l_max: int, x: _RLInputs
                    ) -> tuple[dict[str, float], int]:
        """`cfg.ppo_epochs` passes over the batch, each `cfg.mini_batches` optimizer steps:
        the sums of each micro-batch's terms (`_rl_backward`) and of the gradient norms, and
        the number of optimizer steps."""
        sums: dict[str, float] = defaultdict(float)
        norms = 0.0
        self._train_mode()
        steps = minibatches(batch, cfg.mini_batches, cfg.micro_batch_size, l_max)
        lengths = batch.attention_mask.sum(-1)
        for _epoch in range(cfg.ppo_epochs):
            for mini, _, totals in steps:
                for rows in self.rows.share(mini, lengths, cfg.micro_batch_size):
                    mb = self.rows.pass_batch(batch, rows, self.device)
                    terms = self._rl_backward(mb, rows, totals, cfg.algorithm, x)
                    for key, value in terms.items():
                        sums[key] += value
                norms += self._step(cfg.max_grad_norm)
        if not x.prepass:  # each rank filled its own rows of logp_old
            x.logp_old.copy_(self.rows.reduce_rows(x.logp_old))
        out = defaultdict(float, self.rows.reduce(sums))
        out["grad_norm"] = norms
        return out, cfg.ppo_epochs * len(steps)

    def _rl_backward(self, mb: Batch, rows: torch.Tensor, totals: dict[str, float],
                     alg: AlgorithmConfig, x: _RLInputs) -> dict[str, float]:
        """The gradient pass of one micro-batch `mb` (the batch's `rows`, on the device): the
        policy loss times the off-policy weight, plus the entropy bonus and the KL term, times
        each row's `loss_weight`, aggregated with the optimizer batch's `totals`; returns its
        loss, its summed entropy (and KL) over the mask and its clip counts."""
        dev, m = self.device, mb.loss_mask
        width = mb.input_ids.size(1)
        logp, ent = self._forward(self.model, mb, self.temperature, with_entropy=True)
        if not x.prepass:
            put_rows(x.logp_old, rows, logp.detach())
        old = _on(x.logp_old, rows, width, dev)
        loss_tok, stats = POLICY_LOSSES[alg.policy_loss](
            logp, old, _on(x.advantages, rows, width, dev), m,
            **POLICY_LOSSES.knob_values(alg.policy_loss, alg))  # exactly the declared knobs
        loss_tok = loss_tok * _correction(alg, x.prepass, old, mb.rollout_logprobs, m)[0]
        if alg.entropy_coef > 0:
            loss_tok = entropy_bonus(loss_tok, ent, alg.entropy_coef)
        terms: dict[str, float] = {}
        if x.kl_in_loss:
            assert x.logp_ref is not None
            kl = KL_ESTIMATORS[alg.kl.estimator](logp, _on(x.logp_ref, rows, width, dev))
            loss_tok = loss_tok + x.beta * kl
            terms["kl"] = float((kl.detach() * m).sum())
        # rl.env_error_weight: scales the row's loss, never its normalizers
        loss = AGGREGATIONS[alg.aggregation](loss_tok * mb.loss_weight[:, None], m, **totals)
        loss.backward()
        terms["loss"] = float(loss.detach())
        terms["entropy"] = float((ent.detach() * m).sum())
        for key in ("clipped", "clipped_low", "clipped_high", "dual_clipped"):
            terms[key] = float(stats[key].sum())  # stats are 0 off the mask
        return terms


def _rl_metrics(batch: Batch, cfg: RLConfig, x: _RLInputs, sums: dict[str, float],
                updates: int) -> dict[str, float]:
    """The step's metrics from its inputs and the sums of its passes (`_rl_updates`)."""
    alg, mask = cfg.algorithm, batch.loss_mask
    n_tok = max(float(mask.sum()), 1.0)
    seen = n_tok * cfg.ppo_epochs  # token visits: the per-token means below are over them
    weights = _correction(alg, x.prepass, x.logp_old, batch.rollout_logprobs, mask)
    metrics = {
        **mismatch_stats(batch.rollout_logprobs, x.logp_old, mask),
        # the weights the passes applied: a pure function of logp_old, fixed from the start
        **correction_stats(*weights, mask),
        **staleness_stats(batch.rollout_logprobs, x.logp_old, mask, x.row_staleness),
        "loss": sums["loss"] / updates,
        "grad_norm": sums["grad_norm"] / updates,
        "optimizer_steps": float(updates),
        "entropy": sums["entropy"] / seen,
        "clip_frac": sums["clipped"] / seen,
        "clip_frac_low": sums["clipped_low"] / seen,
        "clip_frac_high": sums["clipped_high"] / seen,
        "advantage_abs_mean": float((x.advantages.abs() * mask).sum()) / n_tok,
    }
    if alg.clip_ratio_c is not None:
        metrics["dual_clip_frac"] = sums["dual_clipped"] / seen
    if x.beta > 0:
        metrics["kl_beta"] = x.beta
        # the estimator in the loss, or k1 (what the reward pays) in the reward
        metrics["kl"] = (sums["kl"] / seen if x.kl_in_loss
                         else float(-x.kl_reward.sum()) / x.beta / n_tok)
    return metrics


def _correction(alg: AlgorithmConfig, prepass: bool, logp_old: torch.Tensor,
                logp_rollout: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured off-policy correction's (weight, stats). Behaviour = the rollout
    logprobs; the proximal policy is logp_old only when a prepass computed it (a correction
    that declares `logp_prox` is never called without one)."""
    return OFF_POLICY.call(alg.off_policy, alg, logp_old=logp_old, logp_rollout=logp_rollout,
                           logp_prox=logp_old if prepass else None,
                           logp_behaviour=logp_rollout, mask=mask)


def _row_staleness(version: int, sample_version: torch.Tensor) -> torch.Tensor:
    """[B] trainer version - each row's sample version; -1 where the version is unknown. A row
    sampled by weights newer than the trainer's is a pipeline bug: an error, never a metric."""
    known = sample_version >= 0
    if bool((sample_version[known] > version).any()):
        newest = int(sample_version.max())
        raise ValueError(f"batch rows were sampled by weight version {newest}, newer than the "
                         f"trainer's version {version}")
    return torch.where(known, version - sample_version, torch.full_like(sample_version, -1))
