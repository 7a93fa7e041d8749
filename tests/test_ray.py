"""cluster.backend ray on a local Ray instance the run starts and stops: bad input stops the
run in one line before any work; a run whose rollout worker is killed mid-step retries its
episodes on the other worker and finishes with a complete ledger; trainer ranks as Ray actors.
Every test leaves no Ray process behind (`no_ray_left`)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_RUN, gone

from tiller.config import ConfigError, load_config
from tiller.controller import train
from tiller.errors import RunError
from tiller.observe.steps import ledger_unaccounted
from tiller.train.ranks import free_port

TESTS = str(Path(__file__).parent)
ROOT = Path(__file__).parent.parent


def ray_processes() -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    mine = str(os.getpid())
    return [line for line in ps.splitlines()
            if ("raylet" in line or "gcs_server" in line) and mine in line.split()[:2]]


@pytest.fixture()
def no_ray_left():
    """After the test, whatever happened: this process not connected to Ray and none of its
    processes left (checked before the shutdown that cleans up after a failed check)."""
    yield
    import ray

    try:
        assert not ray.is_initialized(), "the test left Ray connected"
        assert not ray_processes(), "the test left Ray processes"
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("error", [RunError("a tool failed to start"), KeyboardInterrupt()])
def test_a_run_that_fails_after_ray_started_stops_it(tmp_path, monkeypatch, no_ray_left,
                                                     error):
    """An error (or Ctrl-C) right after the local Ray instance started: Ray is stopped."""
    def fail(*args):
        raise error

    monkeypatch.setattr("tiller.run.check_tools", fail)
    with pytest.raises(type(error)):
        train(load_config("configs/calculator.yaml", [*TINY_RUN, "cluster.backend=ray"]),
              tmp_path / "run")


def one_line_before_any_work(tmp_path, *overrides):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train(load_config("configs/calculator.yaml", [*TINY_RUN, "cluster.backend=ray",
                                                      *overrides]), out)
    assert "\n" not in str(e.value) and not out.exists()
    return str(e.value)


def test_an_address_where_no_cluster_answers_stops_the_run(tmp_path):
    msg = one_line_before_any_work(tmp_path, f"cluster.address=127.0.0.1:{free_port()}")
    assert msg.startswith("config field cluster.address: got '127.0.0.1:")
    assert "ray start --head" in msg


@pytest.fixture()
def silent_port():
    """An address that accepts TCP and never answers: 127.0.0.2, which Ray dials as given (it
    replaces only 127.0.0.1 and localhost by this node's IP)."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        s.listen()
        yield f"127.0.0.2:{s.getsockname()[1]}"


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_an_address_that_accepts_tcp_but_is_no_cluster_stops_in_bounded_time(
        tmp_path, monkeypatch, silent_port):
    """Ray retries a GCS that does not answer for minutes (seen > 5 min); the probe is a child
    Python stopped at the limit."""
    monkeypatch.setattr("tiller.rollout.cluster.ADDRESS_TIMEOUT_S", 10.0)
    t0 = time.monotonic()
    msg = one_line_before_any_work(tmp_path, f"cluster.address={silent_port}")
    assert time.monotonic() - t0 < 10 + 10  # the limit, then the child killed
    assert msg == (f"config field cluster.address: got '{silent_port}'; something accepts TCP "
                   f"there but no Ray cluster answered within 10 s (give the GCS address "
                   f"`ray start --head` prints)")


def test_the_address_probed_is_the_one_ray_dials(tmp_path):
    """127.0.0.1:PORT is dialled by Ray at this node's IP: a listener on loopback only does not
    make the address answer."""
    from ray._private.services import canonicalize_bootstrap_address

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        dial = canonicalize_bootstrap_address(f"127.0.0.1:{port}")
        if dial.startswith("127.0.0.1:"):
            pytest.skip("this machine has no IP but loopback: Ray dials 127.0.0.1 as given")
        msg = one_line_before_any_work(tmp_path, f"cluster.address=127.0.0.1:{port}")
    assert msg.startswith(f"config field cluster.address: got '127.0.0.1:{port}' (Ray dials "
                          f"{dial}); no Ray cluster answers there (ConnectionRefusedError")


def children_with(pid: int, marker: str) -> list[int]:
    """Live processes whose parent is `pid` and whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes() \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(pid):
                found.append(int(entry.name))
        except OSError:  # exited meanwhile
            pass
    return found


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_sigterm_stops_tiller_train_while_it_probes_an_address(tmp_path, silent_port):
    """`tiller train ... cluster.address=` signalled while the probe waits: the run ends at once
    as a SIGTERM'd run does (128 + 15), and the probe's child is gone."""
    out, log = tmp_path / "run", (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiller", "train", "configs/calculator.yaml", *TINY_RUN,
         "cluster.backend=ray", f"cluster.address={silent_port}", "-o", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (probes := children_with(proc.pid, "tiller-probe")):
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not start its probe"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    assert proc.returncode == 128 + signal.SIGTERM, (tmp_path / "train.log").read_text()[-2000:]
    assert all(gone(pid, 5) for pid in probes)
    assert not out.exists()


@pytest.mark.parametrize(("address", "why"), [
    ("ray://10.0.0.1:10001", "Ray Client (ray://) is not supported"),
    ("auto", "expected HOST:PORT"),
    ("10.0.0.1", "expected HOST:PORT"),
])
def test_address_forms_tiller_cannot_use_refused_in_one_line(address, why):
    with pytest.raises(ConfigError) as e:
        load_config("configs/calculator.yaml", [*TINY_RUN, "cluster.backend=ray",
                                                f"cluster.address={address}"])
    assert str(e.value) == (f"config field cluster.address: got {address!r}; {why}: give the "
                            f"cluster's GCS address HOST:PORT, as `ray start --head` prints it "
                            f"(e.g. 10.0.0.1:6379)")


def test_an_ipv6_address_is_taken():
    cfg = load_config("configs/calculator.yaml", [*TINY_RUN, "cluster.backend=ray",
                                                  "cluster.address='[::1]:6379'"])
    assert cfg.cluster.address == "[::1]:6379"


def test_more_actors_than_cpus_stops_the_run(tmp_path):
    msg = one_line_before_any_work(tmp_path, "cluster.num_cpus=2", "cluster.rollout_workers=2",
                                   "train.world_size=2")
    assert msg.startswith("config field cluster.rollout_workers: 2 rollout workers and 1 "
                          "trainer rank(s) beyond rank 0 need 3 CPUs; the Ray cluster has 2")


def test_more_ranks_than_cpus_stops_a_local_run(tmp_path):
    out = tmp_path / "run"
    ranks = (os.cpu_count() or 1) + 1
    with pytest.raises(ConfigError) as e:
        train(load_config("configs/calculator.yaml", [*TINY_RUN, f"train.world_size={ranks}"]),
              out)
    assert str(e.value) == (f"config field train.world_size: got {ranks}; this machine has "
                            f"{ranks - 1} CPUs (os.cpu_count()), one per rank")
    assert not out.exists()


def test_a_missing_ray_install_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # how Python marks a package not importable
    msg = one_line_before_any_work(tmp_path)
    assert msg.startswith("cluster.backend=ray needs Ray: pip install")


def test_ray_knobs_refused_with_the_local_backend():
    with pytest.raises(ConfigError, match="cluster.rollout_workers: got 2; it only applies "
                                          "with cluster.backend: ray"):
        load_config("configs/calculator.yaml", [*TINY_RUN, "cluster.rollout_workers=2"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.world_size=2", "model.device=cuda"], "config field train.world_size: got 2 with "
     "model.device cuda; trainer ranks use gloo, so they run on CPU only (NCCL is not built): "
     "set model.device=cpu"),
    (["train.rank_timeout_s=60"], "config field train.rank_timeout_s: got 60.0; it only "
     "applies with train.world_size > 1"),
    (["cluster.object_store_mb=512"], "config field cluster.object_store_mb: got 512; it sizes "
     "a local Ray instance (cluster.backend: ray without cluster.address)"),
    (["cluster.backend=ray", "cluster.address=10.0.0.1:6379", "cluster.object_store_mb=512"],
     "config field cluster.object_store_mb: got 512; it sizes a local Ray instance "
     "(cluster.backend: ray without cluster.address)"),
    (["cluster.backend=ray", "env.tools.replay={path: calls.sqlite, mode: record}"],
     "config field env.tools.replay: got mode record; under cluster.backend: ray each rollout "
     "worker has its own tool stack, so one replay file is not shared (use cluster.backend: "
     "local)"),
])
def test_knobs_without_effect_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/calculator.yaml", [*TINY_RUN, *overrides])
    assert str(e.value) == message


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_killed_rollout_worker_is_retried_and_the_ledger_is_complete(
        tmp_path, monkeypatch, no_ray_left):
    marker = tmp_path / "killed"
    monkeypatch.setenv("TILLER_TEST_KILL_MARKER", str(marker))
    # the workers import kill_loop (the episode function travels by name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    summary = train(load_config("configs/calculator.yaml", [
        *TINY_RUN, "cluster.backend=ray", "cluster.rollout_workers=2",
        "agent.loop=kill_loop:run_episode", "eval.tasks=4"]), tmp_path / "run")
    assert marker.exists()  # a worker was killed
    ledger = summary["rl"]["ledger"]
    assert ledger["retried"] >= 1  # its in-flight episodes ran again on the other worker
    assert ledger["started"] == 2 * 4 * 4 and ledger_unaccounted(ledger) == 0
    assert ledger["trained"] + ledger.get("filtered/zero_variance", 0) == ledger["started"]
    assert summary["heldout_after_rl"]["tasks"] == 4  # evaluation after the kill ran


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_trainer_ranks_as_ray_actors(tmp_path, no_ray_left):
    """`tiller train configs/calculator.yaml cluster.backend=ray train.world_size=2`, tiny."""
    summary = train(load_config("configs/calculator.yaml", [
        *TINY_RUN, "cluster.backend=ray", "train.world_size=2", "eval.tasks=4"]),
        tmp_path / "run")
    assert summary["rl"]["ledger"]["trained"] == 2 * 4 * 4
    assert (tmp_path / "run" / "ray_logs").is_dir()  # the local instance's logs, kept


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_the_demo_learns_under_ray_like_local(tmp_path, no_ray_left):
    """RL from the same SFT checkpoint (the CI-scale demo's 300 SFT steps), same seed: held-out
    success under ray within the local run's 95% CI, and above SFT's."""
    sft = train(load_config("configs/calculator.yaml", [
        "sft.epochs=6", "rl.steps=0", "eval.enabled=false", "logging.progress=false",
        "logging.report=false"]), tmp_path / "sft")
    rl = ["model.build=null", f"model.path={sft['sft']['checkpoint']}", "sft.enabled=false",
          "rl.steps=10", "eval.tasks=96", "logging.progress=false", "logging.report=false"]
    local = train(load_config("configs/calculator.yaml", rl), tmp_path / "local")
    ray = train(load_config("configs/calculator.yaml", [*rl, "cluster.backend=ray"]),
                tmp_path / "ray")
    want, got = local["heldout_after_rl"], ray["heldout_after_rl"]
    assert want["ci_low"] <= got["success"] <= want["ci_high"]
    assert got["success"] >= ray["heldout_after_sft"]["success"] + 0.15  # it learned


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_trainer_rank_actor_that_dies_fails_the_step_naming_it(calc_model_dir, tokenizer,
                                                                 no_ray_left):
    import ray
    from test_distributed import batch_of

    from tiller.models import load_model
    from tiller.train.distributed import TrainerOptions
    from tiller.train.ranks import start_ranks

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
             log_to_driver=False, configure_logging=False)
    leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(), "ray", 60.0)
    try:
        leader.set_optimizer(1e-3)
        ray.kill(leader.ranks[0].actor)
        with pytest.raises(RunError, match=r"^trainer rank 1 died \(Ray actor: \w+\) during "
                                           r"sft_step$"):
            leader.sft_step(batch_of(tokenizer), 2)
    finally:
        leader.close()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_trainer_rank_actor_that_fails_ends_rank_0s_wait(calc_model_dir, tokenizer,
                                                           no_ray_left):
    """The actor stays alive after its step raised; it leaves the process group, so rank 0's
    collective ends at once, not at train.rank_timeout_s (120 s)."""
    import time

    import ray
    from test_distributed import batch_of

    from tiller.models import load_model
    from tiller.train.distributed import TrainerOptions
    from tiller.train.ranks import RayRank, start_ranks

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
             log_to_driver=False, configure_logging=False)
    leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(), "ray", 120.0)
    try:
        leader.set_optimizer(1e-3)
        rank = leader.ranks[0]
        rank.send = lambda name, args, lrs: RayRank.send(rank, name, (None, *args[1:]), lrs)
        t0 = time.monotonic()
        with pytest.raises(RunError) as e:
            leader.sft_step(batch_of(tokenizer), 2)
        assert time.monotonic() - t0 < 30
        assert str(e.value) == ("trainer rank 1 failed (AttributeError: 'NoneType' object has "
                                "no attribute 'loss_mask') during sft_step")
    finally:
        leader.close()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_trainer_rank_actor_that_dies_during_start_fails_it_at_once(no_ray_left):
    import time

    import ray
    from test_rank_failures import DiesWhenLoaded

    from tiller.train.distributed import TrainerOptions
    from tiller.train.ranks import start_ranks

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20,
             log_to_driver=False, configure_logging=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunError, match=r"^trainer rank 1 died during start: Ray actor: "):
            start_ranks(DiesWhenLoaded(2, 2), 2, TrainerOptions(), "ray", 120.0)
        assert time.monotonic() - t0 < 60
    finally:
        ray.shutdown()
