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


def make_engine(cfg: Config, model: PreTrainedModel, pad_token_id: int, *, run_dir: Path,
                initial: Callable[[], WeightUpdate]) -> Engine:
    """The engine of `cfg.engine.backend` over the trainer's `model`: `embedded` holds a copy in
    `cfg.model.dtype`; `http` (`sglang`) connects to the `tiller serve` (SGLang)
    servers at `cfg.engine.urls`, checks the servers against the
    model and pushes them `initial()` (weight versions go through `cfg.engine.weights_dir`,
    else `run_dir`/weights, whose folders below the run folder are never links)."""
    e = cfg.engine
    if e.backend in ("http", "sglang"):
        require_package("httpx", "serve", f"engine.backend={e.backend}")
        from tiller.engine.http import connect  # httpx is an optional extra
        from tiller.engine.sglang import SglangDialect
        from tiller.engine.wire import TILLER

        # a weights_dir of the config is the user's; the default is in the run folder
        return connect(e.urls, weights_dir=e.weights_dir or run_dir / "weights",
                       root=None if e.weights_dir else run_dir,
                       api_key=e.api_key.get_secret_value() if e.api_key else None,
                       request_timeout_s=e.request_timeout_s, max_retries=e.max_retries,
                       vocab_size=model.config.vocab_size,
                       max_context=model.config.max_position_embeddings,
                       initial=initial(), dtype=cfg.model.dtype,
                       dialect=SglangDialect() if e.backend == "sglang" else TILLER)
    return EmbeddedEngine(copy.deepcopy(model).to(getattr(torch, cfg.model.dtype)), pad_token_id,
                          max_batch_size=e.max_batch_size, cache_bytes=e.cache_bytes)
