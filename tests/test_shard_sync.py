"""Per-rank weight sync (weight_sync.shards: per_rank) from 2 trainer ranks to a real `tiller
serve`: every rank writes its own shard's part, the server applies a version only with every
part there; after N steps what the parts give equals the gathered copy bit for bit; a part
missing or a rank dead fails the sync in one line naming them, without a hang."""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import time
from contextlib import contextmanager

import pytest
import torch
from helpers import TINY_RUN
from test_distributed import batch_of
from test_http_engine import server_version, servers
from test_ray import no_ray_left, stop_local_ray  # noqa: F401 - a fixture

from tiller.config import WeightSyncConfig, load_config
from tiller.controller import train
from tiller.engine.http import HttpEngine
from tiller.engine.parts import check_tiled, part_name
from tiller.engine.updates import WeightSyncError, WeightUpdate
from tiller.engine.weight_sync import ShardedSync
from tiller.errors import ConfigError, RunError
from tiller.models import load_model
from tiller.serve.guard import resolve_below
from tiller.serve.native import _read_update
from tiller.train.distributed import TrainerOptions
from tiller.train.ranks import start_ranks

STEPS = 3


class Mirror:
    """A model fed each version's folder through the server's own reader (`_read_update`) and
    apply: what the server holds, to compare bit for bit (the server shows only checksums)."""

    def __init__(self, model_dir):
        self.model, self.version = load_model(model_dir), 0

    def take(self, root, folder, version: int) -> None:
        real, files = resolve_below(root, str(folder))
        update = _read_update(root, real, files, version, self)
        update.stage(self.model).apply()
        self.version = version


@contextmanager
def engine_of(leader, calc_model_dir, tmp_path):
    """One real `tiller serve` at the model's weights as v0, and the engine to it."""
    with servers(calc_model_dir, 1, tmp_path / "servers") as srv:
        root = srv.root.resolve()
        engine = HttpEngine(srv.urls, weights_dir=root / "weights", request_timeout_s=60.0)
        try:
            engine.update_weights(WeightUpdate.full(load_model(calc_model_dir), 0))
            yield leader, engine, srv, root
        finally:
            engine.close()


@pytest.fixture()
def setup(calc_model_dir, tmp_path):
    torch.manual_seed(0)
    leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(), "local", 120.0)
    try:
        with engine_of(leader, calc_model_dir, tmp_path) as ready:
            yield ready
    finally:
        leader.close()


