"""Supervised fine-tuning before RL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tiller.config.base import Section


class SFTConfig(Section):
    """Supervised fine-tuning before RL: on the env's scripted-expert demonstrations, or on
    the conversations of data.sft."""

    enabled: bool = Field(True, description="supervised fine-tuning before RL")
    tasks: int = Field(2000, ge=1, description="expert demonstrations (one per train task)")
    imperfect_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="share of demonstrations that guess without the tool"
    )
    difficulty: int | None = Field(
        None, ge=1, le=10, description="difficulty of the demonstrations' train tasks (default "
        "env.difficulty); lower than env.difficulty = demonstrations of only the easier part "
        "of the distribution RL trains on")
    epochs: int = Field(2, ge=1, description="passes over the demonstrations")
    batch_size: int = Field(64, ge=1, description="demonstrations per optimizer step")
    micro_batch_size: int = Field(32, ge=1, description="demonstrations per forward/backward "
                                  "(gradient accumulation up to batch_size)")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(20, ge=0, description="linear warmup steps")
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="after warmup: cosine decay to 0, or constant")
