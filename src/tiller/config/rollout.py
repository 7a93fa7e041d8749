"""How the rollout manager runs episodes during RL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tiller.config.base import Section


class RolloutConfig(Section):
    """How the rollout manager runs episodes during RL (docs/async.md)."""

    max_inflight: int | None = Field(
        None, ge=1,
        description="async only: the most episodes running at once (default: no bound but "
                    "the staleness one); at least rl.group_size, since a group starts whole")
    partial: Literal["continue", "abort_resume"] = Field(
        "continue",
        description="a turn being generated when new weights arrive: continue under the new "
                    "weights (each token records its version) or abort it and resume it "
                    "under the new weights (the tokens so far are kept, none is sampled twice)")
    batch_timeout_s: float = Field(
        1800.0, gt=0,
        description="the most the trainer waits for one step's groups before the run stops "
                    "with an error naming what it waited for")
    shutdown_timeout_s: float = Field(
        60.0, gt=0,
        description="at the end of RL, how long episodes still running get to wind down "
                    "(their requests are aborted) before they are cancelled; every one is "
                    "counted in the ledger either way")
