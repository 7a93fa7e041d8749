"""The driver's side of `cluster.backend: ray`: `RayWorkers`, the run's engine (an `Engine` over
the rollout workers' engines: each generation on one worker, each weight update and parity
probe on all), and `RayRollouts`, the `Rollouts` whose episodes run in the workers.

`RayRollouts` is `RolloutManager` with one thing moved: where an episode runs. The schedule,
the buffer, the ledger, rewards, the judge and the curriculum stay in the run's process, so
they behave as in process. An episode whose worker dies (its engine with it) is retried from
its start on another live worker under the same seed (ledger `retried`), at most
`MAX_EPISODE_RETRIES` times: then it is dropped (ledger `dropped/worker_died`) and the run stops
naming it; when no worker is left the run stops with one line. Every call to the workers has a
bounded wait whose error names the worker. The workers are placed with a placement group, one CPU
each (PACK: on as few nodes as fit); a start that fails part-way leaves no actor or group."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from tiller.config import Config
from tiller.engine.api import Generation, SamplingParams
from tiller.engine.follower import Followed
from tiller.engine.ray_servers import actor_cause, finished, first_line, place_group
from tiller.envs import Env, Task
from tiller.errors import RunError
from tiller.rollout.agent_loop import EpisodeFn, EpisodeLimits
from tiller.rollout.manager import RolloutManager
from tiller.rollout.ray_worker import RolloutWorker
from tiller.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0  # the workers' start (model copy, engine thread)
CLOSE_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 600.0  # a call to a worker given no timeout (generate, abort, weight update)
MAX_EPISODE_RETRIES = 2  # an episode (or eval generation) whose worker died, run again at most


def call_timeout(cfg: Config) -> tuple[float, str]:
    """How long a call to a worker given no timeout may take, and why: CALL_TIMEOUT_S, or with
    engine servers (whose requests the worker's own router times out and retries) at least
    every try of a request: (engine.max_retries + 1) x (engine.request_timeout_s + 10 s)."""
    e = cfg.engine
    tries = getattr(e, "max_retries", None)
    if tries is None:
        return CALL_TIMEOUT_S, "CALL_TIMEOUT_S of tiller/rollout/ray_rollouts.py"
    need = (tries + 1) * (e.request_timeout_s + 10.0)
    if need <= CALL_TIMEOUT_S:
        return CALL_TIMEOUT_S, "CALL_TIMEOUT_S of tiller/rollout/ray_rollouts.py"
    return need, (f"(engine.max_retries + 1) x (engine.request_timeout_s="
                  f"{e.request_timeout_s:g} + 10 s)")


class WorkerDied(RunError):
    """An episode whose workers died `MAX_EPISODE_RETRIES` + 1 times: dropped, and the run
    stops (ledger `dropped/worker_died`)."""

    ledger_reason = "worker_died"


class RayWorkers:
    """The rollout workers, and the `Engine` the run's process sees over them."""

    ships_updates = True  # a weight update reaches the workers through Ray's object store

    def __init__(self, cfg: Config, model: nn.Module | None, tokenizer: Any,
                 env_cls: type[Env], episode_fn: EpisodeFn, limits: EpisodeLimits,
                 run_dir: Path, servers: Followed | None = None):
        """`servers`: the workers generate on these engine servers (`RolloutWorker`), not on
        embedded copies of `model`. The group's placement and every worker's start share
        `READY_TIMEOUT_S`; a worker that is not created, dies or does not start in it fails
        the start in one line naming it, once every actor made so far and the group are
        removed."""
        import ray

        n = cfg.cluster.rollout_workers
        self.ray = ray  # the module, imported only with cluster.backend ray
        self.workers: list[Any] = []
        self.group: Any = None
        self.live = list(range(n))
        self.retried = 0
        self.version = 0
        self.unanswered = 0  # `gather` calls (stats, stop, close) a worker did not answer in time
        self.last_stats: dict[int, dict[str, float]] = {}  # each worker's last `stats` answer
        self.late_tools: list[tuple[int, Any]] = []  # `tool_stats` calls not answered in time
        self.call_timeout_s, self.call_timeout_why = call_timeout(cfg)
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            self.group = place_group([self.bundle()] * n, f"{n} rollout workers",
                                     READY_TIMEOUT_S)
            self._create(cfg, model, (tokenizer, env_cls, episode_fn, limits, run_dir, servers))
            self._await_started(deadline)
        except BaseException:
            self.release()
            raise

    def _create(self, cfg: Config, model: nn.Module | None, args: tuple) -> None:
        """One actor per bundle of the group, each `RolloutWorker(i, cfg, model, *args)`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = self.ray.remote(num_cpus=1, max_restarts=0, max_concurrency=1000)(RolloutWorker)
        shared = self.ray.put(model)
        for i in self.live:
            try:
                self.workers.append(remote.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.group, placement_group_bundle_index=i)).remote(
                    i, cfg, shared, *args))
            except Exception as e:
                raise RunError(f"ray: rollout worker {i}'s actor was not created "
                               f"({first_line(e)})") from e

    def _await_started(self, deadline: float) -> None:
        """Every worker's constructor has returned, by `deadline`."""
        for i, w in enumerate(self.workers):
            try:
                self.ray.get(w.__ray_ready__.remote(),
                             timeout=max(0.0, deadline - time.monotonic()))
            except self.ray.exceptions.GetTimeoutError as e:
                raise RunError(f"ray: rollout worker {i} did not start within "
                               f"{READY_TIMEOUT_S:g}s (placement included)") from e
            except self.ray.exceptions.RayActorError as e:
                raise RunError(f"ray: rollout worker {i} failed to start "
                               f"({actor_cause(e)})") from e

    def release(self) -> None:
        """Kill every worker actor and remove their group (no orderly close: a failed start,
        or after `close`'s). Idempotent."""
        workers, self.workers, self.live = self.workers, [], []
        for w in workers:
            self.ray.kill(w)
        if self.group is not None:
            self.ray.util.remove_placement_group(self.group)
            self.group = None

    def bundle(self) -> dict[str, float]:
        """A worker's placement bundle: one CPU."""
        return {"CPU": 1}

    def wait_all(self, what: str, call: Callable[[Any], Any], timeout_s: float | None
                 ) -> dict[int, Any]:
        """`call(worker)` on every live worker, within `timeout_s` in all (None:
        `call_timeout`): each answer by worker. A worker that died is marked dead (`dead`);
        one that does not answer in time fails the run naming it."""
        why = self.call_timeout_why if timeout_s is None else "the caller's timeout"
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        refs = {i: call(self.workers[i]) for i in list(self.live)}
        deadline, out = time.monotonic() + timeout_s, {}
        for i, ref in refs.items():
            try:
                out[i] = self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except self.ray.exceptions.RayActorError as e:
                self.dead(i, e)
            except self.ray.exceptions.GetTimeoutError as e:
                raise RunError(f"ray: rollout worker {i}'s {what} did not finish within "
                               f"{timeout_s:g}s ({why})") from e
        return out

    def dead(self, i: int, error: BaseException) -> None:
        """Worker i died: no more work goes to it."""
        if i in self.live:
            self.live.remove(i)
            log.error("ray: rollout worker %d died (%s: %s); %d left", i, type(error).__name__,
                      str(error).splitlines()[0] if str(error) else "", len(self.live))
        if not self.live:
            raise RunError(f"ray: every rollout worker died (the last, worker {i}: "
                           f"{type(error).__name__})") from error

    def pick(self, key: str) -> int:
        """The live worker for `key` (a session keeps its worker: its KV cache is there)."""
        if not self.live:
            raise RunError("ray: no rollout worker is alive")
        return self.live[zlib.crc32(key.encode()) % len(self.live)]

    # ----- the Engine the run's process uses (evaluation, weight sync, stats) -----
    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
                       session_id: str | None = None, request_id: str | None = None,
                       cache_scope: str | None = None) -> Generation:
        """On one live worker within `call_timeout`; when it dies, again on another (at most
        `MAX_EPISODE_RETRIES` times, counted in `retried`)."""
        for attempt in range(MAX_EPISODE_RETRIES + 1):
            i = self.pick(session_id or request_id or str(seed))
            ref = self.workers[i].generate.remote(
                prompt_ids, params, seed, session_id=session_id, request_id=request_id,
                cache_scope=cache_scope)
            try:
                return await asyncio.wait_for(ref, self.call_timeout_s)
            except TimeoutError as e:
                raise RunError(f"ray: rollout worker {i}'s generation did not finish within "
                               f"{self.call_timeout_s:g}s ({self.call_timeout_why})") from e
            except self.ray.exceptions.RayActorError as e:
                self.dead(i, e)
                if attempt < MAX_EPISODE_RETRIES:
                    self.retried += 1
                    log.warning("ray: a generation retried on another worker (worker %d died)",
                                i)
        raise WorkerDied(f"ray: a generation's worker died {MAX_EPISODE_RETRIES + 1} times")

    def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool:
        return any(self.wait_all(f"abort of {request_id}",
                                 lambda w: w.abort.remote(request_id, timeout_s),
                                 timeout_s).values())

    def update_weights(self, update: Any, *, in_flight: str = "continue",
                       timeout_s: float | None = None) -> int:
        """Every live worker's engine to `update`; the version they all echo."""
        shared = self.ray.put(update)
        echoed = set(self.wait_all(f"weight update v{update.version}",
                                   lambda w: w.update_weights.remote(shared, in_flight,
                                                                     timeout_s),
                                   timeout_s).values())
        if len(echoed) != 1:
            raise RunError(f"ray: the rollout workers echoed versions {sorted(echoed)} for "
                           f"weight update v{update.version}")
        self.version = echoed.pop()
        return self.version

    def score_servers(self, token_ids: list[int], *, timeout_s: float | None = None
                      ) -> dict[str, list[float]]:
        """The parity probe on every live worker's engine."""
        got = self.wait_all("parity probe", lambda w: w.score.remote(token_ids, timeout_s),
                            timeout_s)
        return {f"rollout worker {i}": scores for i, scores in got.items()}

    def score(self, token_ids: list[int], *, timeout_s: float | None = None) -> list[float]:
        return next(iter(self.score_servers(token_ids, timeout_s=timeout_s).values()))

    def stats(self) -> dict[str, float]:
        """The engine counters (`engine_stats`: a metric, so a worker that does not answer
        within CLOSE_TIMEOUT_S is logged and counted by `gather` and its last answer stands in;
        its counters only grow), and the workers' retries, live count and unanswered calls."""
        self.last_stats.update(self.gather("stats", lambda w: w.stats.remote(), CLOSE_TIMEOUT_S))
        per = [self.last_stats[i] for i in self.live if i in self.last_stats]
        return {**self.engine_stats(per), "retried": self.retried,
                "workers_live": float(len(self.live)), "unanswered": float(self.unanswered)}

    def tool_stats(self) -> list[dict[str, float]]:
        """Each live worker's tool counters since its last answer (the RL episodes' tools run
        in the workers' tool stacks): `tools.stack.merged_stats` adds them up. A metric: a
        worker that does not answer within CLOSE_TIMEOUT_S is left out, logged and counted
        (`gather`), and the run goes on. Its call still runs when the worker does (and starts
        its next window), so it is kept (`late_tools`) and its answer, once there, joins a
        later step's: no window's counts are lost, only reported late (those unanswered at
        the end are logged by `close`)."""
        late, self.late_tools = self.late_tools, []
        answers = list(self.gather("tool stats", lambda w: w.tool_stats.remote(),
                                   CLOSE_TIMEOUT_S, keep=self.late_tools).values())
        came, pending = self.answers(late, 0.0)  # a worker's dead: its counts died with it
        self.late_tools += pending
        return answers + [answer for _, answer in came]

    def engine_stats(self, per: list[dict[str, float]]) -> dict[str, float]:
        """The live workers' engine counters summed (version: the oldest; none without an
        answer)."""
        out: Counter[str] = Counter()
        for s in per:
            out.update({k: v for k, v in s.items() if k != "version"})
        return {**out, **({"version": min(s["version"] for s in per)} if per else {})}

    def gather(self, what: str, call: Callable[[Any], Any], timeout_s: float,
               keep: list[tuple[int, Any]] | None = None) -> dict[int, Any]:
        """`call(worker)` on every live worker where a missing answer must not stop the run
        (metrics, the end of RL or of the run): each answer by worker. A worker that died is
        marked dead, one that does not answer in time is logged, named, counted
        (`unanswered`) and left out (its call's ref added to `keep`, if given), and the rest
        still answer; one deadline of `timeout_s` over them all."""
        came, pending = self.answers([(i, call(self.workers[i])) for i in list(self.live)],
                                     timeout_s)
        for i, _ in pending:
            self.unanswered += 1
            log.error("ray: rollout worker %d did not answer its %s within %gs (%d "
                      "unanswered)", i, what, timeout_s, self.unanswered)
        if keep is not None:
            keep += pending
        return dict(came)

    def answers(self, calls: list[tuple[int, Any]], timeout_s: float
                ) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
        """The (worker, ref) `calls` answered within `timeout_s`, as (worker, answer), and
        those not yet answered; a worker whose call failed because it died is marked dead."""
        done, came, pending = finished([ref for _, ref in calls], timeout_s), [], []
        for i, ref in calls:
            if ref not in done:
                pending.append((i, ref))
                continue
            try:
                came.append((i, self.ray.get(ref, timeout=0)))
            except self.ray.exceptions.RayActorError as e:
                self.dead(i, e)
        return came, pending

    def close(self) -> None:
        """Close every live worker's engine and tools, then end the actors and their group."""
        if self.late_tools:
            log.error("ray: %d tool stats call(s) of rollout worker(s) %s still unanswered at "
                      "the end: their tool counts are not in any step's tools/*",
                      len(self.late_tools), sorted({i for i, _ in self.late_tools}))
        try:
            self.gather("close", lambda w: w.close.remote(), CLOSE_TIMEOUT_S)
        finally:
            self.release()


