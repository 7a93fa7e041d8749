"""The embedded engine in processes of its own: `engine.backend: http` with `engine.servers`
starts `tiller serve` processes (engine/servers.py), trains through them and stops them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TINY_RUN
from test_vllm_demo import served_from

from tiller.config import load_config
from tiller.controller import train
from tiller.errors import ConfigError

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_demo_trains_through_a_managed_tiller_serve(tmp_path: Path) -> None:
    cfg = load_config("configs/calculator.yaml", [*TINY_RUN, "engine.backend=http",
                                                  "engine.servers=1", "runtime.threads=1"])
    summary = train(cfg, tmp_path)
    every = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in every if r["phase"] == "rl"]
    assert len(rl) == 2 and summary["heldout_after_rl"]["tasks"] == 16
    assert max(r["logp_mismatch_max"] for r in rl) < 1e-4
    assert all(r["engine/servers_up"] == 1 for r in rl)
    (final,) = [r for r in every if r["phase"] == "rl_summary"]
    assert final["ledger/started"] == final["ledger/trained"] > 0
    log = (tmp_path / "servers" / "serve-0.log").read_text()
    assert "-m tiller serve" in log and "Application shutdown complete" in log  # SIGTERM
    assert not served_from(tmp_path / "serve-model")


def test_urls_or_servers_not_both() -> None:
    with pytest.raises(ConfigError, match="engine.urls: .* or set engine.servers"):
        load_config("configs/calculator.yaml", ["engine.backend=http"])
    with pytest.raises(ConfigError, match="not both"):
        load_config("configs/calculator.yaml", ["engine.backend=http", "engine.servers=1",
                                                "engine.urls=[http://127.0.0.1:1]"])
