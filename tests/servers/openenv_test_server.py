"""examples/openenv/guess_env.py with what tests/test_openenv.py needs to see failures: a guess
of 13 makes the environment raise, 14 makes it hang for 3 s, 15 is an action the server's own
validator rejects (it passes the JSON schema), 11 one whose validator raises a plain ValueError
(which openenv-core 0.3 cannot serialize: it ends the session); each session's close is
appended to $OPENENV_CLOSE_LOG; a reset's `greeting` field opens its first message. With
$OPENENV_TEXT_ACTION set the action is {"text": str} (the first number in it is the guess).
`python openenv_test_server.py --port PORT`."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import uvicorn
from openenv.core.env_server import Action
from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "openenv"))
from guess_env import GuessAction, GuessEnv, make_app  # noqa: E402


class TestAction(GuessAction):
    @field_validator("guess")
    @classmethod
    def _not_15(cls, v: int) -> int:
        if v == 15:
            raise PydanticCustomError("not_15", "15 is not allowed")
        if v == 11:
            raise ValueError("11 is not allowed")
        return v


class TextAction(Action):
    text: str = Field(..., description="your guess, in words and digits")


class TestEnv(GuessEnv):
    def reset(self, seed=None, episode_id=None, greeting=None, **kwargs):
        observation = super().reset(seed, episode_id, **kwargs)
        if greeting:
            observation.message = f"{greeting} {observation.message}"
        return observation

    def step(self, action, timeout_s=None, **kwargs):
        if isinstance(action, TextAction):
            digits = re.search(r"\d+", action.text)
            action = GuessAction(guess=min(max(int(digits.group()) if digits else 1, 1), 16))
        if action.guess == 13:
            raise RuntimeError("the environment broke on 13")
        if action.guess == 14:
            time.sleep(3)
        return super().step(action, timeout_s, **kwargs)

    def close(self) -> None:
        if os.environ.get("OPENENV_CLOSE_LOG"):
            with open(os.environ["OPENENV_CLOSE_LOG"], "a") as f:
                f.write(f"{self.state.episode_id}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    action = TextAction if os.environ.get("OPENENV_TEXT_ACTION") else TestAction
    uvicorn.run(make_app(TestEnv, action), host="127.0.0.1", port=args.port,
                log_level="warning")