class RayRollouts(RolloutManager):
    """`RolloutManager` whose episodes run in the rollout workers (`RayWorkers`)."""

    def __init__(self, cfg: Config, workers: RayWorkers, params: SamplingParams,
                 *args: Any, **kwargs: Any) -> None:
        self.workers, self.params = workers, params
        self.resume = cfg.rollout.partial == "abort_resume"
        self._outbox: dict[int, list[tuple[tuple, asyncio.Future]]] = {}  # `_on_worker`
        self._deliveries: set[asyncio.Task] = set()
        workers.wait_all("start of RL", lambda w: w.start_episodes.remote(), CLOSE_TIMEOUT_S)
        super().__init__(cfg, workers, params, *args, **kwargs)  # type: ignore[arg-type]

    async def _run_episode(self, task: Task, k: int, tag: tuple, draw: int) -> Trajectory:
        """On the worker of its group; when that worker dies, from the start on another."""
        key = f"{tag}/{task.id}/{draw}"
        for attempt in range(MAX_EPISODE_RETRIES + 1):
            i = self.workers.pick(key)
            try:
                return await self._on_worker(i, (task, k, tag, draw))
            except self.workers.ray.exceptions.RayActorError as e:
                with self._cond:
                    self.workers.dead(i, e)
                    if attempt == MAX_EPISODE_RETRIES:
                        break
                    self.ledger["retried"] += 1
                    self.workers.retried += 1
                log.warning("rl: episode %d of %s retried on another worker (worker %d died)",
                            k, task.id, i)
        raise WorkerDied(f"ray: episode {k} of {task.id}: its worker died "
                         f"{MAX_EPISODE_RETRIES + 1} times (MAX_EPISODE_RETRIES)")

    def _on_worker(self, i: int, episode: tuple[Task, int, tuple, int]) -> asyncio.Future:
        """The episode's trajectory from worker i. The episodes started in one turn of the
        event loop (a group, a step's groups) go to a worker in one call, so their first turns
        reach its engine as one burst (one call per episode took 0.66 s of rollout per step
        where this takes 0.43: docs/scaling.md)."""
        future = self._loop.create_future()
        if not self._outbox.setdefault(i, []):
            self._loop.call_soon(self._send, i)
        self._outbox[i].append((episode, future))
        return future

    def _send(self, i: int) -> None:
        batch = self._outbox.pop(i)
        ref = self.workers.workers[i].run_episodes.remote([e for e, _ in batch], self.params,
                                                          self.resume)

        async def deliver() -> None:
            try:
                results = await ref
            except Exception as e:  # the worker died: every episode of the call is retried
                results = [e] * len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():  # cancelled: the end of RL
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

        task = self._loop.create_task(deliver())
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    def close(self) -> Counter[str]:
        """Tell every worker to stop its episodes (their live requests aborted), then close as
        in process."""
        wait = self.cfg.rollout.shutdown_timeout_s
        try:
            if not self._loop.is_closed():
                self.workers.gather("stop of episodes",
                                    lambda w: w.stop_episodes.remote(wait), wait)
        finally:
            counted = super().close()
        return counted
