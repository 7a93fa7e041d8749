"""Adapters: reasoning-gym datasets and Gymnasium-style text games as tiller environments.

* `ReasoningGymEnv`: tasks from any reasoning-gym generator (`pip install 'tiller[reasoning]'`),
  split by a hash of the question, `difficulty` mapped onto the dataset's curriculum level.
  Strict: only an answer in one final `<answer>...</answer>` is scored, and only a score of
  1.0 from the dataset's own `score_answer` counts (that scorer gives partial credit for an
  answer buried in longer text, which would teach the policy to ramble).
* `GymTextEnv`: wraps an env with the Gymnasium API over text (`reset(seed=) -> (obs, info)`,
  `step(text) -> (obs, reward, terminated, truncated, info)`): the assistant's text is the
  action, each observation comes back as a user message, the return is the reward.
  `GuessNumberGame` is a tiny real one (guess a number with higher/lower feedback).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import re
import string
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any, ClassVar

from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Env, StepResult, Task, ToolEnv, register_env
from tiller.envs.splits import draw_split, split_size, stable_id
from tiller.envs.verifiers import Reward, all_of, extract_tagged
from tiller.errors import require_package
from tiller.tools.registry import POLICY_ERRORS

try:  # the game subclasses gymnasium.Env when it is installed; the adapter only duck-types
    import gymnasium

    _GymBase: type = gymnasium.Env
except ImportError:  # pragma: no cover - exercised only without the `gym` extra
    gymnasium, _GymBase = None, object

logger = logging.getLogger(__name__)

# ---- reasoning-gym ---------------------------------------------------------------------------

RG_SYSTEM = ("Solve the problem. You may reason first; end your reply with the final answer "
             "alone inside <answer></answer>, e.g. <answer>42</answer>.")


@cache
def _scorer(dataset: str) -> Callable[[str | None, dict], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


def _rg_config(dataset: str, config: dict[str, Any], difficulty: int, seed: int,
               size: int) -> dict[str, Any]:
    """Explicit `config` wins; else the dataset's curriculum at level difficulty-1."""
    from reasoning_gym.factory import create_curriculum, has_curriculum

    if config or not has_curriculum(dataset):
        return {**config, "seed": seed, "size": size}
    curriculum = create_curriculum(dataset)
    curriculum.set_global_level(difficulty - 1)  # clipped to each attribute's top level
    return dataclasses.asdict(curriculum.generate_configuration({"seed": seed, "size": size}))


class ReasoningGymEnv(ToolEnv):
    """One reasoning-gym dataset; make a registered subclass with `reasoning_gym_env(name)`."""

    name: ClassVar[str] = "reasoning_gym"
    requires = {"reasoning_gym": "reasoning"}
    dataset: ClassVar[str] = "basic_arithmetic"
    config: ClassVar[dict[str, Any]] = {}

    def __init__(self, **kwargs: Any):
        super().__init__([], **kwargs)  # no tools: a tool call gets an "unknown tool" error

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int, difficulty: int = 1,
                   heldout_fraction: float = 0.2) -> list[Task]:  # type: ignore[override]
        reasoning_gym = require_package("reasoning_gym", "reasoning", f"env {cls.name}")

        def entries() -> Iterator[dict[str, Any]]:
            for chunk in range(1_000_000):  # chunks of the dataset, each with its own seed
                chunk_seed = random.Random(f"{seed}/{split}/{chunk}").randrange(2**31)
                cfg = _rg_config(cls.dataset, cls.config, difficulty, chunk_seed, max(n, 50))
                yield from reasoning_gym.create_dataset(cls.dataset, **cfg)

        it = entries()
        drawn = draw_split(split, n, random.Random(0), lambda _: next(it),
                           lambda e: e["question"], heldout_fraction)
        return [Task(id=stable_id("rg", f"{cls.dataset}/{e['question']}"), split=split,
                     prompt=e["question"], answer=e["answer"], system=RG_SYSTEM,
                     metadata={"entry": e, "dataset": cls.dataset}) for e in drawn]

    @staticmethod
    def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                    guess_prob: float = 0.0) -> str:
        """The ground truth in tags; with `guess_prob`, the same answer outside the format."""
        if rng.random() < guess_prob:
            return f"I think the answer is {task.answer}."
        return f"<answer>{task.answer}</answer>"

    async def verify(self, final: ParsedTurn | None) -> Reward:
        """Gated on the format and a full score. A scorer that raises is the env's failure
        (env_error, with the exception), not a 0 the policy would be trained on."""
        assert self.task is not None
        answer = extract_tagged(final.content) if final is not None else None
        if answer is None:
            return all_of(format_ok=False, score=0.0)
        meta = self.task.metadata
        try:
            score = float(_scorer(meta["dataset"])(answer, meta["entry"]))
        except Exception as e:  # any scorer bug: recorded and logged below, never dropped
            error = f"{meta['dataset']} scorer: {type(e).__name__}: {e}"
            logger.warning("env_error on task %s: %s", self.task.id, error)
            return Reward(0.0, {"format_ok": 1.0, "score": 0.0}, env_error=True, error=error)
        return all_of(format_ok=True, score=score)


