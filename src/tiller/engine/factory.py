"""`make_engine`: the engine backend the config names, holding the trainer's weights; `connect`:
the HTTP backend over running servers, checked against the model and holding its weights."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from tiller.config import Config
from tiller.engine.api import Engine
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.servers import Launched, Launcher, ManagedServers, tiller_serve_specs
from tiller.engine.updates import WeightUpdate
from tiller.engine.wire import TILLER, TillerDialect
from tiller.errors import require_package

if TYPE_CHECKING:
    from tiller.engine.http import HttpEngine


def make_engine(cfg: Config, model: PreTrainedModel, pad_token_id: int, *, run_dir: Path,
                initial: Callable[[], WeightUpdate], tokenizer: Any = None) -> Engine:
    """The engine of `cfg.engine.backend` over the trainer's `model`: `embedded` holds a copy in
    `cfg.model.dtype`; `http` connects to the `tiller serve` servers at `cfg.engine.urls` (or
    to `cfg.engine.servers` ones it starts on the saved `model` and `tokenizer`, stopped with the
    engine), `sglang` to the SGLang servers at `cfg.engine.urls`; both check the servers against the
    model and pushes them `initial()` (weight versions go through `cfg.engine.weights_dir`,
    else `run_dir`/weights, whose folders below the run folder are never links); `vllm`
    starts or attaches to vLLM servers (`engine.vllm.connect_vllm`, which saves `model` and
    `tokenizer` for the servers it starts). The servers it starts are child processes, or with
    `cluster.backend: ray` each in a Ray actor (`launcher`)."""
    e = cfg.engine
    if e.backend == "vllm":
        require_package("httpx", "serve", "engine.backend=vllm")
        from tiller.engine.vllm import connect_vllm  # httpx is an optional extra

        # a sequence of the run: an episode, or the parity probe
        context = max(cfg.env.max_episode_tokens, cfg.weight_sync.parity_tokens)
        return connect_vllm(e, model, tokenizer, run_dir=run_dir, initial=initial(),
                            dtype=cfg.model.dtype, context=context, launch=launcher(cfg))
    if e.backend in ("http", "sglang"):
        require_package("httpx", "serve", f"engine.backend={e.backend}")
        from tiller.engine.sglang import SglangDialect

        # a weights_dir of the config is the user's; the default is in the run folder
        weights_dir = Path(e.weights_dir) if e.weights_dir else run_dir / "weights"
        managed, urls = None, e.urls
        if e.servers:  # the embedded engine in processes of its own: `tiller serve`
            model_dir = run_dir / "serve-model"
            model.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            weights_dir.mkdir(parents=True, exist_ok=True)
            managed = launcher(cfg)(
                tiller_serve_specs(model_dir, e.servers, weights_root=weights_dir,
                                   dtype=cfg.model.dtype, threads=cfg.server_threads),
                log_dir=run_dir / "servers", startup_timeout_s=e.startup_timeout_s)
            urls = managed.start()
        return connect(urls, weights_dir=weights_dir, managed=managed,
                       root=None if e.weights_dir else run_dir,
                       api_key=e.api_key.get_secret_value() if e.api_key else None,
                       request_timeout_s=e.request_timeout_s, max_retries=e.max_retries,
                       vocab_size=model.config.vocab_size,
                       max_context=model.config.max_position_embeddings,
                       initial=initial(), dtype=cfg.model.dtype,
                       dialect=SglangDialect() if e.backend == "sglang" else TILLER)
    return EmbeddedEngine(copy.deepcopy(model).to(getattr(torch, cfg.model.dtype)), pad_token_id,
                          max_batch_size=e.max_batch_size, cache_bytes=e.cache_bytes)


def launcher(cfg: Config) -> Launcher:
    """What starts managed servers: `ManagedServers` (child processes of this one), or under
    `cluster.backend: ray` `RayServers` (each in a Ray actor placed with a placement group, its
    bundle `cfg.server_threads` CPUs and `cfg.server_gpus` GPUs)."""
    if cfg.cluster.backend != "ray":
        return ManagedServers
    from tiller.engine.ray_servers import RayServers

    return partial(RayServers, cpus=int(cfg.server_threads), gpus=cfg.server_gpus)


def connect(urls: list[str], *, weights_dir: str | Path, api_key: str | None,
            request_timeout_s: float, max_retries: int, vocab_size: int, max_context: int,
            initial: WeightUpdate, dtype: str | None = None,
            root: str | Path | None = None, managed: Launched | None = None,
            dialect: TillerDialect = TILLER) -> HttpEngine:
    """An `HttpEngine` whose servers were checked against the trainer's model and hold its
    weights (`initial`): a server started from another checkpoint would otherwise sample
    another policy. `api_key` None: the TILLER_API_KEY environment variable, if set. `managed`:
    the servers tiller started at `urls`, stopped with the engine (also when this fails)."""
    from tiller.engine.http import HttpEngine  # httpx is an optional extra

    try:
        engine = HttpEngine(urls, weights_dir=weights_dir,
                            api_key=api_key or os.environ.get("TILLER_API_KEY"),
                            request_timeout_s=request_timeout_s, max_retries=max_retries,
                            root=root, managed=managed, dialect=dialect)
    except BaseException:
        if managed is not None:
            managed.close()
        raise
    try:
        engine.check_servers(vocab_size, max_context, dtype)
        engine.update_weights(initial)
    except BaseException:
        engine.close()
        raise
    return engine
