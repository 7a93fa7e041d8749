"""The curriculum: which train tasks RL draws, kept inside a success band (docs/curriculum.md).

The rollout manager pulls tasks from an iterator, lazily, one per group it starts; a
curriculum is such an iterator that also hears back: `record(task, trajectories)` is called
for every group that finishes, and the next draws follow what it heard.

    difficulty  tasks are made at one of the levels min_level..env.difficulty; each level
                keeps a running success estimate (the mean over its last `window` groups),
                and the level moves up when its estimate is above the band, down when below
    filter      tasks come round-robin from a pool made at env.difficulty; a task whose own
                estimate is outside the band is skipped (counted), up to `max_skips` draws
                in a row, then drawn again so its estimate follows the policy

Every group carries its draw number, and an estimate is over the last groups by draw number,
not by arrival: in rl.mode sync every group drawn before a step has finished when the next
step draws, so the draws depend on the seed only. In one_step_off and async they also depend
on which groups have finished by then, like everything else there.

Draws come from the rollout thread and `record` too, `metrics` from the trainer's: one lock.

A resumable checkpoint holds a curriculum's whole state (`state`, JSON data: the draw and skip
counters, the estimates, and difficulty's level and tasks taken per level, or filter's
generator, pass order and skips in a row); `load_state` puts it back into a curriculum built
for the resumed run, before it draws (docs/resume.md).
"""

from __future__ import annotations

import itertools
import random
import threading
from abc import abstractmethod
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from tiller.config import Config
from tiller.envs.base import Env, Task
from tiller.errors import ConfigError
from tiller.rollout.trajectory import Status, Trajectory, is_success

LEVEL, DRAW = "curriculum_level", "curriculum_draw"  # what a drawn task's metadata gains


def group_success(trajectories: Sequence[Trajectory]) -> float | None:
    """The share of a group's episodes that succeeded; env errors and aborts say nothing about
    the task's difficulty and are left out (None when nothing is left)."""
    judged = [t for t in trajectories if t.status not in (Status.ENV_ERROR, Status.ABORTED)]
    return sum(map(is_success, judged)) / len(judged) if judged else None


class _Estimates:
    """Running success per key (a level or a task id): the mean over the last `window`
    groups by draw number."""

    def __init__(self, window: int):
        self.window = window
        self.results: dict[object, list[tuple[int, float]]] = defaultdict(list)

    def add(self, key: object, draw: int, success: float) -> None:
        results = self.results[key]
        results.append((draw, success))
        results.sort()
        del results[: -self.window]  # only the last window counts

    def get(self, key: object, since: int = -1) -> tuple[float | None, int]:
        """(the mean over its groups of the window drawn at or after `since`, how many):
        a level re-entered is judged on what it did since, not on why it was left."""
        fresh = [s for draw, s in self.results.get(key, []) if draw >= since]
        return (sum(fresh) / len(fresh) if fresh else None), len(fresh)

    def state(self, reopened: frozenset[int]) -> list[list[Any]]:
        """[key, [[draw, success], ...]] per key, without the groups drawn `reopened`."""
        return [[key, [[d, s] for d, s in results if d not in reopened]]
                for key, results in self.results.items()]

    def load_state(self, state: list[list[Any]]) -> None:
        self.results.clear()
        for key, results in state:
            self.results[key] = [(d, s) for d, s in results]


class Curriculum(Iterator[Task]):
    """Base of both modes: the band, the estimates, the draw counter and the lock."""

    def __init__(self, cfg: Config):
        c = cfg.rl.curriculum
        self.low, self.high = c.band
        self.min_groups = c.min_groups
        self.estimates = _Estimates(c.window)
        self.draws = 0
        self.skipped = 0  # tasks passed over because their estimate was outside the band
        self._skipped_logged = 0
        self._lock = threading.Lock()

    def __next__(self) -> Task:
        with self._lock:
            task, level = self._draw()
            draw = self.draws
            self.draws += 1
        return replace(task, metadata={**task.metadata, LEVEL: level, DRAW: draw})

    def record(self, task: Task, trajectories: Sequence[Trajectory]) -> None:
        """A group of `task` (a task this curriculum drew) finished."""
        success = group_success(trajectories)
        if success is None:
            return
        with self._lock:
            self.estimates.add(self._key(task), task.metadata[DRAW], success)

    def metrics(self) -> dict[str, float]:
        """`curriculum/*` for the step log: the level drawn from, skips since the last call,
        and the estimate of every level (difficulty) or the pool's state (filter)."""
        with self._lock:
            m = {"curriculum/skipped": float(self.skipped - self._skipped_logged),
                 "curriculum/skipped_total": float(self.skipped), **self._metrics()}
            self._skipped_logged = self.skipped
        return m

    def state(self, reopened: frozenset[int] = frozenset()) -> dict[str, Any]:
        """Everything the next draws and metrics depend on, as JSON data (a resumable
        checkpoint's `curriculum`). `reopened`: the draw numbers of the groups a checkpoint
        holds open (one_step_off, async), whose results are left out of the estimates: the
        resumed run samples those groups again and records them anew."""
        with self._lock:
            return {"draws": self.draws, "skipped": self.skipped,
                    "skipped_logged": self._skipped_logged,
                    "estimates": self.estimates.state(reopened), **self._state()}

    def load_state(self, state: dict[str, Any], where: str) -> None:
        """Put back what `state` returned, before the first draw; a task the checkpoint drew
        that the env does not make again is one line (`ConfigError`) starting with `where`."""
        with self._lock:
            self.draws, self.skipped = state["draws"], state["skipped"]
            self._skipped_logged = state["skipped_logged"]
            self.estimates.load_state(state["estimates"])
            self._load_state(state, where)

    @abstractmethod
    def _state(self) -> dict[str, Any]:
        """The mode's own state (under the lock)."""

    @abstractmethod
    def _load_state(self, state: dict[str, Any], where: str) -> None: ...

    @abstractmethod
    def _draw(self) -> tuple[Task, int]:
        """The next task and the level it was made at (under the lock)."""

    @abstractmethod
    def _key(self, task: Task) -> object:
        """What a finished group of `task` is estimated under: its level, or its id."""

    @abstractmethod
    def _metrics(self) -> dict[str, float]: ...


