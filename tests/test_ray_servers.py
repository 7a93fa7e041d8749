"""Engine servers under cluster.backend ray (engine/ray_servers.py, rollout/ray_http.py): each
managed server in a Ray actor placed with a placement group, the rollout workers generating on
the servers over HTTP while the run's engine pushes the weights. A killed server actor leaves no
process; a run whose server actor is killed mid-step retries on the other server and finishes,
and with no server left stops in one line. Every test leaves no Ray process behind."""

import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_RUN, tiny_rl
from test_http_engine import GENERATED, recorders, server_version, servers, url
from test_ray import (  # noqa: F401 - a fixture
    TESTS,
    no_ray_left,
    one_line_before_any_work,
    stop_local_ray,
)
from test_servers import spec
from test_vllm_demo import VLLM, served_from

from tiller.config import load_config
from tiller.controller import train
from tiller.engine.api import SamplingParams
from tiller.engine.factory import launcher
from tiller.engine.follower import Followed, run_api_key
from tiller.engine.http import HttpEngine
from tiller.engine.ray_servers import RayServers
from tiller.errors import RunError
from tiller.observe.steps import ledger_unaccounted

HTTP = ["cluster.backend=ray", "engine.backend=http", "runtime.threads=1", "eval.tasks=4"]


def group_left(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    left = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or it exited meanwhile
        if proc.name.isdigit() and int(stat[2]) == pgid and stat[0] != "Z":
            left.append(int(proc.name))
    return left


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def gone_within(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while group_left(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not group_left(pgid)


@pytest.fixture()
def local_ray(no_ray_left, request):  # noqa: F811 - the fixture imported above
    """A local Ray instance of 2 CPUs (and `request.param` GPUs it is told it has: Ray counts
    them, and gives each actor that reserves one its CUDA_VISIBLE_DEVICES, GPU or not)."""
    import ray

    temp = tempfile.mkdtemp(prefix="tiller-ray-")
    try:  # a start-up that fails (seen at load ~24: the node timed out) leaves nothing either
        ray.init(num_cpus=2, num_gpus=getattr(request, "param", 0), include_dashboard=False,
                 object_store_memory=100 * 2**20, _temp_dir=temp, log_to_driver=False,
                 configure_logging=False)
        yield ray
    finally:
        stop_local_ray(temp)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_killed_server_actor_leaves_no_server_process(tmp_path, local_ray):
    """Two servers on bundles of 1 CPU, each with a child process of its own (in its group,
    ignoring SIGTERM): `ray.kill` of one actor and SIGKILL of the other's process each take
    the server and its child with them; close after that still ends cleanly."""
    ray = local_ray
    children = [tmp_path / "child0.pid", tmp_path / "child1.pid"]
    servers = RayServers([spec(f"serve-{i}", "--child-pid", str(c))
                          for i, c in enumerate(children)], log_dir=tmp_path,
                         startup_timeout_s=30, cpus=1)
    urls = servers.start()
    try:
        assert all(u.startswith("http://127.0.0.1:") for u in urls) and len(set(urls)) == 2
        assert ray.available_resources().get("CPU", 0) == 0  # both bundles hold their CPU
        pids = ray.get([a.pid.remote() for a in servers.actors], timeout=30)
        assert servers.exited() == []  # both running
        for pid, child in zip(pids, children, strict=True):  # the server and its child
            assert sorted(group_left(pid)) == sorted([pid, int(child.read_text())])
        ray.kill(servers.actors[0], no_restart=True)
        assert gone_within(pids[0], 10)
        os.kill(parent_of(pids[1]), signal.SIGKILL)  # the actor's process crashes
        assert gone_within(pids[1], 10)
        assert group_left(pids[0]) == group_left(pids[1]) == []
        # what the run's engine names when every server is down (HttpEngine._all_down)
        gone = servers.exited()
        assert [line.split(" (")[0] for line in gone] == ["server serve-0", "server serve-1"]
        assert all("its Ray actor died, and the server with it; log" in g for g in gone)
    finally:
        servers.close()
    assert servers.actors == [] and servers.group is None
    deadline = time.monotonic() + 10  # the removed group's CPUs come back
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_server_that_exits_at_start_up_is_one_line_and_nothing_is_left(tmp_path, local_ray):
    ray = local_ray
    bad = spec("serve-1")
    bad = type(bad)(bad.name, [sys.executable, "-c", "import sys; sys.exit(3)"])
    servers = RayServers([spec("serve-0"), bad], log_dir=tmp_path, startup_timeout_s=30,
                         cpus=1)
    with pytest.raises(RunError) as e:
        servers.start()
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("server serve-1 (http://127.0.0.1:")
    assert f"exited with code 3 during start-up; log {tmp_path / 'serve-1.log'}" in str(e.value)
    assert servers.actors == [] and servers.group is None
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == 2


def left_on_ray(ray, timeout_s: float = 10.0) -> tuple[list[str], list[str]]:
    """The actors not dead and the placement groups not removed, once the kills and removals
    have landed (or after `timeout_s`): Ray's GCS tables (`ray.util.state` needs the
    dashboard, which these tests do not start)."""
    deadline = time.monotonic() + timeout_s
    while True:
        actors = [a["ActorClassName"] for a in ray._private.state.actors().values()
                  if a["State"] != "DEAD"]
        groups = [g["name"] for g in ray.util.placement_group_table().values()
                  if g["state"] != "REMOVED"]
        if not (actors or groups) or time.monotonic() > deadline:
            return actors, groups
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_server_actor_not_created_leaves_no_actor_or_group(tmp_path, local_ray):
    """The 2nd of 2 actors cannot be created (its name is the 1st's): the 1st actor is killed
    and the group removed before the one line naming the server."""
    servers = RayServers([spec("serve-0"), spec("serve-0")], log_dir=tmp_path,
                         startup_timeout_s=30, cpus=1)
    with pytest.raises(RunError) as e:
        servers.start()
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("ray: engine server serve-0's actor was not created "
                                   "(ActorAlreadyExistsError: The name tiller-server-serve-0-")
    assert left_on_ray(local_ray) == ([], [])


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_rollout_worker_that_fails_to_start_leaves_no_actor_or_group(tmp_path, local_ray):
    """Worker 1 of 2 raises in its constructor (its folder is a file): the start fails in one
    line naming it and the error, with worker 0 killed and the group removed."""
    from tiller.envs.calculator import CalculatorEnv
    from tiller.rollout.ray_rollouts import RayWorkers

    cfg = load_config("configs/calculator.yaml", [
        *TINY_RUN, *HTTP, "cluster.rollout_workers=2", "engine.servers=1"])
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "worker1").write_text("not a folder")
    with pytest.raises(RunError) as e:  # no server: a follower connects at its first request
        RayWorkers(cfg, None, None, CalculatorEnv, None, None, tmp_path,
                   servers=Followed(["http://127.0.0.1:9"], 64))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("ray: rollout worker 1 failed to start (ActorDiedError: its "
                                   "constructor raised FileExistsError: [Errno 17] File exists")
    assert left_on_ray(local_ray) == ([], [])


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_group_the_cluster_cannot_place_fails_within_the_start_up_timeout(tmp_path,
                                                                             local_ray):
    """A server bundle of 3 CPUs on a 2-CPU cluster: the start fails after
    engine.startup_timeout_s (not that plus the servers' start), naming the group and what it
    asked for, and the group is removed."""
    servers = RayServers([spec("serve-0")], log_dir=tmp_path, startup_timeout_s=3, cpus=3)
    t0 = time.monotonic()
    with pytest.raises(RunError) as e:
        servers.start()
    took = time.monotonic() - t0
    assert 3 <= took < 3 + 10  # the limit, then removing the group (slow on a loaded machine)
    msg = str(e.value)
    assert "\n" not in msg
    assert re.fullmatch(r"ray: placement group tiller-1-engine-servers-[0-9a-f]{8} \(1 x \{CPU: "
                        r"3, node:[0-9.]+: 0.001\}\) was not placed within 3s; the cluster has "
                        r"\{.*CPU: 2.*\} free", msg), msg
    assert left_on_ray(local_ray) == ([], [])


@pytest.fixture()
def raylet_key(monkeypatch):
    """TILLER_API_KEY as the local Ray instance's processes inherit it (requested before
    `local_ray`, which starts it); a test sets the run's own after."""
    monkeypatch.setenv("TILLER_API_KEY", "stale")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_workers_send_the_runs_api_key_not_the_raylets(tmp_path, monkeypatch, raylet_key,
                                                           local_ray):
    """The run's TILLER_API_KEY (set after Ray started) is what a rollout worker's engine
    sends, handed to it by the run's process, not what the worker's own environment says."""
    from tiller.envs.calculator import CalculatorEnv
    from tiller.rollout.ray_http import RayHttpWorkers

    monkeypatch.setenv("TILLER_API_KEY", "k3y")
    cfg = load_config("configs/calculator.yaml", [*TINY_RUN, *HTTP, "engine.servers=1"])
    params = SamplingParams(temperature=1.0, max_new_tokens=1, stop_token_ids=(2,))
    with recorders(1, {"/generate": GENERATED}) as srvs:
        engine = HttpEngine([url(srvs[0])], weights_dir=tmp_path / "w", api_key="k3y")
        engine.max_context = 64
        workers = RayHttpWorkers(cfg, engine, None, CalculatorEnv, None, None, tmp_path)
        try:
            got = workers.wait_all("generate", lambda w: w.generate.remote([1, 2], params, 0),
                                   60)
        finally:
            workers.close()
    assert [g.token_ids for g in got.values()] == [[4]]
    assert [auth for path, _, auth in srvs[0].calls if path == "/generate"] == ["Bearer k3y"]
    assert "k3y" not in repr(Followed([], 1, run_api_key(cfg)))


CUDA = "engine.gpus=1"  # a CUDA build of vLLM


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing to refuse")
def test_vllm_servers_on_cuda_without_a_gpu_stop_the_run(tmp_path):
    msg = one_line_before_any_work(tmp_path, *VLLM, CUDA)
    assert msg == ("config field engine.gpus: 1 vLLM server(s) of 1 GPU(s) need 1 GPU(s) under "
                   "cluster.backend=ray; the Ray cluster has 0 (torch.cuda.device_count() here, "
                   "which the local Ray instance also finds)")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("local_ray", [1], indirect=True)
def test_a_server_on_cuda_is_placed_with_a_gpu(tmp_path, local_ray):
    """vLLM on CUDA (engine.gpus=1) under ray: each server's bundle reserves a GPU (1 GPU
    declared to the local instance; no GPU here), the server process gets it as
    CUDA_VISIBLE_DEVICES; `tiller serve` (CPU only) and vLLM on CPU reserve none (under
    cluster.backend local engine.gpus is refused: test_knobs_without_effect_refused_in_one_line)."""
    base = [*TINY_RUN, "cluster.backend=ray", *VLLM]
    assert launcher(load_config("configs/calculator.yaml", [*base, CUDA])).keywords == {
        "cpus": 1, "gpus": 1}
    for other in (base, [*TINY_RUN, *HTTP, "engine.servers=1"]):
        assert load_config("configs/calculator.yaml", other).server_gpus == 0
    servers = RayServers([spec("serve-0")], log_dir=tmp_path, startup_timeout_s=30, cpus=1,
                         gpus=1)
    servers.start()
    try:
        (group,) = local_ray.util.placement_group_table().values()
        assert [{k: v for k, v in b.items() if not k.startswith("node:")}
                for b in group["bundles"].values()] == [{"CPU": 1.0, "GPU": 1.0}]
        assert local_ray.available_resources().get("GPU", 0) == 0
        pid = local_ray.get(servers.actors[0].pid.remote(), timeout=30)
        env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text()
                   .split("\0") if "=" in v)
        assert env["CUDA_VISIBLE_DEVICES"] == "0"
    finally:
        servers.close()
    assert left_on_ray(local_ray) == ([], [])


def rows(run_dir: Path, phase: str) -> list[dict]:
    every = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in every if r["phase"] == phase]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_demo_trains_through_tiller_serve_placed_by_ray(tmp_path, no_ray_left):  # noqa: F811
    run = tmp_path / "run"
    summary = train(load_config("configs/calculator.yaml", [*TINY_RUN, *HTTP,
                                                            "engine.servers=1"]), run)
    rl = rows(run, "rl")
    assert len(rl) == 2 and summary["heldout_after_rl"]["tasks"] == 4
    ledger = summary["rl"]["ledger"]
    assert ledger["started"] == 2 * 4 * 4 and ledger_unaccounted(ledger) == 0
    assert ledger["trained"] + ledger.get("filtered/zero_variance", 0) == ledger["started"]
    # the workers generated on the server (their followers' requests are in the counters),
    # the run's engine pushed to it each step, and the parity probe scored it
    assert all(r["engine/servers_up"] == 1 and r["engine/retries"] == 0 for r in rl)
    assert rl[-1]["engine/requests"] > 2 * 4 * 4 and rl[-1]["engine/weight_pushes"] >= 3
    assert max(r["logp_mismatch_max"] for r in rl) < 1e-4
    assert max(r["sync/parity_max_abs"] for r in rl) < 1e-4
    log = (run / "servers" / "serve-0.log").read_text()
    assert "-m tiller serve" in log and "Application shutdown complete" in log  # SIGTERM
    assert not served_from(run / "serve-model")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_demo_trains_through_vllm_placed_by_ray(tmp_path, no_ray_left):  # noqa: F811
    """The same path with a managed vLLM CPU server (needs .venv-vllm: scripts/setup.sh)."""
    run = tmp_path / "run"
    summary = train(load_config("configs/calculator.yaml", [
        *TINY_RUN, *VLLM, "cluster.backend=ray", "eval.tasks=4"]), run)
    rl = rows(run, "rl")
    assert len(rl) == 2 and summary["heldout_after_rl"]["tasks"] == 4
    ledger = summary["rl"]["ledger"]
    assert ledger["started"] == 2 * 4 * 4 and ledger_unaccounted(ledger) == 0
    assert all(r["engine/servers_up"] == 1 and r["sync/kind"] == 0 for r in rl)  # full pushes
    assert max(r["logp_mismatch_max"] for r in rl) < 1e-4
    assert max(r["sync/parity_max_abs"] for r in rl) < 1e-4
    assert (run / "servers" / "vllm-0.log").is_file()
    assert not served_from(run / "vllm-model")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("error", [RunError("the weight sync failed"), KeyboardInterrupt()])
