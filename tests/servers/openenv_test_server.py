"""examples/openenv/guess_env.py with what tests/test_openenv.py needs to see failures: a guess
of 13 makes the environment raise, 14 makes it hang for 3 s, 15 is an action the server's own
validator rejects (it passes the JSON schema), 11 one whose validator raises a plain ValueError
(which openenv-core 0.3 cannot serialize: it ends the session); each session's close is
appended to $OPENENV_CLOSE_LOG. `python openenv_test_server.py --port PORT`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import uvicorn
from pydantic import field_validator
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


class TestEnv(GuessEnv):
    def step(self, action, timeout_s=None, **kwargs):
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
    uvicorn.run(make_app(TestEnv, TestAction), host="127.0.0.1", port=args.port,
                log_level="warning")
