"""A rollout worker of `cluster.backend: ray`: one Ray actor holding an engine and running
episodes on it: the agent loop, the env and its tools, exactly as `RolloutManager` runs them in
process (`collect.run_one`). The engine is an embedded one (its own copy of the weights,
updated by every weight sync), or with engine servers (engine.backend http, vllm, sglang) an
`HttpEngine` over them that follows the run's engine's weight pushes (`engine/follower.py`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiller.config import Config
from tiller.engine.api import Generation, SamplingParams
from tiller.engine.factory import make_engine
from tiller.engine.follower import Followed, adopt, follow_servers
from tiller.engine.updates import WeightUpdate
from tiller.envs import Env, Task, ToolEnv
from tiller.rollout.agent_loop import EpisodeFn, EpisodeLimits
from tiller.rollout.collect import run_one
from tiller.rollout.manager import RolloutActor, _ActorRequests
from tiller.rollout.trajectory import Trajectory
from tiller.tools.sandbox import set_unsafe_fallback
from tiller.tools.stack import ToolStack

log = logging.getLogger(__name__)


class RolloutWorker:
    """Worker `index`'s engine and episodes. Its tool stack and env server write below
    <run>/ray/worker<index>."""

    def __init__(self, index: int, cfg: Config, model: nn.Module | None, tokenizer: Any,
                 env_cls: type[Env], episode_fn: EpisodeFn, limits: EpisodeLimits,
                 run_dir: Path, servers: Followed | None = None):
        """`servers`: the run's engine servers (then `model` is None); else the engine is an
        embedded copy of `model`."""
        torch.set_num_threads(1)  # one CPU reserved per worker
        self.index, self.cfg, self.env_cls = index, cfg, env_cls
        self.dir = run_dir / "ray" / f"worker{index}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tools = ToolStack(cfg.env.tools, self.dir)
        set_unsafe_fallback(cfg.env.tools.sandbox.allow_unsafe_fallback)
        env_cls.start(self.dir)
        if servers is not None:
            self.engine: Any = follow_servers(cfg, servers)
        else:
            assert model is not None
            self.engine = make_engine(cfg, model, tokenizer.pad_token_id, run_dir=self.dir,
                                      initial=lambda: WeightUpdate.full(model, 0))
        self.requests = _ActorRequests()
        self.episode = dict(episode_fn=episode_fn, make_env=self.make_env, tokenizer=tokenizer,
                            limits=limits, seed=cfg.seed)

    def make_env(self, *key: Any) -> Env:
        """`Run.make_env` on this worker: the env's tools behind the worker's tool stack."""
        if not issubclass(self.env_cls, ToolEnv):
            return self.env_cls()
        return self.env_cls(wrap=self.tools.wrapper("/".join(map(str, key))))

    async def run_episode(self, task: Task, k: int, tag: tuple, draw: int,
                          params: SamplingParams, resume: bool) -> Trajectory:
        """Episode k of the group (`collect.run_one`) on this worker's engine."""
        actor = RolloutActor(self.engine, params, self.requests, resume=resume)
        return await run_one(task, k, actor, tag=tag, draw=draw, **self.episode)

    async def run_episodes(self, episodes: list[tuple[Task, int, tuple, int]],
                           params: SamplingParams, resume: bool
                           ) -> list[Trajectory | BaseException]:
        """Several episodes at once (their first turns reach the engine as one burst): each
        one's trajectory, or the error it raised."""
        return await asyncio.gather(*(self.run_episode(*e, params, resume) for e in episodes),
                                    return_exceptions=True)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int,
                       **kwargs: Any) -> Generation:
        return await self.engine.generate(prompt_ids, params, seed, **kwargs)

    async def update_weights(self, update: Any, in_flight: str, timeout_s: float | None
                             ) -> int:
        return await asyncio.to_thread(self.engine.update_weights, update,
                                       in_flight=in_flight, timeout_s=timeout_s)

    def adopt(self, state: dict[str, Any]) -> None:
        """The run's engine's view of its servers (`engine/follower.py`)."""
        adopt(self.engine, state)

    async def score(self, token_ids: list[int], timeout_s: float | None) -> list[float]:
        return await asyncio.to_thread(self.engine.score, token_ids, timeout_s=timeout_s)

    async def abort(self, request_id: str, timeout_s: float | None) -> bool:
        return await asyncio.to_thread(self.engine.abort, request_id, timeout_s=timeout_s)

    async def stop_episodes(self, timeout_s: float) -> int:
        """The end of RL: no request starts, the live ones are aborted (their episodes end as
        aborted); returns how many were live."""
        self.requests.stopping = True
        live = list(self.requests.live)
        for rid in live:
            await asyncio.to_thread(self.engine.abort, rid, timeout_s=timeout_s)
        return len(live)

    def start_episodes(self) -> None:
        self.requests.stopping = False

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def tool_stats(self) -> dict[str, float]:
        """This worker's tool counters since the last call (`ToolStack.stats`, reset)."""
        return self.tools.stats(reset=True)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            try:
                self.env_cls.stop()
            finally:
                self.tools.close()
