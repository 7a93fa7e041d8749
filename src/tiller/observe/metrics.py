"""Observation: metrics to JSONL (always) and TensorBoard / W&B (when installed and enabled),
and live progress bars for long phases."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tiller.errors import require_package
from tiller.files import open_append, refuse_links


def check_backends(tensorboard: bool, wandb: bool) -> None:
    """A logging backend the config turns on must be installed: one line at start-up if not,
    rather than a run that silently logs nowhere."""
    if tensorboard:
        require_package("tensorboard", "tensorboard", "logging.tensorboard=true",
                        instead="set logging.tensorboard=false")
    if wandb:
        require_package("wandb", "wandb", "logging.wandb=true", instead="set logging.wandb=false")


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb: bool = False,
                 wandb_project: str = "tiller", config: dict[str, Any] | None = None):
        self.path = run_dir / "metrics.jsonl"
        check_backends(tensorboard, wandb)
        # TensorBoard and W&B write files of their own inside these folders
        refuse_links(run_dir / "tensorboard", run_dir / "wandb")
        self._file = open_append(self.path, root=run_dir)
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb:
            import wandb as wb

            self._wandb = wb.init(project=wandb_project, dir=str(run_dir), config=config)

    def log(self, phase: str, step: int, metrics: dict[str, Any],
            phase_step: int | None = None) -> None:
        """One record at global `step` (monotonic over the whole run, so TensorBoard and W&B
        keep every phase's curve); the phase is in each scalar's name (`rl/reward_mean`) and
        `phase_step` counts within the phase (SFT step, RL step)."""
        record = {"phase": phase, "step": step, "time": time.time(), **metrics}
        if phase_step is not None:
            record["phase_step"] = phase_step
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {f"{phase}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def synced_size(self) -> int:
        """metrics.jsonl's length once every row so far is on disk (fsynced): what a
        checkpoint records, so a resume after a power loss finds the file at least as long."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


@contextmanager
def progress(enabled: bool, description: str, total: int) -> Iterator[Callable[[str], None]]:
    """A live progress bar for one phase; yields `advance(info)`, which moves it one step and
    shows `info` (reward, success, loss) beside it."""
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}"), disable=not enabled)
    with bar:
        task = bar.add_task(description, total=total, info="")
        yield lambda info: bar.update(task, advance=1, info=info)