def test_a_run_that_fails_once_its_servers_run_stops_them(tmp_path, monkeypatch, error,
                                                          no_ray_left):  # noqa: F811
    """An error (or Ctrl-C) right after the servers and workers started: each server is
    stopped through its actor (SIGTERM: uvicorn's orderly shutdown in its log), and Ray."""
    def fail(*args):
        raise error

    monkeypatch.setattr("tiller.run.WeightSync", fail)
    run = tmp_path / "run"
    with pytest.raises(type(error)):
        train(load_config("configs/calculator.yaml", [*TINY_RUN, *HTTP, "engine.servers=1"]),
              run)
    assert "Application shutdown complete" in (run / "servers" / "serve-0.log").read_text()
    assert not served_from(run / "serve-model")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_attached_servers_under_ray(calc_sft_dir, tmp_path, no_ray_left):  # noqa: F811
    """engine.urls under ray: the workers generate on a `tiller serve` the test started, the
    run pushes its weights to it, and leaves it running."""
    with servers(calc_sft_dir, 1, tmp_path / "servers") as s:
        summary = train(load_config("configs/calculator.yaml", tiny_rl(
            calc_sft_dir, "model.dtype=float32", "cluster.backend=ray", "engine.backend=http",
            f"engine.urls={json.dumps(s.urls)}", f"engine.weights_dir={s.root / 'w'}")),
            tmp_path / "run")
        assert s.procs[0].poll() is None  # attached: not stopped by the run
        assert server_version(s.urls[0]) > 0  # the run's weights were pushed to it
    ledger = summary["rl"]["ledger"]
    assert ledger["started"] == 2 * 4 and ledger_unaccounted(ledger) == 0
    (row,) = rows(tmp_path / "run", "rl")
    assert row["engine/requests"] >= 8 and row["engine/retries"] == 0
    assert row["sync/parity_max_abs"] < 1e-4