def equal_the_gathered_copy(setup, calc_model_dir, tokenizer, mode: str) -> None:
    """STEPS SFT steps, each synced per rank: every version applied by the server, full then
    deltas (mode delta) or full each time, parity checked; then the server's weights (as the
    parts give them: `Mirror`) equal rank 0's gathered copy bit for bit."""
    leader, engine, srv, root = setup
    sync = ShardedSync(leader, engine, WeightSyncConfig(mode=mode), torch.float32)
    mirror = Mirror(calc_model_dir)
    leader.set_optimizer(1e-3)
    kinds = []
    for step in range(STEPS):
        out = leader.sft_step(batch_of(tokenizer), 2)
        assert "train/gather_s" not in out  # no per-step gather with per-rank parts
        metrics = sync.push()
        v = step + 1
        assert server_version(srv.urls[0]) == v == leader.version
        mirror.take(root, engine.weights_folder(v), v)
        kinds.append(metrics["sync/kind"])
        parts = [metrics[f"sync/part{r}_bytes"] for r in range(2)]
        assert sum(parts) == metrics["sync/bytes"] and min(parts) > 0
        assert all(metrics[f"sync/part{r}_s"] > 0 for r in range(2))
        assert metrics["sync/parity_mean_abs"] < 1e-5
    # the first sync is full (no rank holds a synced copy), the later ones are deltas
    assert kinds == ([0.0, 1.0, 1.0] if mode == "delta" else [0.0] * STEPS)
    assert leader.publisher.version == 0  # nothing gathered yet: the copy lags
    leader.gathered()
    assert leader.publisher.version == STEPS
    want, got = leader.publisher.model.state_dict(), mirror.model.state_dict()
    for name, t in want.items():
        assert torch.equal(got[name].view(torch.int32), t.view(torch.int32)), name


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["delta", "full"])
def test_per_rank_parts_equal_the_gathered_copy_bit_for_bit(setup, calc_model_dir, tokenizer,
                                                            mode):
    equal_the_gathered_copy(setup, calc_model_dir, tokenizer, mode)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_per_rank_parts_from_ray_rank_actors(calc_model_dir, tokenizer, tmp_path,
                                             no_ray_left):  # noqa: F811 - the fixture
    """cluster.backend ray: rank 1 is a Ray actor (a local Ray instance, 2 CPUs) that writes
    its own part in its own process; full then delta versions apply, parity holds, and the
    server's weights equal the gathered copy bit for bit, as with spawned ranks."""
    import ray

    temp = tempfile.mkdtemp(prefix="tray-")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
             _temp_dir=temp, log_to_driver=False, configure_logging=False)
    try:
        torch.manual_seed(0)
        leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(), "ray", 120.0)
        try:
            pid = ray.get(leader.ranks[0].actor.__ray_call__.remote(lambda _: os.getpid()),
                          timeout=60)
            assert pid != os.getpid()  # rank 1 runs in the actor's process
            with engine_of(leader, calc_model_dir, tmp_path) as ready:
                equal_the_gathered_copy(ready, calc_model_dir, tokenizer, "delta")
        finally:
            leader.close()
    finally:
        stop_local_ray(temp)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_missing_part_or_a_dead_rank_fails_the_sync_in_one_line(setup, tokenizer):
    leader, engine, srv, root = setup
    sync = ShardedSync(leader, engine, WeightSyncConfig(mode="delta"), torch.float32)
    leader.set_optimizer(1e-3)
    leader.sft_step(batch_of(tokenizer), 2)
    update, _ = sync.build(1)
    os.remove(engine.weights_folder(1) / part_name(1))  # rank 1's part never arrived
    with pytest.raises(RunError) as e:
        engine.update_weights(update)
    line = str(e.value)
    assert "\n" not in line and srv.urls[0] in line and "trainer rank(s) [1]" in line, line
    assert server_version(srv.urls[0]) == 0  # nothing applied
    assert not engine.weights_folder(1).exists() or not any(engine.weights_folder(1).iterdir())
    # rank 1 dies: the next sync fails naming it, bounded (no wait for its part)
    os.kill(leader.ranks[0].proc.pid, signal.SIGKILL)
    leader.ranks[0].proc.join(30)
    t0 = time.monotonic()
    with pytest.raises(RunError, match=r"^trainer rank 1 died \(exit code -9\) (before|during) "
                                       r"write_part$"):
        sync.push()
    assert time.monotonic() - t0 < 60
    assert server_version(srv.urls[0]) == 0


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_refused_delta_of_parts_falls_back_to_full_parts(setup, tokenizer, caplog):
    """A tiller serve restarted behind the run's back (engine.urls) holds v0 and refuses the
    next version's delta parts ("is against base version"): the sync pushes every rank's part
    full instead, counted (sync/delta_refused) and logged, as the gathered path does (review
    s8 F1: the run failed); the sync after it is a delta again."""
    leader, engine, srv, root = setup
    sync = ShardedSync(leader, engine, WeightSyncConfig(mode="delta"), torch.float32)
    leader.set_optimizer(1e-3)
    leader.sft_step(batch_of(tokenizer), 2)
    assert sync.push()["sync/kind"] == 0.0  # v1, full: no rank holds a synced copy yet
    srv.restart(0)  # back at v0 with the model's own weights
    assert server_version(srv.urls[0]) == 0
    leader.sft_step(batch_of(tokenizer), 2)
    with caplog.at_level(logging.WARNING, logger="tiller.engine.weight_sync"):
        metrics = sync.push()
    assert metrics["sync/delta_refused"] == 1.0 and metrics["sync/kind"] == 0.0
    assert metrics["sync/bytes"] == metrics["sync/full_bytes"] > 0
    assert metrics["sync/parity_mean_abs"] < 1e-5
    assert server_version(srv.urls[0]) == 2 == leader.version
    (warned,) = [r.getMessage() for r in caplog.records if "was refused" in r.getMessage()]
    assert warned.startswith("weight sync v2: the delta was refused (") and (
        "delta update v2 is against base version v1, but this server holds v0" in warned)
    assert warned.endswith("); pushing a full update instead")
    leader.sft_step(batch_of(tokenizer), 2)
    metrics = sync.push()
    assert metrics["sync/kind"] == 1.0 and "sync/delta_refused" not in metrics
    assert server_version(srv.urls[0]) == 3 and metrics["sync/parity_mean_abs"] < 1e-5


