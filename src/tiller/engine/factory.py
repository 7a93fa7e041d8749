"""`make_engine`: the engine backend the config names, holding the trainer's weights."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from tiller.config import Config
from tiller.engine.api import Engine
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.updates import WeightUpdate
from tiller.errors import require_package


def make_engine(cfg: Config, model: PreTrainedModel, pad_token_id: int, *, weights_dir: Path,
                initial: Callable[[], WeightUpdate]) -> Engine:
    """The engine of `cfg.engine.backend` over the trainer's `model`: `embedded` holds a copy in
    `cfg.model.dtype`; `http` connects to `cfg.engine.urls`, checks the servers against the
    model and pushes them `initial()` (weight versions go through `cfg.engine.weights_dir`,
    else `weights_dir`)."""
    e = cfg.engine
    if e.backend == "http":
        require_package("httpx", "serve", "engine.backend=http")
        from tiller.engine.http import connect  # httpx is an optional extra

        return connect(e.urls, weights_dir=e.weights_dir or weights_dir,
                       api_key=e.api_key.get_secret_value() if e.api_key else None,
                       request_timeout_s=e.request_timeout_s, max_retries=e.max_retries,
                       vocab_size=model.config.vocab_size,
                       max_context=model.config.max_position_embeddings,
                       initial=initial(), dtype=cfg.model.dtype)
    return EmbeddedEngine(copy.deepcopy(model).to(getattr(torch, cfg.model.dtype)), pad_token_id,
                          max_batch_size=e.max_batch_size, cache_bytes=e.cache_bytes)