def kill_run(tmp_path, monkeypatch, *overrides):
    marker = tmp_path / "killed"
    monkeypatch.setenv("TILLER_TEST_KILL_MARKER", str(marker))
    # the workers import kill_server_loop (the episode function travels by name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    cfg = load_config("configs/calculator.yaml", [  # sync: why in kill_server_loop
        *TINY_RUN, *HTTP, "agent.loop=kill_server_loop:run_episode", "rl.mode=sync",
        *overrides])
    return marker, cfg


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["actor", "process"])
def test_a_killed_server_actor_is_retried_on_the_other_server(tmp_path, monkeypatch,
                                                              no_ray_left, how):  # noqa: F811
    """Server 0 killed mid-step: its Ray actor (`ray.kill`, the server dies with it), or the
    server process itself (SIGKILL; its actor lives on): the requests on it are retried on
    server 1, later pushes skip it, and the run finishes with a complete ledger."""
    monkeypatch.setenv("TILLER_TEST_KILL_HOW", how)
    marker, cfg = kill_run(tmp_path, monkeypatch, "engine.servers=2", "cluster.num_cpus=3")
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert marker.exists()  # server 0's actor was killed
    ledger = summary["rl"]["ledger"]
    assert ledger["started"] == 2 * 4 * 4 and ledger_unaccounted(ledger) == 0
    assert ledger["trained"] + ledger.get("filtered/zero_variance", 0) == ledger["started"]
    last = rows(run, "rl")[-1]
    assert last["engine/retries"] >= 1 and last["engine/servers_marked_down"] >= 1
    assert last["engine/push_skipped_down"] >= 1  # the next pushes found it dead
    assert last["engine/servers_up"] == 1
    assert summary["heldout_after_rl"]["tasks"] == 4
    assert group_left(int(marker.read_text())) == []  # the killed server's processes
    assert not served_from(run / "serve-model")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("server", "model", "name"),
                         [(["engine.servers=1"], "serve-model", "tiller serve"),
                          (VLLM, "vllm-model", "vLLM")])