class DifficultyCurriculum(Curriculum):
    """Tasks made at the current level; the level moves toward the band.

    When the current level has at least `min_groups` groups drawn since it was entered, their
    mean decides: above the band, one level up (if there is one); below, one level down.
    Each level's tasks are `make_tasks(train, n, seed + 3, level)`, made the first time the
    level is visited and drawn in order, so a task is never drawn twice.
    """

    def __init__(self, cfg: Config, env_cls: type[Env], tasks_per_level: int):
        super().__init__(cfg)
        c = cfg.rl.curriculum
        self.levels = list(range(c.min_level or 1, cfg.env.difficulty + 1))
        self.level = c.start or self.levels[0]
        self.entered = 0  # the draw number at which the current level was entered
        self.moves = 0
        self.steps = cfg.rl.steps  # what sets tasks_per_level (named by `load_state`)
        self._make = lambda level: env_cls.make_tasks("train", tasks_per_level, cfg.seed + 3,
                                                      level)
        self._tasks: dict[int, Iterator[Task]] = {}
        self._taken: dict[int, list[str]] = defaultdict(list)  # level -> ids drawn, in order

    def _key(self, task: Task) -> object:
        return task.metadata[LEVEL]

    def _state(self) -> dict[str, Any]:
        return {"level": self.level, "entered": self.entered, "moves": self.moves,
                "taken": [[level, ids] for level, ids in self._taken.items()]}

    def _load_state(self, state: dict[str, Any], where: str) -> None:
        """Each level visited is made again and the tasks the checkpoint took from it are
        taken again: they must be the ones it took (`make_tasks` of the resumed config's
        count, which rl.steps sets, may give other first tasks)."""
        self.level, self.entered, self.moves = state["level"], state["entered"], state["moves"]
        for level, ids in state["taken"]:
            tasks = iter(self._make(level))
            got = [t.id for t in itertools.islice(tasks, len(ids))]
            if got != ids:
                raise ConfigError(f"{where}: config field rl.steps is {self.steps}: the env's "
                                  f"first {len(ids)} train tasks at curriculum level {level} "
                                  f"are not those the checkpoint drew there (make_tasks gives "
                                  f"other first tasks for this config's task count); resume "
                                  f"with the run's rl.steps")
            self._tasks[level], self._taken[level] = tasks, list(ids)

    def _draw(self) -> tuple[Task, int]:
        estimate, fresh = self.estimates.get(self.level, since=self.entered)
        if estimate is not None and fresh >= self.min_groups:
            i = self.levels.index(self.level)
            step = 1 if estimate > self.high else -1 if estimate < self.low else 0
            if 0 <= i + step < len(self.levels) and step:
                self.level, self.entered = self.levels[i + step], self.draws
                self.moves += 1
        if self.level not in self._tasks:
            self._tasks[self.level] = iter(self._make(self.level))
        task = next(self._tasks[self.level], None)
        if task is None:  # check_curriculum sized every level for the whole run
            raise ConfigError(f"config field rl.curriculum: level {self.level} ran out of "
                              f"train tasks after {self.draws} draws")
        self._taken[self.level].append(task.id)
        return task, self.level

    def _metrics(self) -> dict[str, float]:
        m = {"curriculum/difficulty": float(self.level), "curriculum/moves": float(self.moves)}
        for level in self.levels:
            estimate, _ = self.estimates.get(level)
            if estimate is not None:
                m[f"curriculum/estimate/{level}"] = estimate
        return m