def reasoning_gym_env(dataset: str, **config: Any) -> type[ReasoningGymEnv]:
    """Register (and return) an env named `reasoning_gym/<dataset>`; `config` overrides the
    dataset's own config fields (then `difficulty` is ignored)."""
    name = f"reasoning_gym/{dataset}"
    cls = type(f"ReasoningGym_{dataset}", (ReasoningGymEnv,),
               {"name": name, "dataset": dataset, "config": dict(config),
                "has_difficulty": not config})
    return register_env(cls)  # type: ignore[return-value]


for _dataset in ("basic_arithmetic", "chain_sum", "leg_counting", "spell_backward",
                 "word_sorting", "gsm_symbolic"):
    reasoning_gym_env(_dataset)


# ---- Gymnasium-style text envs ---------------------------------------------------------------


class GymTextEnv(Env):
    """A text env with the Gymnasium API as a tiller Env. Subclasses set `make_env`
    (difficulty -> a fresh env) and `expert_turn`. A task is an env seed; tasks are split by
    `info["instance"]` from reset when the env gives one (what the episode *is*, e.g. the
    secret), else by the opening observation."""

    make_env: ClassVar[Callable[[int], Any]]
    system: ClassVar[str | None] = None

    def __init__(self) -> None:
        self.inner: Any = None
        self.rewards: list[float] = []
        self.terminated = False
        self.invalid_actions = 0  # actions the wrapped env rejected (ValueError, TypeError...)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return []

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        self.inner = type(self).make_env(task.metadata["difficulty"])
        obs, _ = self.inner.reset(seed=task.metadata["env_seed"])
        self.rewards, self.terminated, self.invalid_actions = [], False, 0
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": obs}]

    async def step(self, action: ParsedTurn) -> StepResult:
        if action.tool_calls or action.parse_errors:
            msg = "error: this environment has no tools; reply with plain text"
            return StepResult([{"role": "user", "content": msg}], done=False)
        try:
            obs, reward, terminated, truncated, _ = self.inner.step(action.content)
        except POLICY_ERRORS as e:  # the env rejected the policy's action: its fault, no env_error
            self.invalid_actions += 1
            logger.info("%s: invalid action %r: %s: %s", type(self).__name__,
                        action.content[:100], type(e).__name__, e)
            msg = f"error: invalid action: {type(e).__name__}: {e}"
            return StepResult([{"role": "user", "content": msg}], done=False)
        self.rewards.append(float(reward))
        self.terminated = bool(terminated)
        return StepResult([{"role": "user", "content": obs}], done=terminated or truncated)

    async def close(self) -> None:
        if self.inner is not None and hasattr(self.inner, "close"):
            self.inner.close()

    async def verify(self, final: ParsedTurn | None) -> Reward:
        """The episode's return, the sum of the step rewards. They are not passed on as turn
        rewards: turn-level credit adds the outcome to the last turn, so passing both would
        count every step reward twice."""
        total = sum(self.rewards)
        return Reward(total, {"terminated": float(self.terminated), "return": total,
                              "invalid_actions": float(self.invalid_actions)})

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int, difficulty: int = 1,
                   heldout_fraction: float = 0.2) -> list[Task]:  # type: ignore[override]
        def draw(rng: random.Random) -> tuple[str, int, str]:
            env_seed = rng.randrange(2**31)
            obs, info = cls.make_env(difficulty).reset(seed=env_seed)
            return str(info.get("instance", obs)), env_seed, obs

        rng = random.Random(f"{cls.name}/{split}/{seed}/{difficulty}")
        drawn = draw_split(split, n, rng, draw, lambda d: d[0], heldout_fraction)
        return [Task(id=stable_id(cls.name, key), prompt=obs, answer=None, split=split,
                     system=cls.system,
                     metadata={"env_seed": env_seed, "difficulty": difficulty})
                for key, env_seed, obs in drawn]


