"""Logging (metrics backends, progress, report) and traces."""

from __future__ import annotations

from pydantic import Field

from tiller.config.base import Section


class LoggingConfig(Section):
    """Where metrics go (metrics.jsonl in the run folder always), and what the terminal shows."""

    tensorboard: bool = Field(True, description="write TensorBoard event files in the run "
                              "folder; needs tensorboard")
    wandb: bool = Field(False, description="log metrics and the config to Weights & Biases; "
                        "needs wandb and a login")
    wandb_project: str = Field("tiller", description="the W&B project runs are logged to")
    progress: bool = Field(True, description="progress bars on the terminal")
    report: bool = Field(True, description="write RUN_DIR/report.html (plots of the run) when "
                         "`train` ends, also after an error; needs tiller[report] (matplotlib)")


class TracesConfig(Section):
    """traces.sqlite: the run's episodes token by token (docs/traces.md)."""

    enabled: bool = Field(True, description="write traces.sqlite in the run folder")
    sample_rate: float = Field(
        1.0, ge=0.0, le=1.0, description="share of RL episodes kept, chosen by a hash of each "
        "episode's seed (the same episodes in every rl.mode; no RNG is drawn); every eval "
        "episode is kept")
    max_mb: float | None = Field(
        1024.0, gt=0, description="cap on the file's payload (arrays, messages, tool calls; "
        "what it already holds, e.g. a resumed run's, counts), in MiB; RL episodes past it are "
        "dropped and counted (traces/dropped_cap), eval "
        "episodes are always written (traces/eval_over_cap counts those past it); null: no cap")
    queue_size: int = Field(
        1024, ge=1, description="items waiting for the background writer; when full, RL items "
        "are dropped and counted (traces/dropped_queue) rather than slow training, eval "
        "episodes wait for room (at most close_timeout_s)")
    close_timeout_s: float = Field(
        120.0, gt=0, description="the longest wait for the writer to drain at the end of a "
        "run (or for room in the queue, for an eval episode)")


class ObserveConfig(Section):
    """What the run records beyond metrics."""

    traces: TracesConfig = Field(default_factory=TracesConfig,
                                 description="token-level traces (traces.sqlite)")
