"""`cluster.backend: ray` with engine servers (engine.backend http, vllm or sglang): the rollout
workers generate on the servers over HTTP, and the run's engine, in the run's process, holds the
servers (managed ones each in a Ray actor: `engine/ray_servers.py`).

`RayHttpWorkers` is the run's `Engine` here: it is `RayWorkers` (episodes in the workers, which
die and are retried as there) whose weight updates, parity probes and evaluation generations go
to the run's `HttpEngine` (`engine`) instead of the workers. Each worker's engine is a follower
of it (`engine/follower.py`): the same router (sessions sticky, a request on a dead server
retried on another up to engine.max_retries, each retry counted in `engine/retries`), told the
pushed versions before and after every push. A server that dies (its actor killed, its process
gone) is marked down where its requests fail, skipped by the pushes after (`push_skipped_down`),
and the run goes on on the others; with none left, a request fails with one line naming each
server, and the run stops."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from tiller.config import Config
from tiller.engine.api import Generation, SamplingParams
from tiller.engine.factory import make_engine
from tiller.engine.follower import Followed, router_state, run_api_key
from tiller.engine.http import HttpEngine, Server
from tiller.engine.ray_servers import node_pin
from tiller.engine.updates import WeightUpdate
from tiller.envs import Env
from tiller.rollout.agent_loop import EpisodeFn, EpisodeLimits
from tiller.rollout.ray_rollouts import READY_TIMEOUT_S, RayWorkers

# counts of servers, not of requests: the most any one engine counts (`merged_stats`)
SERVER_COUNTS = ("servers_marked_down", "servers_rejoined", "push_skipped_down")

class RayHttpWorkers(RayWorkers):
    """The rollout workers over the run's engine servers; `engine` is the run's `HttpEngine`
    over them (closed with the workers)."""

    def __init__(self, cfg: Config, engine: HttpEngine, tokenizer: Any, env_cls: type[Env],
                 episode_fn: EpisodeFn, limits: EpisodeLimits, run_dir: Path):
        self.engine = engine
        assert engine.max_context is not None  # `connect` checked the servers
        super().__init__(cfg, None, tokenizer, env_cls, episode_fn, limits, run_dir,
                         servers=Followed([s.url for s in engine.servers], engine.max_context,
                                          run_api_key(cfg)))
        try:
            self.adopt_all("start", router_state(engine), READY_TIMEOUT_S)
        except BaseException:
            self.release()  # the run's engine and its servers: closed by `ray_engine`
            raise
        self.version = engine.version

    def bundle(self) -> dict[str, float]:
        """One CPU on the run's node: the managed servers listen on its loopback."""
        return {"CPU": 1, **node_pin()}

    @property
    def servers(self) -> list[Server]:
        """The run's engine's servers (`WeightSync` reads their down marks)."""
        return self.engine.servers

    @property
    def takes_deltas(self) -> bool:
        return self.engine.takes_deltas

    def new_weights_folder(self, version: int) -> Path:
        return self.engine.new_weights_folder(version)

    def adopt_all(self, what: str, state: dict[str, Any], timeout_s: float | None) -> None:
        self.wait_all(f"router state at {what}", lambda w: w.adopt.remote(state), timeout_s)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int, *,
                       session_id: str | None = None, request_id: str | None = None,
                       cache_scope: str | None = None) -> Generation:
        """Evaluation's turns: on the run's engine, in this process."""
        return await self.engine.generate(prompt_ids, params, seed, session_id=session_id,
                                          request_id=request_id)

    def abort(self, request_id: str, *, timeout_s: float | None = None) -> bool:
        return (self.engine.abort(request_id, timeout_s=timeout_s)
                or super().abort(request_id, timeout_s=timeout_s))

    def update_weights(self, update: Any, *, in_flight: str = "continue",
                       timeout_s: float | None = None) -> int:
        """The run's engine pushes `update` to every server; the workers' engines are told the
        version before (pending: an answer under it is fresh) and the outcome after."""
        v = update.version
        self.adopt_all(f"weight update v{v}", router_state(self.engine, pending=v), timeout_s)
        try:
            self.version = self.engine.update_weights(update, in_flight=in_flight,
                                                      timeout_s=timeout_s)
        finally:
            self.adopt_all(f"weight update v{v}", router_state(self.engine), timeout_s)
        return self.version

    def score_servers(self, token_ids: list[int], *, timeout_s: float | None = None
                      ) -> dict[str, list[float]]:
        """The parity probe on every up server (the run's engine)."""
        return self.engine.score_servers(token_ids, timeout_s=timeout_s)

    def engine_stats(self, per: list[dict[str, float]]) -> dict[str, float]:
        """`merged_stats` of the run's engine's counters and the workers' engines'."""
        return {**merged_stats(self.engine.stats(), per), "version": float(self.version)}

    def close(self) -> None:
        """The workers (their engines' connections), then the run's engine and its servers."""
        try:
            super().close()
        finally:
            self.engine.close()


def ray_engine(cfg: Config, model: nn.Module, tokenizer: Any, env_cls: type[Env],
               episode_fn: EpisodeFn, limits: EpisodeLimits, run_dir: Path,
               initial: Callable[[], WeightUpdate]) -> RayWorkers:
    """The run's engine under `cluster.backend: ray`: the rollout workers with embedded engines,
    or over the engine servers of engine.backend (started, checked and given `initial()` here
    by `make_engine`)."""
    if cfg.engine.backend == "embedded":
        return RayWorkers(cfg, model, tokenizer, env_cls, episode_fn, limits, run_dir)
    engine = make_engine(cfg, model, tokenizer.pad_token_id, run_dir=run_dir, initial=initial,
                         tokenizer=tokenizer)
    try:
        assert isinstance(engine, HttpEngine)  # every backend but embedded
        return RayHttpWorkers(cfg, engine, tokenizer, env_cls, episode_fn, limits, run_dir)
    except BaseException:
        engine.close()
        raise


def merged_stats(own: dict[str, float], per: list[dict[str, float]]) -> dict[str, float]:
    """The pusher's engine counters (`own`) and its followers' (`per`) summed, except the
    counts of servers (marked down, rejoined, skipped by a push: `SERVER_COUNTS`), the most
    any one engine counts (each sees the same servers: a sum would count one server once per
    engine); `servers_up`: the fewest any counts."""
    out: Counter[str] = Counter(own)
    for s in per:
        out.update({k: v for k, v in s.items() if k not in SERVER_COUNTS})
    for k in SERVER_COUNTS:
        out[k] = max(s.get(k, 0) for s in [own, *per])
    return {**out, "servers_up": min(s["servers_up"] for s in [own, *per])}