class GuessNumberGame(_GymBase):  # type: ignore[misc, valid-type]
    """Guess a secret whole number in a range of `size` numbers (where the range starts is
    random too) with "Higher."/"Lower." feedback; reward 1 when right. There are enough tries
    for binary search plus one, so only a policy that uses the feedback wins reliably."""

    LOWS = range(1, 1001)  # where the range may start

    def __init__(self, size: int = 100):
        self.size, self.max_tries = size, math.ceil(math.log2(size + 1)) + 1
        self.low, self.secret, self.tries = 1, 1, 0
        if gymnasium is not None:
            self.action_space = gymnasium.spaces.Text(16, charset=string.printable)
            self.observation_space = gymnasium.spaces.Text(200, charset=string.printable)

    def reset(self, *, seed: int | None = None,
              options: dict | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self.low, self.tries = rng.choice(self.LOWS), 0
        high = self.low + self.size - 1
        self.secret = rng.randint(self.low, high)
        obs = (f"I'm thinking of a whole number from {self.low} to {high}. Guess it in at "
               f"most {self.max_tries} tries; reply with just the number.")
        return obs, {"instance": self.instance(self.low, self.secret)}

    def instance(self, low: int, secret: int) -> str:
        """What a game is: its range and its secret."""
        return f"{low}-{low + self.size - 1}:{secret}"

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.tries += 1
        m = re.fullmatch(r"\s*(-?\d+)\s*\.?\s*", action)
        guess = int(m.group(1)) if m else None
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {}
        if self.tries >= self.max_tries:
            return f"Out of tries; it was {self.secret}.", 0.0, False, True, {}
        if guess is None:
            return "Reply with just a whole number.", 0.0, False, False, {}
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False, False, {}


def _binary_search_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                        guess_prob: float = 0.0) -> str:
    """Keep the interval the feedback allows and guess its middle (with `guess_prob`, a
    random number in it instead)."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    guesses = [m["content"] for m in messages if m["role"] == "assistant"]
    bounds = re.search(r"from (\d+) to (\d+)", users[0])
    assert bounds is not None, "not a guess-the-number game"
    low, high = int(bounds.group(1)), int(bounds.group(2))
    for guess, feedback in zip(guesses, users[1:], strict=False):
        if feedback.startswith("Higher") and guess.strip().isdigit():
            low = max(low, int(guess) + 1)
        elif feedback.startswith("Lower") and guess.strip().isdigit():
            high = min(high, int(guess) - 1)
    guess = rng.randint(low, high) if rng.random() < guess_prob else (low + high) // 2
    return str(guess)


@register_env
class GuessNumberEnv(GymTextEnv):
    name = "guess_number"
    system = "Play the game. Reply to each message with your next move only."
    make_env = staticmethod(lambda difficulty: GuessNumberGame(size=10 * 2**difficulty))
    expert_turn = staticmethod(_binary_search_turn)

    @staticmethod
    def task_space(split: str, difficulty: int, heldout_fraction: float = 0.2) -> int:
        """Distinct games of `split`: 1000 range starts times `size` secrets, counted by hash
        up to 200,000 games, the expected share beyond."""
        game = GuessNumberEnv.make_env(difficulty)
        if len(game.LOWS) * game.size > 200_000:
            return split_size(len(game.LOWS) * game.size, split, heldout_fraction)
        keys = (game.instance(low, low + i) for low in game.LOWS for i in range(game.size))
        return split_size(keys, split, heldout_fraction)
