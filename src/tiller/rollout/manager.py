"""The rollout manager: keeps episodes running for the trainer, under one of three schedules.

    sync          unit s (rl.tasks_per_step groups) starts once step s-1's weights are pushed,
                  and step s trains on exactly unit s
    one_step_off  unit s+1 starts when step s's weights are pushed... one step ahead: step s
                  trains on unit s, sampled by the weights of step s-1
    async         groups start one at a time while the staleness bound and
                  rollout.max_inflight allow; a step trains on the first tasks_per_step groups
                  that finish

One code path: a launch rule (`_next_launch`), a take rule (`_ready_batch`) and a stale filter.
A unit is the tasks of one step's worth of groups; group (unit u, round r, index i) samples
with the tag ("rl", u) (round 0) or ("rl", u, r) (a dynamic-sampling refill), so its episodes
get the same seeds in every mode. Refills start as flat groups finish, so which task a refill
gets depends on the order groups finish: with dynamic sampling a run is not reproducible
bit for bit (without it, sync is).

Staleness of a group = trainer version - the oldest weight version among its tokens. The
producer throttles: it starts a group only while fewer than (steps trained + lag + 1) *
tasks_per_step groups are alive or trained (lag = rl.lag_steps), so a group trained in launch
order is at most `lag` steps stale. Groups overtaken by later ones can still exceed the bound:
they are filtered (ledger `filtered/stale`) and their slot goes to a new group.

The trainer side sees only the `Rollouts` protocol (`protocol`): it asks for a batch, says when
new weights are live, and closes. Everything crossing it is plain data (trajectories, ints), so
another transport can put the producer in its own process or Ray actor; `RolloutManager` is
the in-process one (an asyncio loop in a thread).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from tiller.config import Config
from tiller.engine.api import Engine, Generation, SamplingParams
from tiller.envs.base import Env, Task
from tiller.errors import RunError
from tiller.rollout.agent_loop import EpisodeFn, EpisodeLimits
from tiller.rollout.buffer import DataBuffer, Group
from tiller.rollout.collect import check_aborted, run_one
from tiller.rollout.protocol import Leftovers, Taken, WindDown
from tiller.rollout.resume import restore_manager
from tiller.rollout.trajectory import Trajectory
from tiller.seeds import derive_seed

log = logging.getLogger(__name__)


@dataclass
class _Unit:
    index: int
    launched: int = 0  # round-0 groups started
    drawn: int = 0  # groups started, refills included: the last part of a group's key
    pending: int = 0  # groups running (any round)
    owed: int = 0  # refill groups queued, not started yet
    rounds: int = 1  # the most sampling rounds any of its slots took


@dataclass
class _ActorRequests:
    """The actors' engine requests, as the manager sees them: whether rollouts are stopping (no
    request starts, no cut turn is resumed), the ids of the live ones (shutdown aborts them)
    and how many turns were resumed."""

    stopping: bool = False
    live: set[str] = field(default_factory=set)
    resumed: int = 0


@dataclass
class RolloutActor:
    """The policy's actor during RL: registers each request (so shutdown can abort it) and,
    with `resume`, continues a turn that an aborting weight update cut short under the new
    weights: the resumed request's prompt is the old one plus the tokens sampled so far, so no
    token is sampled twice and none is lost, and each keeps the version that sampled it."""

    engine: Engine
    params: SamplingParams
    requests: _ActorRequests
    resume: bool = False

    async def act(self, prompt_ids: list[int], messages: list[dict], seed: int,
                  session_id: str | None = None) -> Generation:
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        prompt_tokens = cached = 0
        while True:
            if self.requests.stopping:
                return Generation(ids, logprobs, "abort", self.engine.version, tuple(versions),
                                  prompt_tokens, cached)
            request_id = uuid.uuid4().hex
            params = replace(self.params, max_new_tokens=self.params.max_new_tokens - len(ids))
            self.requests.live.add(request_id)
            try:  # a resumed request draws fresh randomness: its own seed
                gen = await self.engine.generate(
                    prompt_ids + ids, params, derive_seed(seed, len(ids)) if ids else seed,
                    session_id=session_id, request_id=request_id)
            finally:
                self.requests.live.discard(request_id)
            ids += gen.token_ids
            logprobs += gen.logprobs
            versions += gen.versions or [gen.version] * len(gen.token_ids)
            prompt_tokens += gen.prompt_tokens
            cached += gen.cached_tokens
            finish = gen.finish_reason
            if finish == "abort" and len(ids) >= self.params.max_new_tokens:
                finish = "length"
            if finish != "abort" or not self.resume or self.requests.stopping:
                return Generation(ids, logprobs, finish, gen.version, tuple(versions),
                                  prompt_tokens, cached)
            self.requests.resumed += 1


class RolloutManager:
    """In-process `Rollouts`: an asyncio loop in a thread runs the episodes; the trainer thread
    waits on a condition for batches. State shared by the two is guarded by `_cond`."""

    def __init__(self, cfg: Config, engine: Engine, params: SamplingParams,
                 tasks: Iterator[Task], *, episode_fn: EpisodeFn,
                 make_env: Callable[..., Env], tokenizer: Any, limits: EpisodeLimits,
                 reward: Callable[[Trajectory], float], version: int,
                 judge: Callable[[Task, Trajectory], Trajectory] | None = None,
                 on_group: Callable[[Task, list[Trajectory]], None] | None = None,
                 resume: dict[str, Any] | None = None) -> None:
        """`judge` (rl.judge) returns each finished trajectory with its judge score recorded,
        before anything reads its reward; `on_group` hears every group that finishes while
        RL runs (the curriculum), under the manager's lock, on the rollout thread. `resume`
        is a checkpoint's `rollout.resume.manager_state`, restored before any group starts
        (`tasks` then starts with its open groups' tasks: `rollout.resume.resumed_tasks`)."""
        rl = cfg.rl
        self.cfg, self.engine, self.reward = cfg, engine, reward
        self.judge, self.on_group = judge, on_group
        self.mode, self.B, self.G = rl.mode, rl.tasks_per_step, rl.group_size
        self.lag, self.max_staleness = rl.lag_steps, rl.staleness_bound
        self.max_inflight = cfg.rollout.max_inflight
        self.dynamic = rl.algorithm.dynamic_sampling
        self.rounds = (self.dynamic.max_rounds or 1) if self.dynamic.enabled else 1
        self.tasks = tasks
        self.requests = _ActorRequests()
        self.actor = RolloutActor(engine, params, self.requests,
                                  resume=cfg.rollout.partial == "abort_resume")
        self._episode = dict(episode_fn=episode_fn, make_env=make_env, tokenizer=tokenizer,
                             limits=limits, seed=cfg.seed)
        self.buffer = DataBuffer(keep_env_errors=rl.env_error_weight > 0)
        self.ledger = self.buffer.ledger
        self._cond = threading.Condition()
        self._units: dict[int, _Unit] = {}
        self._next_unit = 0  # the unit whose round-0 groups start next
        # (unit, round) of each refill owed: a zero-variance group's slot is sampled again, at
        # once, with the next task (up to dynamic_sampling.max_rounds rounds per slot)
        self._refills: deque[tuple[int, int]] = deque()
        self._slots = 0  # groups alive (running or ready) or trained
        self.max_ahead = 0  # the most groups ever alive beyond those trained (the throttle)
        self._steps_trained = 0
        self._version = version
        self._inflight = 0  # episodes running
        self._ended: list[Trajectory] = []
        self._at_end: list[Trajectory] = []  # RL's end left them untrained (`leftovers`)
        self._flat = self._groups_ended = self._flat_filtered = 0
        self._nothing_kept = 0  # groups in a row with nothing kept (async: a run that cannot
        self._error: BaseException | None = None  # learn must stop, not spin)
        self._error_raised = False  # next_batch raised it: close need not report it again
        self._exhausted = False
        self._tasks: set[asyncio.Task] = set()
        self._draws: Counter[tuple] = Counter()  # (tag, task id) -> draws so far (repeats)
        self._busy_since: float | None = None  # rollout side busy: >= 1 episode running
        self.busy_s = 0.0
        self.draw_ids: list[str] = []  # the id of every task drawn, in draw order
        # groups drawn but not yet trained or filtered: key -> (draw position, task, ledger
        # counts charged to it, its draw of the task), what a checkpoint regenerates on resume
        self._open: dict[tuple, tuple[int, Task, Counter[str], int]] = {}
        if resume is not None:
            restore_manager(self, resume)
            for u, _ in self._refills:  # owed by their units, as when they were queued
                self._units.setdefault(u, _Unit(u)).owed += 1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="tiller-rollouts")
        self._thread.start()
        # one judge call at a time, off the event loop: a model judge's forward passes do not
        # stall the other episodes, and a judge need not be thread-safe
        self._judge_pool = concurrent.futures.ThreadPoolExecutor(1, "tiller-judge")
        self._loop.call_soon_threadsafe(self._pump)

    # ------------------------------------------------------------------ the trainer's side
    def next_batch(self, step: int) -> Taken:
        timeout = self.cfg.rollout.batch_timeout_s
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    self._error_raised = True
                    raise self._error
                self._check_aborted(step)
                batch = self._ready_batch(step)
                if batch is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunError(
                        f"rl step {step + 1}: waited {timeout:g}s for {self.B} groups of "
                        f"{self.G} episodes ({len(self.buffer.ready)} ready, {self._inflight} "
                        f"episodes running); raise rollout.batch_timeout_s if episodes are "
                        f"this slow")
                self._cond.wait(min(left, 1.0))
            ended, self._ended = self._ended, []
            stats = {"zero_variance_group_frac": self._flat / max(self._groups_ended, 1),
                     "groups_kept": float(len(batch)), "episodes_running": float(self._inflight),
                     "groups_ready": float(len(self.buffer.ready) - len(batch)),
                     "resumed_turns": float(self.requests.resumed)}
            if self.dynamic.enabled:
                units = {g.key[0] for g in batch} | ({step} if self.mode != "async" else set())
                stats["groups_dropped"] = float(self._flat_filtered)
                stats["sampling_rounds"] = float(max(
                    (self._units[u].rounds for u in units if u in self._units), default=1))
            self._flat = self._groups_ended = self._flat_filtered = 0
            check_aborted(ended, self.cfg.rl.max_aborted_frac, f"rl/{step}")
            trajectories, group_index = self.buffer.take(batch)
            for g in batch:
                del self._open[g.key]
        return Taken(trajectories, group_index.tolist(), ended, stats)

    def weights_live(self, steps_trained: int, version: int) -> None:
        with self._cond:
            self._steps_trained, self._version = steps_trained, version
            self._filter_stale()
        self._loop.call_soon_threadsafe(self._pump)

    def stats(self) -> dict[str, float]:
        with self._cond:
            busy = self.busy_s + (time.perf_counter() - self._busy_since
                                  if self._busy_since is not None else 0.0)
            return {"rollout_busy_s": busy, "episodes_running": float(self._inflight),
                    "groups_ahead_max": float(self.max_ahead),
                    **{f"ledger/{k}": float(v) for k, v in self.ledger.items()}}

    def close(self) -> Counter[str]:
        """Stop starting episodes, abort the running requests (their episodes end as aborted,
        `dropped/in_flight_at_end`), wait rollout.shutdown_timeout_s for them, cancel what is
        left (`dropped/cancelled_at_end`), and count unused ready groups
        (`dropped/unused_at_end`); within `WindDown.allowance` in all."""
        if self._loop.is_closed():
            return self.ledger
        with self._cond:
            self.requests.stopping = True
        budget = WindDown(self.cfg.rollout.shutdown_timeout_s)
        try:
            done = asyncio.run_coroutine_threadsafe(self._wind_down(budget), self._loop)
            try:
                done.result(timeout=budget.allowance)
            except concurrent.futures.TimeoutError as e:
                raise RunError(f"rl: the wind-down at the end of RL did not finish within "
                               f"{budget.allowance:g}s (rollout.shutdown_timeout_s + "
                               f"{budget.grace + budget.margin:g}): {self._inflight} episodes "
                               f"still running; the rollout thread is stuck (an episode "
                               f"blocking its event loop?)") from e
        finally:
            self._judge_pool.shutdown(wait=False, cancel_futures=True)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                log.error("rl: the rollout thread did not stop within 30 s")
            else:
                self._loop.close()
        with self._cond:
            self._at_end += [t for g in self.buffer.ready for t in g.members]
            self.buffer.drop_all("unused_at_end")
            self._stop_busy()
            if self._error is not None and not self._error_raised:
                # a group failed (its env, reward or judge raised) and no next_batch was left
                # to raise it: said here
                log.error("rl: a group failed and it was not yet reported (%s: %s); its "
                          "episodes are counted as dropped/run_error (%d in all)",
                          type(self._error).__name__, self._error,
                          self.ledger["dropped/run_error"])
        return self.ledger

    def leftovers(self) -> Leftovers:
        """After `close`: the episodes that ended after the last batch was taken (groups that
        ended, were cancelled with members ended, or waited for a step) and those the end of
        RL left untrained. Those cancelled while running have no trajectory
        (`dropped/cancelled_at_end`)."""
        with self._cond:
            if not self.requests.stopping:  # before close they belong to the next batch
                raise RuntimeError("RolloutManager.leftovers() is for after close()")
            return Leftovers(list(self._ended), list(self._at_end))

    # ------------------------------------------------------------------ rules (under _cond)
    def _ready_batch(self, step: int) -> list[Group] | None:
        """The groups of step `step` when they are all there, else None. Ordered modes train
        unit `step` once it is complete (refills included); async the first B ready groups."""
        if self._filter_stale():  # their slots go to new groups
            self._loop.call_soon_threadsafe(self._pump)
        ready = self.buffer.ready
        if self.mode != "async":
            unit = self._units.get(step)
            if unit is None or unit.launched < self.B or unit.pending or unit.owed:
                if self._exhausted and (unit is None or not unit.pending):
                    raise RunError(f"rl step {step + 1}: no train tasks left to sample "
                                   f"(rl.steps x rl.tasks_per_step were drawn)")
                return None
            return [g for g in ready if g.key[0] == step]
        if len(ready) >= self.B:
            return ready[: self.B]
        if self._exhausted and not self._inflight:
            raise RunError(f"rl step {step + 1}: no train tasks left to sample and "
                           f"{len(ready)} of {self.B} groups ready")
        return None

    def _filter_stale(self) -> int:
        """Filter the ready groups staler than the bound; returns how many."""
        stale = 0
        for g in list(self.buffer.ready):
            staleness = self._version - g.oldest_version
            if staleness > self.max_staleness:
                log.info("group %s (task %s) is %d versions stale (bound %d): filtered",
                         g.key, g.task_id, staleness, self.max_staleness)
                self.buffer.filter(g, "stale")
                del self._open[g.key]
                self._slots -= 1
                stale += 1
        return stale

    def _check_aborted(self, step: int) -> None:
        """A broken engine cannot teach: stop as soon as a batch's worth of episodes ended
        with too many aborted."""
        if len(self._ended) >= self.B * self.G:
            check_aborted(self._ended, self.cfg.rl.max_aborted_frac, f"rl/{step}")

    def _next_launch(self) -> tuple[int, int] | None:
        """(unit, round) of the next group to start, or None while the rules say wait."""
        if self.requests.stopping or self._error is not None or self._exhausted:
            return None
        room = (self.max_inflight is None or self._inflight + self.G <= self.max_inflight)
        if self._refills:  # a refill reuses the slot of the group it replaces
            return self._refills[0] if room else None
        # never more groups than rl.steps can train: the last step's tail is not sampled
        ahead = min(self._steps_trained + self.lag + 1, self.cfg.rl.steps)
        if self.mode != "async":  # whole units, at most `lag` steps ahead of the trainer
            unit = self._units.get(self._next_unit)
            if unit is not None and unit.launched >= self.B:
                self._next_unit += 1
            return (self._next_unit, 0) if self._next_unit < ahead else None
        if not room or self._slots >= ahead * self.B:
            return None
        unit = self._units.get(self._next_unit)
        if unit is not None and unit.launched >= self.B:
            self._next_unit += 1
        return self._next_unit, 0

    # ------------------------------------------------------------------ the producer (loop)
    def _pump(self) -> None:
        """Start every group the rules allow (runs on the loop thread); an error here stops
        the run through the trainer, like an episode's."""
        try:
            self._launch_all()
        except BaseException as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            self._error = self._error or e
            self._cond.notify_all()

    def _launch_all(self) -> None:
        with self._cond:
            while (launch := self._next_launch()) is not None:
                u, r = launch
                task = next(self.tasks, None)
                if task is None:
                    self._exhausted = True
                    log.warning("rl: no train tasks left to sample (%d units started)",
                                len(self._units))
                    self._cond.notify_all()
                    break
                unit = self._units.setdefault(u, _Unit(u))
                key = (u, r, unit.drawn)  # unique within the unit, in draw order
                unit.drawn += 1
                self._open[key] = (len(self.draw_ids), task, Counter(started=self.G),
                                   self._draw(key, task))
                self.draw_ids.append(task.id)
                if r == 0:
                    unit.launched += 1
                    self._slots += 1
                    self.max_ahead = max(self.max_ahead,
                                         self._slots - self._steps_trained * self.B)
                else:
                    self._refills.popleft()
                    unit.owed -= 1
                    unit.rounds = max(unit.rounds, r + 1)
                unit.pending += 1
                self._inflight += self.G
                self.ledger["started"] += self.G
                if self._busy_since is None:
                    self._busy_since = time.perf_counter()
                t = self._loop.create_task(self._group(key, task, self._open[key][3]))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    @staticmethod
    def _tag(key: tuple[int, int, int]) -> tuple:
        u, r, _ = key
        return ("rl", u) if r == 0 else ("rl", u, r)

    def _draw(self, key: tuple[int, int, int], task: Task) -> int:
        """The group's draw of its task under its tag: a task the iterator repeats (a small
        set drawn with replacement) gets new seeds, not the first draw's episodes again."""
        seen = (self._tag(key), task.id)
        self._draws[seen] += 1
        return self._draws[seen] - 1

    async def _group(self, key: tuple[int, int, int], task: Task, draw: int) -> None:
        tag = self._tag(key)
        finished: list[Trajectory] = []  # episodes that ended, should the group not
        episodes = [asyncio.ensure_future(self._one(task, k, tag, draw, finished))
                    for k in range(self.G)]
        try:
            trajs = list(await asyncio.gather(*episodes))
        except asyncio.CancelledError:  # shut down: the group's ended episodes are counted
            for ep in episodes:
                ep.cancel()
            self._ended_at_end(finished)
            raise
        except BaseException as e:  # a RunError/ConfigError of the env, or a bug: stop the run
            for ep in episodes:
                ep.cancel()
            try:
                await asyncio.gather(*episodes, return_exceptions=True)
            finally:
                with self._cond:
                    self._count(finished, "dropped/run_error")
                self._fail(e)
            return
        try:
            if self.judge is not None:
                judge, ended = self.judge, trajs
                trajs = await self._loop.run_in_executor(
                    self._judge_pool, lambda: [judge(task, t) for t in ended])
            self._group_done(key, task, trajs)
        except asyncio.CancelledError:  # shut down while judged: they ended all the same
            self._ended_at_end(trajs)
            raise
        except BaseException as e:  # e.g. the reward function or the judge raised
            with self._cond:
                self._count(trajs, "dropped/run_error")
            self._fail(e)

    def _ended_at_end(self, trajs: list[Trajectory]) -> None:
        """Episodes of a group the shutdown cancelled that had ended: counted in flight at the
        end, and handed on by `leftovers` (to be traced, untrained)."""
        with self._cond:
            self._count(trajs, "dropped/in_flight_at_end")
            self._ended += trajs
            self._at_end += trajs

    def _count(self, trajs: list[Trajectory], bucket: str) -> None:
        if trajs:
            self.ledger[bucket] += len(trajs)

    async def _one(self, task: Task, k: int, tag: tuple, draw: int,
                   finished: list[Trajectory]) -> Trajectory:
        try:
            traj = await self._run_episode(task, k, tag, draw)
        except asyncio.CancelledError:
            with self._cond:
                self.ledger["dropped/cancelled_at_end"] += 1
                self._episode_ended()
            raise
        except BaseException as e:  # why, when the error says (ray_rollouts.WorkerDied)
            with self._cond:
                self.ledger[f"dropped/{getattr(e, 'ledger_reason', 'run_error')}"] += 1
                self._episode_ended()
            raise
        with self._cond:
            self.ledger["tokens/generated"] += traj.num_generated + traj.discarded_tokens
            self._episode_ended()
            finished.append(traj)
        return traj

    async def _run_episode(self, task: Task, k: int, tag: tuple, draw: int) -> Trajectory:
        """Episode k of the group (`run_one`) here; `ray_rollouts.RayRollouts` runs it in a
        rollout worker."""
        return await run_one(task, k, self.actor, tag=tag, draw=draw, **self._episode)

    def _episode_ended(self) -> None:
        self._inflight -= 1
        if not self._inflight:
            self._stop_busy()

    def _stop_busy(self) -> None:
        if self._busy_since is not None:
            self.busy_s += time.perf_counter() - self._busy_since
            self._busy_since = None

    def _group_done(self, key: tuple[int, int, int], task: Task, trajs: list[Trajectory]
                    ) -> None:
        with self._cond:
            unit = self._units[key[0]]
            unit.pending -= 1
            self._ended += trajs
            if self.requests.stopping:
                self._count(trajs, "dropped/in_flight_at_end")
                self._at_end += trajs
                self._cond.notify_all()
                return
            self._groups_ended += 1
            if self.on_group is not None:  # flat groups too: all-success is too easy
                self.on_group(task, trajs)
            # rewards first: a reward function that raises leaves the ledger untouched
            rewards = {id(t): self.reward(t) for t in trajs}
            before = self.ledger.copy()
            members = self.buffer.admit(trajs)
            self._open[key][2].update(self.ledger - before)
            group = Group(key, task.id, members)
            flat = bool(members) and len({rewards[id(t)] for t in members}) <= 1
            self._flat += flat
            if not members or (flat and self.dynamic.enabled):  # out of the buffer for good
                del self._open[key]
            if not members:  # nothing to train; async gives the slot to a new group
                self._slots -= 1
            elif flat and self.dynamic.enabled:
                self.buffer.filter(group, "zero_variance")
                self._flat_filtered += 1
                if key[1] + 1 < self.rounds:
                    self._refills.append((key[0], key[1] + 1))
                    unit.owed += 1
                else:  # max_rounds reached: the step trains on what there is
                    self._slots -= 1
            else:
                self.buffer.add(group)
            self._nothing_kept = self._nothing_kept + 1 if not members else 0
            if self.mode == "async" and self._nothing_kept > self.B * (
                    self.cfg.rl.max_idle_steps + 1):
                self._error = RunError(
                    f"rl: nothing to train: the last {self._nothing_kept} groups had every "
                    f"episode dropped (ledger: {dict(self.ledger)})")
            self._cond.notify_all()
        self._pump()

    async def _wind_down(self, budget: WindDown) -> None:
        """Abort the live requests and wait for the episodes, both within `budget.window`;
        then cancel the groups still running and give them `budget.grace` to unwind."""
        deadline = time.monotonic() + budget.window
        live = list(self.requests.live)
        aborting = (asyncio.ensure_future(asyncio.to_thread(self._abort_live, live, deadline))
                    if live else None)
        running = list(self._tasks)
        if running:  # aborted episodes end at once; the others at their next turn
            _, late = await asyncio.wait(running, timeout=max(0.0, deadline - time.monotonic()))
        else:
            late = set()
        if aborting is not None:
            left = max(0.0, deadline - time.monotonic())
            if not (await asyncio.wait([aborting], timeout=left))[0]:
                log.warning("rl: the aborts of %d requests at the end of RL had not all "
                            "answered within %gs (rollout.shutdown_timeout_s); the engine "
                            "may be stuck", len(live), budget.window)
        if late:
            for t in late:
                t.cancel()
            log.warning("rl: %d groups still running %gs (rollout.shutdown_timeout_s) after "
                        "the end of RL were cancelled", len(late), budget.window)
            _, stuck = await asyncio.wait(late, timeout=budget.grace)
            if stuck:
                log.error("rl: %d cancelled groups did not unwind within %gs; their episodes "
                          "are not accounted", len(stuck), budget.grace)

    def _abort_live(self, request_ids: list[str], deadline: float) -> None:
        """In a thread: abort each request, one after another, each waiting only until
        `deadline` (a stuck engine then holds this thread no longer than the window); logs
        the aborts that failed, timed out or were not tried."""
        failed: list[str] = []
        untried = 0
        for i, rid in enumerate(request_ids):
            left = deadline - time.monotonic()
            if left <= 0:
                untried = len(request_ids) - i
                break
            try:
                self.engine.abort(rid, timeout_s=left)
            except Exception as e:  # its episode still ends: at its next turn, or cancelled
                failed.append(f"{rid}: {type(e).__name__}: {e}")
        if failed or untried:
            log.warning("rl: of the %d requests live at the end of RL, %d aborts failed or "
                        "timed out and %d were not tried within rollout.shutdown_timeout_s%s",
                        len(request_ids), len(failed), untried,
                        f"; first: {failed[0]}" if failed else "")
