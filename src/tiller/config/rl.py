"""RL: steps, batch shape, optimizer, schedule (rl.mode), the algorithm, the curriculum and
judge shaping."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tiller.config.algorithm import AlgorithmConfig
from tiller.config.base import Section
from tiller.errors import ConfigError


class CurriculumConfig(Section):
    """Which train tasks RL draws, kept in a success band (docs/curriculum.md): `difficulty`
    moves the env.difficulty the tasks are made at toward the level whose running success
    estimate is inside the band; `filter` draws tasks from a fixed pool at env.difficulty
    and skips those whose own estimate is outside it. Held-out eval stays at env.difficulty."""

    enabled: bool = Field(False, description="draw RL tasks through the curriculum")
    mode: Literal["difficulty", "filter"] = Field(
        "difficulty", description="difficulty: adapt the level tasks are made at; filter: "
        "skip pool tasks whose success estimate is outside the band")
    band: tuple[float, float] = Field(
        (0.3, 0.7), description="[low, high] success rate a task (or level) should have: "
        "above high it is too easy, below low too hard, to teach much")
    window: int = Field(8, ge=1, description="the running estimate is the mean success over "
                        "the last `window` finished groups of the level (or task)")
    min_groups: int = Field(
        2, ge=1, description="difficulty: groups finished at the current level since it was "
        "entered before it may move again; filter: groups of a task before it may be skipped")
    min_level: int | None = Field(
        None, ge=1, le=10, description="difficulty only: the lowest level (default 1); the "
        "highest is env.difficulty, the target")
    start: int | None = Field(None, ge=1, le=10, description="difficulty only: the level the "
                              "run starts at (default min_level)")
    pool: int | None = Field(None, ge=1, description="filter only: train tasks in the pool, "
                             "made at env.difficulty and drawn round-robin (default 64)")
    max_skips: int | None = Field(
        None, ge=1, description="filter only: draws in a row a task may be skipped before it "
        "is drawn anyway, to re-estimate it under the current policy (default 4)")

    @model_validator(mode="after")
    def _valid(self) -> CurriculumConfig:
        low, high = self.band
        if not 0.0 <= low < high <= 1.0:
            raise ConfigError(f"config field rl.curriculum.band: got {list(self.band)}; "
                              "expected [low, high] with 0 <= low < high <= 1")
        if self.min_groups > self.window:  # an estimate never holds more than `window`
            raise ConfigError(f"config field rl.curriculum.min_groups: got {self.min_groups}; "
                              f"expected at most rl.curriculum.window = {self.window}")
        other = {"difficulty": ("pool", "max_skips"), "filter": ("min_level", "start")}
        for name in other[self.mode]:
            if getattr(self, name) is not None:
                raise ConfigError(f"config field rl.curriculum.{name}: got "
                                  f"{getattr(self, name)!r}; it is not used with "
                                  f"rl.curriculum.mode: {self.mode}")
        if self.start is not None and self.start < (self.min_level or 1):
            raise ConfigError(f"config field rl.curriculum.start: got {self.start}; expected "
                              f"at least rl.curriculum.min_level = {self.min_level or 1}")
        return self


JUDGE_PROMPT = ("Question: {question}\nProposed answer: {answer}\nIs the proposed answer "
                "correct? Answer yes or no.\nAnswer:")


class JudgeConfig(Section):
    """An optional judge score as a shaping term, paid only where the verifier says success
    (docs/algorithms.md, "Judge shaping"): a judge can be gamed, so it never pays for a wrong
    answer, and a detector warns when its score rises while success does not."""

    fn: str | None = Field(
        None, description="dotted path of fn(task, trajectory) -> float in [0, 1], e.g. "
        "tiller.train.judges:grounded_answer; null: no judge (or rl.judge.model)")
    model: str | None = Field(
        None, description="local path of a Hugging Face causal LM and tokenizer that judges "
        "instead of fn (tiller.train.judges.ModelJudge): the score is P(yes) / (P(yes) + "
        "P(no)) of its continuation after `prompt`; a frozen copy, e.g. the policy's start "
        "checkpoint for self-reflection")
    prompt: str = Field(
        JUDGE_PROMPT, description="rl.judge.model's prompt: {question} (the task's prompt) and "
        "{answer} (the episode's final assistant text) are filled in; the judge then scores "
        "the continuations ' yes' and ' no'")
    weight: float = Field(0.1, ge=0.0, description="reward = verifier + weight * judge on "
                          "successful episodes; the verifier's value elsewhere")
    window: int = Field(3, ge=1, description="hacking detector: RL steps per window; the last "
                        "window is compared with the one before it")
    margin: float = Field(0.05, ge=0.0, description="hacking detector: a judge-mean rise above "
                          "this while success rose by no more than this is suspected hacking")

    @model_validator(mode="after")
    def _valid(self) -> JudgeConfig:
        if self.fn is not None and self.model is not None:
            raise ConfigError(f"config field rl.judge.model: got {self.model!r} with rl.judge.fn "
                              f"{self.fn!r}; a run has one judge (unset one of them)")
        if self.model is None and self.prompt != JUDGE_PROMPT:
            raise ConfigError("config field rl.judge.prompt: it only applies with "
                              "rl.judge.model (the model judge); set one or unset the prompt")
        if not self.enabled:
            for name in ("weight", "window", "margin"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ConfigError(f"config field rl.judge.{name}: got "
                                      f"{getattr(self, name)!r}; it only applies with a judge "
                                      "(rl.judge.fn or rl.judge.model)")
        try:
            filled = self.prompt.format(question="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"config field rl.judge.prompt: {type(e).__name__}: {e}; only "
                              "{question} and {answer} are filled in (double other braces)"
                              ) from e
        if "{answer}" not in self.prompt or filled == self.prompt:
            raise ConfigError("config field rl.judge.prompt: it must contain {answer}, the "
                              "episode's final text the judge scores")
        return self

    @property
    def enabled(self) -> bool:
        return self.fn is not None or self.model is not None


# The off-policy correction where samples can be stale (rl.mode one_step_off, or async with
# max_staleness > 0) and rl.algorithm.off_policy is unset; docs/async.md says why.
STALE_OFF_POLICY = "mis"


def _can_be_stale(mode: Any, max_staleness: Any) -> bool:
    """Whether samples can be older than the trainer's weights (RLConfig.staleness_bound > 0),
    from the raw values before validation."""
    return mode == "one_step_off" or (mode == "async" and max_staleness != 0)


class RLConfig(Section):
    steps: int = Field(30, ge=0)
    tasks_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    mini_batches: int = Field(1, ge=1, description="optimizer steps per pass over the batch")
    ppo_epochs: int = Field(
        1, ge=1, description="passes over each rollout batch (logp_old fixed before the first); "
        "with mini_batches 1 and ppo_epochs 1 the ratio is 1 and clipping never acts")
    micro_batch_size: int = Field(32, ge=1)
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
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="sync: sample a step's groups, then train on them; one_step_off: sample "
                    "step k+1 while step k trains (data one step stale); async: keep episodes "
                    "running continuously and train on the first tasks_per_step groups that "
                    "finish, within rl.max_staleness (docs/async.md)")
    max_staleness: int | None = Field(
        None, ge=0,
        description="async only (default 4): the most weight versions a trained token may lag "
                    "the trainer (trainer version - the oldest version that sampled the "
                    "trajectory). The producer does not start episodes that would exceed it; "
                    "groups that still do are filtered (ledger filtered/stale)")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
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
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig,
                                         description="which train tasks RL draws")
    judge: JudgeConfig = Field(default_factory=JudgeConfig,
                               description="judge shaping, gated behind the verifier")

    @property
    def updates_per_step(self) -> int:
        """Weight versions one RL step advances (optimizer steps)."""
        return self.mini_batches * self.ppo_epochs

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained token may lag: 0 in sync, one step in one_step_off."""
        if self.mode == "async":
            return 4 if self.max_staleness is None else self.max_staleness
        return self.updates_per_step if self.mode == "one_step_off" else 0

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
        if not isinstance(data, dict) or not _can_be_stale(data.get("mode", "sync"),
                                                           data.get("max_staleness")):
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
            where = "one_step_off" if self.mode == "one_step_off" else (
                f"async, max_staleness {self.staleness_bound}")
            raise ConfigError(f"config field rl.algorithm.off_policy: got 'none' with rl.mode "
                              f"{where}, whose samples are stale: use a correction "
                              f"({STALE_OFF_POLICY}, the default here; or tis, decoupled, "
                              "seq_is), or set rl.algorithm.allow_uncorrected_off_policy: true "
                              "to train them as on-policy")
        if self.staleness_bound == 0 and allow is not None:
            raise ConfigError(f"config field rl.algorithm.allow_uncorrected_off_policy: got "
                              f"{allow}; it only applies where samples can be stale (rl.mode "
                              "one_step_off, or async with max_staleness > 0), and here they "
                              f"cannot (rl.mode {self.mode})")
        return self

    @model_validator(mode="after")
    def _steps_have_rows(self) -> RLConfig:
        rows = self.tasks_per_step * self.group_size
        if self.mini_batches > rows:
            raise ConfigError(f"config field rl.mini_batches: got {self.mini_batches}; expected "
                              f"at most rl.tasks_per_step * rl.group_size = {rows}")
        if self.max_staleness is not None and self.mode != "async":
            raise ConfigError(f"config field rl.max_staleness: got {self.max_staleness}; it "
                              f"only applies with rl.mode: async (rl.mode is {self.mode})")
        if self.reward_control_value is not None and self.reward_control != "constant":
            raise ConfigError(f"config field rl.reward_control_value: got "
                              f"{self.reward_control_value}; it only applies with "
                              f"rl.reward_control: constant (it is {self.reward_control})")
        if self.reward_control != "none" and self.judge.enabled:
            field = "fn" if self.judge.fn is not None else "model"
            raise ConfigError(f"config field rl.judge.{field}: got "
                              f"{getattr(self.judge, field)!r}; the judge "
                              f"term is paid on the verifier's success, which would carry the "
                              f"signal rl.reward_control: {self.reward_control} removes (unset "
                              "one of them)")
        default = type(self).model_fields["max_idle_steps"].default
        if self.max_idle_steps != default and not self.algorithm.dynamic_sampling.enabled:
            raise ConfigError(f"config field rl.max_idle_steps: got {self.max_idle_steps}; it "
                              "only applies with rl.algorithm.dynamic_sampling.enabled: true")
        return self
