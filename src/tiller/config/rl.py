"""RL: steps, batch shape, optimizer, schedule (rl.mode), the algorithm, the curriculum and
judge shaping."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tiller.config.algorithm import AlgorithmConfig
from tiller.config.base import Variant, tagged
from tiller.config.curriculum import AnyCurriculumConfig, DifficultyCurriculumConfig
from tiller.config.judge import AnyJudgeConfig, JudgeConfig, NoJudgeConfig
from tiller.errors import ConfigError

# The off-policy correction where samples can be stale (rl.mode one_step_off, or async with
# max_staleness > 0) and rl.algorithm.off_policy is unset; docs/async.md says why.
STALE_OFF_POLICY = "mis"


class RLConfig(Variant):
    """RL's knobs every schedule shares, and what the trainer reads (`Trainer.rl_step`). The
    schedule, rl.mode, is the variant: `SyncRLConfig`, `OneStepOffRLConfig`, `AsyncRLConfig`.
    Built alone (the trainer's own tests) it has no schedule: its samples are on-policy."""

    steps: int = Field(30, ge=0, description="RL steps: each trains on tasks_per_step groups "
                       "with mini_batches * ppo_epochs optimizer steps; 0 skips RL")
    tasks_per_step: int = Field(16, ge=1, description="tasks (groups) trained on per RL step")
    group_size: int = Field(8, ge=1, description="episodes sampled per task (G); group "
                            "baselines (grpo, rloo, ...) compare a task's episodes")
    lr: float = Field(5e-4, gt=0, description="AdamW's learning rate for RL (constant)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay for RL")
    max_grad_norm: float = Field(1.0, gt=0, description="the gradient's global L2 norm is "
                                 "clipped to this before each optimizer step")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per pass over the batch")
    ppo_epochs: int = Field(
        1, ge=1, description="passes over each rollout batch (logp_old fixed before the first); "
        "with mini_batches 1 and ppo_epochs 1 the ratio is 1 and clipping never acts")
    micro_batch_size: int = Field(32, ge=1, description="rows per forward/backward pass "
                                  "(gradients accumulate over a mini-batch): memory, not the "
                                  "result")
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.99), description="AdamW's (beta1, beta2) for RL, each in [0, 1)")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW's epsilon for RL (added to the "
                            "root of the second moment)")
    env_error_weight: float = Field(
        0.0, ge=0.0, le=1.0,
        description="0 drops env_error trajectories; w > 0 keeps them in their group with "
                    "their loss scaled by w (once: masks and normalizers are untouched)")
    max_idle_steps: int = Field(
        3, ge=0,
        description="consecutive RL steps allowed with nothing to train because dynamic "
                    "sampling filtered every group as zero-variance (each is skipped, logged "
                    "`skipped` = 1, with a warning); one more stops the run. A step whose "
                    "episodes were all dropped (env or engine failures) stops it at once")
    max_aborted_frac: float = Field(
        0.1, ge=0.0, le=1.0,
        description="fail the run when more than this share of a step's (or an eval's) "
                    "episodes aborted (engine or loop failure), naming the first error")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="advantage estimator, policy loss, "
        "aggregation, KL, off-policy correction and their knobs, from a preset or by name "
        "(docs/algorithms.md)")
    reward_control: Literal["none", "random", "constant"] = Field(
        "none",
        description="the spurious-reward control (docs/evaluation.md): none trains on the "
                    "verifier's reward; random trains on the step's verifier rewards shuffled "
                    "across its trajectories (same mean and distribution, no link to what each "
                    "did); constant trains on rl.reward_control_value for every trajectory. "
                    "Logged success and every eval still use the verifier")
    reward_control_value: float | None = Field(
        None,
        description="reward_control constant only (default 0.0): the value every trajectory "
                    "trains on; under a group baseline (grpo, rloo, ...) every advantage is 0, "
                    "unless rl.algorithm.overlong.mode is soft: its length penalty is still "
                    "added per trajectory, so the advantages vary with length")
    curriculum: AnyCurriculumConfig = Field(
        default_factory=DifficultyCurriculumConfig, description="which train tasks RL draws "
        "(off by default)")
    judge: AnyJudgeConfig = Field(
        default_factory=NoJudgeConfig, description="judge shaping, gated behind the verifier "
        "(none by default)")

    @property
    def updates_per_step(self) -> int:
        """Weight versions one RL step advances (optimizer steps)."""
        return self.mini_batches * self.ppo_epochs

    @property
    def staleness_bound(self) -> int:
        """The most weight versions a trained token may lag the trainer: 0 on-policy (sync)."""
        return 0

    @classmethod
    def _can_be_stale(cls, data: dict[str, Any]) -> bool:
        """Whether samples can be older than the trainer's weights (`staleness_bound` > 0),
        from the raw values before validation."""
        return False

    @property
    def lag_steps(self) -> int:
        """How many RL steps ahead of the trainer the producer may start groups."""
        return self.staleness_bound // self.updates_per_step

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("expected two floats in [0, 1), e.g. [0.9, 0.99]")
        return betas

    @model_validator(mode="before")
    @classmethod
    def _stale_default_correction(cls, data: Any) -> Any:
        """Where samples can be stale, an rl.algorithm.off_policy left unset is
        STALE_OFF_POLICY (sync keeps none: its samples are on-policy)."""
        if not isinstance(data, dict) or not cls._can_be_stale(data):
            return data
        alg = data.get("algorithm")
        if isinstance(alg, AlgorithmConfig) and "off_policy" not in alg.model_fields_set:
            alg = alg.model_dump(exclude_unset=True)
        if alg is None:
            alg = {}
        if not isinstance(alg, dict) or "off_policy" in alg:
            return data
        return {**data, "algorithm": {**alg, "off_policy": STALE_OFF_POLICY}}

    @model_validator(mode="after")
    def _stale_samples_corrected(self) -> RLConfig:
        allow = self.algorithm.allow_uncorrected_off_policy
        if self.staleness_bound > 0 and self.algorithm.off_policy == "none" and not allow:
            raise ConfigError(f"config field rl.algorithm.off_policy: got 'none' with rl.mode "
                              f"{self._schedule()}, whose samples are stale: use a correction "
                              f"({STALE_OFF_POLICY}, the default here; or tis, decoupled, "
                              "seq_is), or set rl.algorithm.allow_uncorrected_off_policy: true "
                              "to train them as on-policy")
        if self.staleness_bound == 0 and allow is not None:
            raise ConfigError(f"config field rl.algorithm.allow_uncorrected_off_policy: got "
                              f"{allow}; it only applies where samples can be stale (rl.mode "
                              "one_step_off, or async with max_staleness > 0), and here they "
                              f"cannot{self.now()}")
        return self

    @model_validator(mode="after")
    def _steps_have_rows(self) -> RLConfig:
        rows = self.tasks_per_step * self.group_size
        if self.mini_batches > rows:
            raise ConfigError(f"config field rl.mini_batches: got {self.mini_batches}; expected "
                              f"at most rl.tasks_per_step * rl.group_size = {rows}")
        if self.reward_control_value is not None and self.reward_control != "constant":
            raise ConfigError(f"config field rl.reward_control_value: got "
                              f"{self.reward_control_value}; it only applies with "
                              f"rl.reward_control: constant (it is {self.reward_control})")
        if self.reward_control != "none" and isinstance(self.judge, JudgeConfig):
            field = type(self.judge).chosen_by
            raise ConfigError(f"config field {field}: got "
                              f"{getattr(self.judge, field.rsplit('.', 1)[1])!r}; the judge "
                              f"term is paid on the verifier's success, which would carry the "
                              f"signal rl.reward_control: {self.reward_control} removes (unset "
                              "one of them)")
        default = type(self).model_fields["max_idle_steps"].default
        if self.max_idle_steps != default and not self.algorithm.dynamic_sampling.enabled:
            raise ConfigError(f"config field rl.max_idle_steps: got {self.max_idle_steps}; it "
                              "only applies with rl.algorithm.dynamic_sampling.enabled: true")
        return self

    def _schedule(self) -> str:
        """The schedule in words, for messages."""
        return type(self).chosen_by.removeprefix("rl.mode: ")