class FilterCurriculum(Curriculum):
    """Tasks from a fixed pool at env.difficulty, in a seeded order reshuffled every pass; a
    task whose estimate (after `min_groups` groups) is outside the band is skipped, at most
    `max_skips` draws in a row. One draw therefore passes over at most
    pool * max_skips tasks: it always ends."""

    def __init__(self, cfg: Config, env_cls: type[Env]):
        super().__init__(cfg)
        c = cfg.rl.curriculum
        self.max_skips = c.max_skips or 4
        self.pool = env_cls.make_tasks("train", c.pool or 64, cfg.seed + 3, cfg.env.difficulty)
        self._rng = random.Random(f"curriculum/{cfg.seed}")
        self._order: list[Task] = []
        self._skips: dict[str, int] = defaultdict(int)  # task id -> skips in a row
        self.difficulty = cfg.env.difficulty
        self.env = cfg.env.name

    def _key(self, task: Task) -> object:
        return task.id

    def _state(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss],
                "order": [t.id for t in self._order],
                "skips": {task_id: n for task_id, n in self._skips.items() if n}}

    def _load_state(self, state: dict[str, Any], where: str) -> None:
        """The pass order's tasks are the pool's (made again from the config): one the pool
        no longer holds is one line."""
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        pool = {t.id: t for t in self.pool}
        lost = [task_id for task_id in state["order"] if task_id not in pool]
        if lost:
            raise ConfigError(f"{where}: the curriculum's pool (rl.curriculum.pool "
                              f"{len(self.pool)} tasks of env {self.env}) no longer holds "
                              f"task {lost[0]!r} the checkpoint's pass was to draw: the env's "
                              f"make_tasks changed; resume with the env the run used")
        self._order = [pool[task_id] for task_id in state["order"]]
        self._skips.clear()
        self._skips.update(state["skips"])

    def _draw(self) -> tuple[Task, int]:
        while True:
            if not self._order:
                self._order = self._rng.sample(self.pool, len(self.pool))
            task = self._order.pop()
            estimate, fresh = self.estimates.get(task.id)
            outside = estimate is not None and not self.low <= estimate <= self.high
            if outside and fresh >= self.min_groups and self._skips[task.id] < self.max_skips:
                self._skips[task.id] += 1
                self.skipped += 1
                continue
            self._skips[task.id] = 0
            return task, self.difficulty

    def _metrics(self) -> dict[str, float]:
        seen = [e for e in (self.estimates.get(t.id)[0] for t in self.pool) if e is not None]
        inside = sum(self.low <= e <= self.high for e in seen)
        return {"curriculum/difficulty": float(self.difficulty),
                "curriculum/pool_estimated": float(len(seen)),
                "curriculum/pool_in_band": inside / len(seen) if seen else 0.0,
                "curriculum/pool_too_easy": sum(e > self.high for e in seen) / max(len(seen), 1),
                "curriculum/pool_too_hard": sum(e < self.low for e in seen) / max(len(seen), 1)}


def check_curriculum(cfg: Config, env_cls: type[Env], tasks_needed: int) -> None:
    """Before any work: every level of a difficulty curriculum holds the `tasks_needed` train
    tasks the run may draw from it (all of them, at worst), a filter pool fits the env, and
    a difficulty curriculum has an env whose tasks depend on difficulty (`Env.has_difficulty`)."""
    c = cfg.rl.curriculum
    if not c.enabled:
        return
    if c.mode == "difficulty" and not env_cls.has_difficulty:
        raise ConfigError(f"config field rl.curriculum.mode: got 'difficulty'; env "
                          f"{env_cls.name} makes the same tasks at every difficulty, so there "
                          f"is no level to adapt: expected rl.curriculum.mode: filter")
    if c.mode == "filter":
        wants = {cfg.env.difficulty: c.pool or 64}
    else:
        wants = {level: tasks_needed for level in range(c.min_level or 1, cfg.env.difficulty + 1)}
    for level, n in wants.items():
        space = env_cls.task_space("train", level)
        if space is None or n <= space:
            continue
        if c.mode == "filter":
            raise ConfigError(f"config field rl.curriculum.pool: got {n}; env {env_cls.name} "
                              f"has only {space} train tasks at env.difficulty={level}")
        raise ConfigError(f"config field rl.curriculum.min_level: got {c.min_level or 1}; env "
                          f"{env_cls.name} has only {space} train tasks at difficulty {level} "
                          f"and the run may draw {n} there (rl.steps x rl.tasks_per_step): "
                          f"raise rl.curriculum.min_level or draw fewer")


def make_curriculum(cfg: Config, env_cls: type[Env], tasks_per_level: int) -> Curriculum | None:
    """The curriculum that `rl.curriculum` asks for, or None when it is off (`Run` has run
    `check_curriculum` before any work)."""
    c = cfg.rl.curriculum
    if not c.enabled:
        return None
    if c.mode == "filter":
        return FilterCurriculum(cfg, env_cls)
    return DifficultyCurriculum(cfg, env_cls, tasks_per_level)
