"""The rollout manager's part of a resumable checkpoint (`tiller.checkpoints`): what it drew,
what it still owes, and its ledger, as plain JSON data.

A checkpoint is written between RL steps. A group drawn but not yet trained (running, or
finished and waiting in the buffer) is an *open* group: the checkpoint keeps its task, and on
resume the task stream starts with the open groups' tasks, then goes on where the checkpoint
left it (with rl.curriculum, the curriculum's own state put back: `Curriculum.load_state`).
So every task of the stream is drawn once: none skipped, none repeated. In rl.mode
sync a checkpoint is written before the next step's groups start, so there are no open groups
and the resumed run samples exactly what the uninterrupted one did; in one_step_off and async
the open groups are sampled again, under the checkpoint's weights (their earlier episodes, and
the ledger counts charged to them, and their draws of their tasks, are not kept: so in
one_step_off without refills each is sampled again with the seeds it was first sampled with;
in async it is relaunched under a new unit tag, hence other seeds). In async the
dynamic-sampling refills owed (a flat group's slot queued for another round, not started
yet) are kept and owed again on resume.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections import Counter
from collections.abc import Iterator
from typing import Any

from tiller.envs.base import Task
from tiller.errors import ConfigError

# what `manager_state` gives (a checkpoint's state.json holds it): pinned, with
# `checkpoints.STATE_KEYS`, to the checkpoint format (tests/test_checkpoints.py)
MANAGER_KEYS = ("pulled", "draw_ids", "open_tasks", "open_groups", "ledger", "next_unit",
                "steps_trained", "slots", "max_ahead", "draws", "refills")

# `m` below is a `rollout.manager.RolloutManager` (which imports this module): its private
# state is read and restored here, between steps, under its lock


def manager_state(m: Any, steps_trained: int) -> dict[str, Any]:
    """`m`'s state once `steps_trained` steps are trained, before the next one's groups
    start in sync (the caller holds no lock; `m` takes its own)."""
    with m._cond:
        unit = m._units.get(m._next_unit)
        full = unit is not None and unit.launched >= m.B  # the next launch moves on
        open_ = sorted(m._open.items(), key=lambda kv: kv[1][0])
        regenerated = {pos for _, (pos, *_) in open_}
        ledger, draws = Counter(m.ledger), Counter(m._draws)
        for key, (_, task, charged, _) in open_:
            ledger.subtract(charged)
            draws[(m._tag(key), task.id)] -= 1  # its relaunch draws it again (same seeds)
        return {
            "pulled": len(m.draw_ids),  # tasks taken from the stream so far
            "draw_ids": [t for i, t in enumerate(m.draw_ids) if i not in regenerated],
            "open_tasks": [dataclasses.asdict(task) for _, (_, task, *_) in open_],
            # (tag, task id, draw) of each: their episodes traced so far leave traces.sqlite
            "open_groups": [[list(m._tag(key)), task.id, draw]
                            for key, (_, task, _, draw) in open_],
            "ledger": {k: v for k, v in ledger.items() if v},
            # ordered modes relaunch the open groups (whole units, in draw order) into the
            # units they were drawn for, from the first one not trained
            "next_unit": steps_trained if m.mode != "async" else m._next_unit + full,
            "steps_trained": steps_trained,
            "slots": m._slots - len(open_),
            "max_ahead": m.max_ahead,
            "draws": [[list(tag), task_id, n] for (tag, task_id), n in draws.items() if n],
            # async: dynamic-sampling refills owed, not started (each holds its flat group's
            # slot, counted in "slots"); ordered modes relaunch whole units, whose round-0
            # groups take the flat groups' places
            "refills": [list(r) for r in m._refills] if m.mode == "async" else [],
        }


def restore_manager(m: Any, state: dict[str, Any]) -> None:
    """Put `state` back into a manager built for the resumed run, before any group starts."""
    m.draw_ids = list(state["draw_ids"])
    m.ledger.update(state["ledger"])
    m._next_unit, m._slots = state["next_unit"], state["slots"]
    m._steps_trained = state["steps_trained"]
    m.max_ahead = state["max_ahead"]
    m._draws.update({(tuple(tag), task_id): n for tag, task_id, n in state["draws"]})
    m._refills.extend((u, r) for u, r in state["refills"])


def resumed_tasks(stream: Iterator[Task], state: dict[str, Any], restored: bool
                  ) -> Iterator[Task]:
    """The resumed run's task stream: the open groups' tasks, then `stream` past the
    `state["pulled"]` tasks the checkpointed run had drawn, which must be those it drew
    (`check_drawn`); `restored`: `stream` is already there (a curriculum, its state put
    back from the checkpoint), nothing is skipped."""
    if not restored:
        skipped = [t.id for t in itertools.islice(stream, state["pulled"])]
        check_drawn(skipped, state, "--resume")
    return itertools.chain((Task(**t) for t in state["open_tasks"]), stream)


def check_state(state: Any, where: str) -> None:
    """`state` (a checkpoint's, as its state.json gives it) is of the shape `restore_manager`
    and `resumed_tasks` read, before any work: one line saying what is not otherwise (the
    checkpoint's hashes say it is whole, not that a hand-edited one is tiller's): its fields
    MANAGER_KEYS, no other, and the open groups (tag, task id, draw) triples, which the cut of
    traces.sqlite reads."""
    try:
        if other := sorted(set(state) ^ set(MANAGER_KEYS)):
            raise ValueError(f"{other[0]} is {'not a field' if other[0] in state else 'missing'}"
                             f" (its fields: {', '.join(MANAGER_KEYS)})")
        for key in ("pulled", "next_unit", "slots", "steps_trained", "max_ahead"):
            if type(state[key]) is not int:
                raise TypeError(f"{key} is a {type(state[key]).__name__}, not an int")
        probe = types.SimpleNamespace(ledger=Counter(), _draws=Counter(), _refills=[])
        restore_manager(probe, state)
        counts = [*probe.ledger.values(), *probe._draws.values()]
        if not all(type(n) is int for n in counts):
            raise TypeError("ledger or draws holds a count that is not an int")
        for t in state["open_tasks"]:
            Task(**t)
        for tag, task_id, draw in state["open_groups"]:
            if not (isinstance(tag, list) and isinstance(task_id, str) and type(draw) is int
                    and 0 <= draw < 2**63):
                raise TypeError(f"open_groups holds {[tag, task_id, draw]!r}, not a (tag, "
                                f"task id, draw in [0, 2**63)) triple")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{where} is corrupt: its state.json's manager state does not fit "
                          f"({type(e).__name__}: {e}); move it away to resume from an older "
                          f"one") from e


def check_drawn(ids: list[str], state: dict[str, Any], where: str) -> None:
    """`ids`, the first tasks of a resumed run's stream, must be the `state["pulled"]` tasks
    the checkpointed run drew (its draw ids and its open groups' tasks, as a multiset: the
    open groups' places in the draw order are not kept): one line otherwise (a shorter
    stream, or an env whose make_tasks gives other first tasks for another count)."""
    drawn = Counter(state["draw_ids"]) + Counter(t["id"] for t in state["open_tasks"])
    if len(ids) < state["pulled"]:
        raise ConfigError(f"{where}: the task stream has {len(ids)} tasks; the checkpoint "
                          f"drew {state['pulled']}")
    if Counter(ids) != drawn:
        other = sorted((Counter(ids) - drawn).elements())[:3]
        raise ConfigError(f"{where}: the task stream's first {state['pulled']} tasks are not "
                          f"those the checkpoint drew (e.g. {other} were not drawn): the "
                          f"env's make_tasks gives other first tasks for this config's task "
                          f"count; resume with the run's rl.steps")