MODE = ("sync: sample a step's groups, then train on them; one_step_off: sample step k+1 while "
        "step k trains (data one step stale); async: keep episodes running continuously and "
        "train on the first tasks_per_step groups that finish, within rl.max_staleness "
        "(docs/async.md)")


class SyncRLConfig(RLConfig):
    """Sample a step's groups with the current weights, then train on them: on-policy."""

    mode: Literal["sync"] = Field("sync", description=MODE)


class OneStepOffRLConfig(RLConfig):
    """Sample step k+1 while step k trains: every sample is one step (updates_per_step weight
    versions) stale."""

    mode: Literal["one_step_off"] = Field("one_step_off", description=MODE)

    @property
    def staleness_bound(self) -> int:
        return self.updates_per_step

    @classmethod
    def _can_be_stale(cls, data: dict[str, Any]) -> bool:
        return True


class AsyncRLConfig(RLConfig):
    """Keep episodes running and train on the first groups that finish, within a staleness
    bound (docs/async.md)."""

    mode: Literal["async"] = Field("async", description=MODE)
    max_staleness: int | None = Field(
        None, ge=0, description="the most weight versions a trained token may lag the trainer "
        "(trainer version - the oldest version that sampled the trajectory), default 4; 0 is "
        "on-policy. The producer does not start episodes that would exceed it; groups that "
        "still do are filtered (ledger filtered/stale)")

    @property
    def staleness_bound(self) -> int:
        return 4 if self.max_staleness is None else self.max_staleness

    @classmethod
    def _can_be_stale(cls, data: dict[str, Any]) -> bool:
        return data.get("max_staleness") != 0

    def _schedule(self) -> str:
        return f"async, max_staleness {self.staleness_bound}"


# the type of `rl`: chosen by rl.mode (default sync)
AnyRLConfig = tagged("rl", "mode", SyncRLConfig, OneStepOffRLConfig, AsyncRLConfig)