@pytest.mark.parametrize("overrides, why", [
    ([], "train.world_size is 1"),
    (["train.world_size=2", "engine.backend=vllm"], "engine.backend vllm"),
    (["train.world_size=2", "engine.backend=http", "engine.servers=1", "model.lora.r=4"],
     "model.lora"),
    (["train.world_size=2", "engine.backend=http", "engine.servers=1", "cluster.backend=ray",
      "cluster.address=127.0.0.1:6379"], "cluster.address"),
])
def test_per_rank_parts_where_they_cannot_run_are_refused_in_one_line(overrides, why):
    with pytest.raises(ConfigError) as e:
        load_config("configs/calculator.yaml",
                    [*TINY_RUN, "weight_sync.shards=per_rank", *overrides])
    line = str(e.value)
    assert line.startswith(f"config field weight_sync.shards: got per_rank with {why}")
    assert "\n" not in line and line.endswith("use weight_sync.shards: gathered")


def test_per_rank_parts_load_with_tiller_serve_and_ranks():
    cfg = load_config("configs/calculator.yaml", [
        *TINY_RUN, "weight_sync.shards=per_rank", "train.world_size=2", "engine.backend=http",
        "engine.servers=1"])
    assert cfg.weight_sync.shards == "per_rank"


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_run_syncs_per_rank_parts_and_saves_the_gathered_weights(tmp_path):
    """The demo over one managed tiller serve with 2 ranks and per-rank parts: every RL step's
    sync is logged per rank, the parity check passes at each, and the checkpoint after the
    last step and the final model (both gathered when saved, not after each step) hold the
    trained weights, not the SFT ones."""
    cfg = load_config("configs/calculator.yaml", [
        *TINY_RUN, "engine.backend=http", "engine.servers=1", "runtime.threads=1",
        "train.world_size=2", "weight_sync.shards=per_rank", "checkpoint.every=2"])
    train(cfg, tmp_path)
    every = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in every if r["phase"] == "rl"]
    assert len(rl) == 2
    for r in rl:
        assert r["sync/part0_bytes"] > 0 and r["sync/part1_bytes"] > 0
        assert r["sync/bytes"] == r["sync/part0_bytes"] + r["sync/part1_bytes"]
        assert r["sync/parity_mean_abs"] <= cfg.weight_sync.parity_tol
        assert "train/gather_s" not in r
    (final,) = [r for r in every if r["phase"] == "rl_summary"]
    assert final["ledger/started"] == final["ledger/trained"] > 0
    ckpt = load_model(tmp_path / "checkpoints" / "step-000002" / "model").state_dict()
    last = load_model(tmp_path / "checkpoints" / "final").state_dict()
    sft = load_model(tmp_path / "checkpoints" / "sft").state_dict()
    assert all(torch.equal(ckpt[k], last[k]) for k in last)
    assert any(not torch.equal(sft[k], last[k]) for k in last)


@pytest.mark.parametrize("ranges, ok", [
    ([(0, 6), (6, 4)], True), ([(6, 4), (0, 6)], True), ([(0, 10), (0, 10)], False),
    ([(0, 4), (2, 2), (4, 6)], False), ([(0, 4), (5, 5)], False), ([(0, 9)], False),
])
def test_the_parts_ranges_must_tile_each_tensor_exactly_once(ranges, ok):
    """A gap, a short cover or an overlap (review s8 F2: [(0, 10), (0, 10)] passed) is refused:
    nothing is applied."""
    own = {"w": torch.zeros(10)}
    if ok:
        check_tiled(own, {"w": ranges}, version=3)
    else:
        with pytest.raises(WeightSyncError, match="do not cover the model exactly"):
            check_tiled(own, {"w": ranges}, version=3)