def test_a_run_whose_only_server_actor_is_killed_stops_in_one_line(
        tmp_path, monkeypatch, no_ray_left, server, model, name):  # noqa: F811
    """`tiller serve`, and vLLM (its engine core a process of its own in the server's group:
    the whole group is gone after the kill)."""
    marker, cfg = kill_run(tmp_path, monkeypatch, *server)
    run = tmp_path / "run"
    t0 = time.monotonic()
    with pytest.raises(RunError) as e:
        train(cfg, run)
    assert time.monotonic() - t0 < 300  # no wait ran to a long timeout
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"every {name} server is down (http://127.0.0.1:")
    assert group_left(int(marker.read_text())) == []
    assert not served_from(run / model)


def test_more_actors_and_servers_than_cpus_stops_the_run(tmp_path):
    msg = one_line_before_any_work(tmp_path, "engine.backend=http", "engine.servers=2",
                                   "runtime.threads=1", "cluster.num_cpus=2")
    assert msg == ("config field cluster.rollout_workers: 1 rollout workers, 0 trainer rank(s) "
                   "beyond rank 0 and 2 engine server(s) of 1 thread(s) need 3 CPUs; the Ray "
                   "cluster has 2 (cluster.num_cpus)")


def test_auto_threads_give_each_server_one_cpu_under_ray():
    cfg = load_config("configs/calculator.yaml", [*TINY_RUN, "cluster.backend=ray",
                                                  "engine.backend=http", "engine.servers=2"])
    assert cfg.server_threads == 1 and cfg.managed_servers == 2
    local = load_config("configs/calculator.yaml", [*TINY_RUN, "engine.backend=http",
                                                    "engine.servers=2"])
    assert local.server_threads == "auto"


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_hung_actors_cost_one_deadline_not_one_each(local_ray):
    """`finished`, what RayServers.close/exited and RayWorkers.gather wait with: 3 hung actors
    and one that answers, 2 s: one deadline over all (about 2 s, not 3 x 2 s), the answer
    ready, the hung ones not."""
    import ray

    from tiller.engine.ray_servers import finished

    class Hung:  # defined here: pickled by value (the workers cannot import this module)
        """An actor whose `hang` never answers (a server actor stuck in its close)."""

        def hang(self) -> None:
            time.sleep(3600)

        def answer(self) -> int:
            return 1

    actors = [ray.remote(num_cpus=0)(Hung).remote() for _ in range(4)]
    assert ray.get([a.answer.remote() for a in actors], timeout=120) == [1] * 4  # all started
    refs = [a.hang.remote() for a in actors[:3]] + [actors[3].answer.remote()]
    t0 = time.monotonic()
    done = finished(refs, 2.0)
    took = time.monotonic() - t0
    assert done == {refs[3]}
    assert 2.0 <= took < 2.0 + 3.0, took  # 3 waits in turn would be >= 6 s
    for a in actors:
        ray.kill(a)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_worker_that_does_not_answer_a_metrics_call_is_counted_and_the_run_goes_on(
        tmp_path, monkeypatch, caplog, local_ray, model, tokenizer, limits):
    """Two rollout workers (embedded engines), worker 1 frozen (SIGSTOP: a loaded or swapped
    process) while the run reads the step metrics (`tool_stats`, `stats`; their wait shortened
    to 2 s): each call returns what worker 0 answered (for the engine counters, worker 1's last
    answer stands in), worker 1 is named in the log and counted in `unanswered`, and nothing
    raises. Once it runs again, both answer, and the tool counts of worker 1's window before
    it froze come with the next call (its late answer kept, not lost)."""
    from tiller.envs.calculator import CalculatorEnv
    from tiller.rollout import ray_rollouts
    from tiller.tools.executor import ToolCounters
    from tiller.tools.stack import merged_stats

    def three_calls(w) -> None:  # worker 1's tool stack ran calculate 3 times
        w.tools.executor.counters["calculate"] = ToolCounters(calls=3, ok=3)

    monkeypatch.setattr(ray_rollouts, "CLOSE_TIMEOUT_S", 2.0)
    cfg = load_config("configs/calculator.yaml", [
        *TINY_RUN, "cluster.backend=ray", "cluster.rollout_workers=2"])
    workers = ray_rollouts.RayWorkers(cfg, model, tokenizer, CalculatorEnv, None, limits,
                                      tmp_path)
    try:
        before = workers.stats()
        assert len(workers.tool_stats()) == 2 and workers.unanswered == 0
        pid = local_ray.get(workers.workers[1].__ray_call__.remote(lambda _: os.getpid()),
                            timeout=60)
        local_ray.get(workers.workers[1].__ray_call__.remote(three_calls), timeout=60)
        os.kill(pid, signal.SIGSTOP)
        try:
            with caplog.at_level("ERROR", logger="tiller.rollout.ray_rollouts"):
                t0 = time.monotonic()
                tools = workers.tool_stats()
                stats = workers.stats()
                took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert len(tools) == 1 and workers.unanswered == 2 and workers.live == [0, 1]
        assert 4.0 <= took < 4.0 + 5.0, took  # two waits of 2 s
        assert stats == {**before, "unanswered": 2.0}  # worker 1's last counters stand in
        assert [r.getMessage() for r in caplog.records] == [
            "ray: rollout worker 1 did not answer its tool stats within 2s (1 unanswered)",
            "ray: rollout worker 1 did not answer its stats within 2s (2 unanswered)"]
        tools = workers.tool_stats()  # it answers again, the late call first
        assert len(tools) == 3 and workers.unanswered == 2 and workers.late_tools == []
        assert merged_stats(tools)["tool_calls/calculate"] == 3.0
    finally:
        workers.close()
    assert left_on_ray(local_ray) == ([], [])
