"""An OpenEnv environment served locally, without Docker: guess a secret number from 1 to 16
in at most 6 guesses, with "higher"/"lower" hints; reward 1 for a hit.

It is written against openenv-core's own server API (Action, Observation, State, Environment,
create_app) and knows nothing about tiller. Serve it with

    python examples/openenv/guess_env.py --port 8000

and point a config at it (config.yaml here starts it itself: `env.openenv.command`).
"""

from __future__ import annotations

import argparse
import random
from uuid import uuid4

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app
from pydantic import Field

LOW, HIGH, TRIES = 1, 16, 6


class GuessAction(Action):
    guess: int = Field(..., ge=LOW, le=HIGH, description="your guess")


class GuessObservation(Observation):
    message: str = Field("", description="what the game says")
    tries_left: int = Field(TRIES, description="guesses left")


class GuessEnv(Environment):
    """One game per session; `reset(seed)` picks the secret from the seed."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._secret = LOW

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs) -> GuessObservation:
        self._secret = random.Random(seed).randint(LOW, HIGH)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(
            message=f"I picked a whole number from {LOW} to {HIGH}. Guess it: you have "
                    f"{TRIES} tries, and I say higher or lower after each.",
            tries_left=TRIES, done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs) -> GuessObservation:
        self._state.step_count += 1
        left = TRIES - self._state.step_count
        if action.guess == self._secret:
            return GuessObservation(message="Correct!", tries_left=left, done=True, reward=1.0)
        hint = "higher" if action.guess < self._secret else "lower"
        return GuessObservation(message=f"No: {hint}.", tries_left=left, done=left == 0,
                                reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def make_app(env_cls: type[Environment] = GuessEnv, action_cls: type[Action] = GuessAction):
    return create_app(env_cls, action_cls, GuessObservation, env_name="guess",
                      max_concurrent_envs=64)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(make_app(), host="127.0.0.1", port=args.port, log_level="warning")
