"""The HTTP backend against real servers on 127.0.0.1: token-in/token-out generation, sticky
sessions and least-loaded placement, a server killed mid-collection (its requests retried on
the other and counted, no episode lost), weight pushes checked per server, control calls fanned
out, and short training runs with `engine.backend: http`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from helpers import rl_rows, tiny_rl

from tiller.config import load_config
from tiller.controller import rl
from tiller.engine import transport
from tiller.engine.api import SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.factory import connect
from tiller.engine.http import HttpEngine, ServerDown
from tiller.engine.sglang import SglangDialect
from tiller.engine.updates import WeightUpdate
from tiller.engine.wire import error_text, short
from tiller.envs import ENVS
from tiller.errors import ConfigError, RunError
from tiller.models import load_model
from tiller.observe.steps import ledger_unaccounted
from tiller.rollout.agent_loop import EngineActor, run_episode
from tiller.rollout.chat import stop_token_ids
from tiller.rollout.collect import collect
from tiller.run import Run

START_TIMEOUT_S = 180.0  # importing torch and transformers on a loaded 2-core box is slow


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


class Servers:
    """`tiller serve` subprocesses on free ports, reading weights below `root`, logging to
    root/`name`<i>.log; `kill(i)` is a SIGKILL (a crash, no goodbye)."""

    def __init__(self, model_dir: Path, n: int, root: Path, name: str = "server"):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.logs = [root / f"{name}{i}.log" for i in range(n)]
        self.cmds = []
        for i in range(n):
            port = free_port()
            self.cmds.append([sys.executable, "-m", "tiller", "serve", str(model_dir), "--port",
                              str(port), "--weights-root", str(root)])
            with open(self.logs[i], "w") as log:
                self.procs.append(subprocess.Popen(self.cmds[i], stdout=log,
                                                   stderr=subprocess.STDOUT))
            self.urls.append(f"http://127.0.0.1:{port}")
        self.wait_up(range(n))

    def wait_up(self, which) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for i in which:
            url = self.urls[i]
            while True:
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"server {url} exited: {self.logs[i].read_text()[-2000:]}")
                try:
                    if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tiller serve at {url} did not answer /health within "
                                       f"{START_TIMEOUT_S} s")
                time.sleep(0.2)

    def freeze(self, i: int) -> None:
        """SIGSTOP: requests sent to it now hang, so a kill that follows finds them in flight."""
        self.procs[i].send_signal(signal.SIGSTOP)

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait(10)

    def restart(self, i: int) -> None:
        """SIGKILL server i and start it again on the same port (MODEL_DIR's weights)."""
        self.kill(i)
        with open(self.logs[i], "a") as log:
            self.procs[i] = subprocess.Popen(self.cmds[i], stdout=log, stderr=subprocess.STDOUT)
        self.wait_up([i])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@contextmanager
def servers(model_dir: Path, n: int, root: Path, name: str = "server") -> Iterator[Servers]:
    s = None
    try:
        s = Servers(model_dir, n, root, name)
        yield s
    finally:
        if s is not None:
            s.close()


@pytest.fixture(scope="module")
def shared_servers(calc_model_dir, tmp_path_factory):
    with servers(calc_model_dir, 2, tmp_path_factory.mktemp("servers")) as s:
        yield s


@pytest.fixture()
def two_servers(shared_servers, calc_model_dir, tmp_path):
    """The module's two servers, holding the fixture model's weights at version 0 (a test may
    have pushed others) and no KV kept from earlier tests."""
    http = HttpEngine(shared_servers.urls, weights_dir=shared_servers.root / "reset")
    try:
        http.update_weights(WeightUpdate.full(load_model(calc_model_dir), 0))
        http.flush_cache()
    finally:
        http.close()
    return shared_servers


@pytest.fixture()
def own_servers(calc_model_dir, tmp_path):
    """Two servers of this test's own (it kills one)."""
    with servers(calc_model_dir, 2, tmp_path / "servers") as s:
        yield s


@pytest.fixture()
def params(tokenizer, model):
    return SamplingParams(temperature=1.0, max_new_tokens=12,
                          stop_token_ids=stop_token_ids(tokenizer, model.generation_config))


def engine_for(servers_or_urls, tmp_path, **kwargs) -> HttpEngine:
    """An engine over real servers (writing weights below their --weights-root) or bare URLs."""
    kwargs.setdefault("request_timeout_s", 60.0)
    if isinstance(servers_or_urls, Servers):
        weights = servers_or_urls.root / f"weights-{tmp_path.name}"
        return HttpEngine(servers_or_urls.urls, weights_dir=weights, **kwargs)
    return HttpEngine(servers_or_urls, weights_dir=tmp_path / "weights", **kwargs)


def server_version(url: str) -> int:
    return httpx.get(url + "/get_model_info", timeout=10).json()["weight_version"]


async def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        await asyncio.sleep(0.001)


# ---------------------------------------------------------------- generation and routing
@pytest.mark.slow
@pytest.mark.integration
def test_generate_round_trips_token_ids_and_logprobs(two_servers, model, tokenizer, params,
                                                     tmp_path):
    """The server samples what the embedded engine samples with the same weights and seed."""
    http = engine_for(two_servers.urls[:1], tmp_path)
    local = EmbeddedEngine(model, tokenizer.pad_token_id)
    prompt = tokenizer.encode("2 + 3 =")
    try:
        got = asyncio.run(http.generate(prompt, params, 7, session_id="s"))
        want = asyncio.run(local.generate(prompt, params, 7))
    finally:
        http.close()
    assert got.token_ids == want.token_ids and len(got.token_ids) > 0
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert got.finish_reason == want.finish_reason and got.version == 0
    assert got.versions == (0,) * len(got.token_ids) and got.prompt_tokens == len(prompt)


@pytest.mark.slow
@pytest.mark.integration
def test_sessions_stick_and_new_ones_go_to_the_least_loaded(two_servers, params, tmp_path):
    http = engine_for(two_servers.urls, tmp_path)
    a, b = http.servers

    async def turns(sessions: list[str]) -> None:
        await asyncio.gather(*(http.generate([5, 6, 7], params, i, session_id=s)
                               for i, s in enumerate(sessions)))

    try:
        # 8 new sessions at once: each placement sees the in-flight counts, so they alternate
        asyncio.run(turns([f"s{i}" for i in range(8)]))
        assert (a.completed, b.completed) == (4, 4)
        placed = {s: srv.url for s, srv in http._sessions.items()}
        assert placed == {f"s{i}": (a.url if i % 2 == 0 else b.url) for i in range(8)}
        # their next turns stick to a, although b is idle: a answers all 4
        asyncio.run(turns(["s0", "s2", "s4", "s6"]))
        assert (a.completed, b.completed) == (8, 4)
        # with a idle and b busy, a new session goes to a; with both idle, to the first listed
        b.inflight = 3  # as if three requests were running there
        asyncio.run(turns(["new1"]))
        b.inflight = 0
        a.inflight = 2
        asyncio.run(turns(["new2"]))
        a.inflight = 0
        assert (http._sessions["new1"], http._sessions["new2"]) == (a, b)
        assert http.stats()["retries"] == 0 and http.stats()["requests"] == 14
    finally:
        http.close()


@pytest.mark.slow
@pytest.mark.integration
def test_a_server_killed_mid_collection_is_retried_on_the_other(
        own_servers, model, tokenizer, params, limits, tmp_path, caplog):
    env_cls = ENVS["calculator"]
    tasks = env_cls.make_tasks("train", 8, 0, 2)
    http = engine_for(own_servers, tmp_path)
    a, b = http.servers
    killed_with: list[int] = []

    async def killer() -> None:
        # once server 0 has answered some requests, freeze it until requests hang there, and
        # kill it: those requests are in flight when it dies
        await wait_until(lambda: a.completed >= 1, "server 0 answering a request")
        own_servers.freeze(0)
        await wait_until(lambda: a.inflight >= 2, "requests hanging on the frozen server 0")
        killed_with.append(a.inflight)
        own_servers.kill(0)

    async def main():
        kill = asyncio.create_task(killer())
        trajs = await collect(tasks, 4, EngineActor(http, params), episode_fn=run_episode,
                              make_env=lambda *key: env_cls(), tokenizer=tokenizer,
                              limits=limits, seed=0, tag=("rl", 0))
        await asyncio.wait_for(kill, 1)
        return trajs

    try:
        with caplog.at_level(logging.WARNING, "tiller.engine.http"):
            trajs = asyncio.run(main())
        stats = http.stats()
        # the next weight push finds server 0 still dead: skipped, counted, server 1 updated
        assert http.update_weights(WeightUpdate.full(model, 1)) == 1
        assert http.stats()["push_skipped_down"] == 1 and server_version(b.url) == 1
    finally:
        http.close()
    assert len(trajs) == 32 and all(t.status.value != "aborted" for t in trajs)
    # the requests in flight on server 0 when it died were retried once, on server 1, and
    # their episodes' sessions moved there with them. (Not all `killed_with` of them: an answer
    # the server wrote before it was frozen still arrives, and that request completes on a.)
    assert killed_with[0] >= 2 and stats["retries"] >= 2
    assert stats["servers_marked_down"] == 1
    assert stats["session_moves"] >= stats["retries"]
    assert stats["servers_up"] == 1 and a.down and a.last_error
    # every request was answered exactly once: by a before the kill or by b
    assert a.completed + b.completed == stats["requests"] == sum(t.num_turns for t in trajs)
    assert stats["failed_requests"] == 0
    retried = [r for r in caplog.records if "retry 1 of 2 on another server" in r.message]
    assert len(retried) == stats["retries"] and a.url in retried[0].message


@pytest.mark.integration
def test_every_server_down_is_one_line_naming_each(params, model, tmp_path):
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    http = engine_for(urls, tmp_path, max_retries=2)
    try:
        with pytest.raises(RunError) as e:
            asyncio.run(http.generate([1, 2], params, 0))
        stats = http.stats()
        with pytest.raises(RunError, match="every tiller serve server is down"):
            http.update_weights(WeightUpdate.full(model, 1))
        assert not (http.weights_dir / "v1").exists()  # no server took it: not left on disk
    finally:
        http.close()
    msg = str(e.value)
    assert msg.startswith("every tiller serve server is down (") and "\n" not in msg
    assert msg.endswith("restart them (tiller serve) or fix engine.urls")
    assert all(f"{u}: ConnectError" in msg for u in urls)
    assert (stats["retries"], stats["failed_requests"], stats["servers_up"]) == (1, 1, 0)


# ---------------------------------------------------------------- weights
def perturbed(model, version: int) -> WeightUpdate:
    torch.manual_seed(version)
    update = WeightUpdate.full(model, version)
    for t in update.tensors.values():
        t.add_(0.05 * torch.randn_like(t))
    return update


@pytest.mark.slow
@pytest.mark.integration
def test_weight_push_reaches_every_server_with_its_version(two_servers, model, tokenizer,
                                                           params, tmp_path):
    http = engine_for(two_servers, tmp_path)
    prompt = tokenizer.encode("7 * 8 =")
    try:
        assert http.update_weights(perturbed(model, 1)) == 1
        update = perturbed(model, 2)
        assert http.update_weights(update) == 2
        assert [server_version(u) for u in two_servers.urls] == [2, 2] and http.version == 2
        # only the latest version stays on disk
        assert sorted(p.name for p in http.weights_dir.iterdir()) == ["v2"]
        # each server samples exactly those weights: same tokens as a local engine holding them
        update.apply_to(model)
        want = asyncio.run(EmbeddedEngine(model, tokenizer.pad_token_id).generate(
            prompt, params, 3))
        for i in range(2):
            got = asyncio.run(http.generate(prompt, params, 3, session_id=f"on{i}"))
            assert got.token_ids == want.token_ids and got.version == 2
        assert http.stats()["weight_pushes"] == 2
    finally:
        http.close()


@pytest.mark.slow
@pytest.mark.integration
def test_a_restarted_server_is_dropped_until_the_next_push_rejoins_it(two_servers, model,
                                                                      tokenizer, params,
                                                                      tmp_path):
    """A server restarted after a push holds its checkpoint's weights; here it even reports the
    pushed version (0), so only its new boot id gives it away. Its answer is dropped and the
    request retried on the other server; the next push finds it healthy and it rejoins."""
    http = engine_for(two_servers, tmp_path)
    prompt = tokenizer.encode("7 * 8 =")
    try:
        http.update_weights(perturbed(model, 0))  # not the checkpoint's weights, version 0
        first = asyncio.run(http.generate(prompt, params, 3, session_id="s"))
        assert [s.completed for s in http.servers] == [1, 0]
        two_servers.restart(0)
        assert server_version(two_servers.urls[0]) == 0
        again = asyncio.run(http.generate(prompt, params, 3, session_id="s"))
        assert again.token_ids == first.token_ids  # sampled by server 1, from the pushed weights
        assert [s.completed for s in http.servers] == [1, 1]
        assert "restarted: answered with boot id" in http.servers[0].last_error
        stats = http.stats()
        assert {k: stats[k] for k in ("stale_answers", "retries", "servers_marked_down",
                                      "session_moves", "servers_up", "failed_requests")} == {
            "stale_answers": 1, "retries": 1, "servers_marked_down": 1, "session_moves": 1,
            "servers_up": 1, "failed_requests": 0}
        http.update_weights(perturbed(model, 1))  # /health answers: it takes v1 and rejoins
        assert http.stats()["servers_rejoined"] == 1 and http.stats()["servers_up"] == 2
        assert [server_version(u) for u in two_servers.urls] == [1, 1]
        for i in range(2):
            got = asyncio.run(http.generate(prompt, params, 3, session_id=f"after{i}"))
            assert got.version == 1
        assert [s.completed for s in http.servers] == [3, 1]  # ties go to the first listed
    finally:
        http.close()


@pytest.mark.slow
@pytest.mark.integration
def test_a_server_echoing_another_version_is_a_loud_error(two_servers, model, tmp_path):
    """One real server and one that claims to have loaded another version."""
    liar = {"/update_weights_from_disk": {"success": True, "weight_version": 5}}
    with recorders(1, liar) as srvs:
        urls = [two_servers.urls[0], url(srvs[0])]
        http = HttpEngine(urls, weights_dir=two_servers.root / tmp_path.name,
                          request_timeout_s=60.0)
        try:
            with pytest.raises(RunError) as e:
                http.update_weights(WeightUpdate.full(model, 4))
        finally:
            http.close()
    msg = str(e.value)
    assert msg.startswith(f"weight push v4: server {urls[1]} answered ") and "\n" not in msg
    assert "'weight_version': 5" in msg and "expected success and weight_version 4" in msg
    assert server_version(urls[0]) == 4  # the honest one took it


@pytest.mark.slow
@pytest.mark.integration
def test_start_up_checks_the_model_and_pushes_the_initial_weights(two_servers, model,
                                                                  tmp_path):
    pushed = engine_for(two_servers, tmp_path)
    try:  # servers holding other weights: the start-up push must bring them back to version 0
        pushed.update_weights(perturbed(model, 7))
    finally:
        pushed.close()
    weights = two_servers.root / tmp_path.name / "w"
    common = dict(weights_dir=weights, api_key=None, request_timeout_s=60.0,
                  max_retries=2, initial=WeightUpdate.full(model, 0))
    with pytest.raises(ConfigError, match=r"serves a model with vocab_size=600, the trainer's "
                                          r"has 601: serve the run's model"):
        connect(two_servers.urls, vocab_size=601, max_context=model.config.max_position_embeddings,
                **common)
    with pytest.raises(ConfigError, match=rf"model.dtype: bfloat16, but server "
                                          rf"{two_servers.urls[0]} serves dtype float32"):
        connect(two_servers.urls, vocab_size=600, max_context=model.config.max_position_embeddings,
                dtype="bfloat16", **common)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=rf"server {dead} is not reachable \(ConnectError"):
        connect([two_servers.urls[0], dead], vocab_size=600,
                max_context=model.config.max_position_embeddings, **common)
    http = connect(two_servers.urls, vocab_size=600,
                   max_context=model.config.max_position_embeddings, **common)
    http.close()
    assert [server_version(u) for u in two_servers.urls] == [0, 0]
    assert (weights / "v0" / "model.safetensors").is_file()


# ---------------------------------------------------------------- control calls and contract
class Recorder(BaseHTTPRequestHandler):
    """A server that records every request and answers as `self.server.answers` says; its
    /generate waits for /abort_request (to test abort) or answers a canned body."""

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        srv = self.server
        srv.calls.append((self.path, body, self.headers.get("Authorization")))
        srv.post_types.append(self.headers.get("Content-Type"))  # tiller serve needs JSON
        if self.path == "/generate" and srv.hold:
            srv.generating.set()
            srv.aborted.wait(10)
        self._answer(srv.answers.get(self.path, {}))
        if self.path == "/abort_request":
            srv.aborted.set()

    def do_GET(self) -> None:  # noqa: N802
        self.server.calls.append((self.path, None, self.headers.get("Authorization")))
        self._answer(self.server.answers.get(self.path, {"status": "ok"}))

    def _answer(self, answer) -> None:
        """`answer`: a JSON body with 200, or (status, body); a list: its answers in turn (the
        last one repeats); "drop": the connection closed unanswered; a float: that many
        seconds' wait, then 200."""
        if isinstance(answer, list):
            answer = answer.pop(0) if len(answer) > 1 else answer[0]
        if answer == "drop":
            self.close_connection = True
            return
        if isinstance(answer, float):
            time.sleep(answer)
            answer = {"status": "ok"}
        status, answer = answer if isinstance(answer, tuple) else (200, answer)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextmanager
def recorders(n: int, answers: dict, hold: bool = False) -> Iterator[list[ThreadingHTTPServer]]:
    made = []
    try:
        for _ in range(n):
            srv = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
            srv.calls, srv.answers, srv.hold, srv.post_types = [], answers, hold, []
            srv.generating, srv.aborted = threading.Event(), threading.Event()
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            made.append(srv)
        yield made
    finally:
        for srv in made:
            srv.aborted.set()
            srv.shutdown()
            srv.server_close()


def url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.integration
def test_control_calls_fan_out_to_every_server_with_the_key(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # skipped (marked down, counted), not a failure
    with recorders(2, {"/flush_cache": {"entries_dropped": 3}}) as srvs:
        http = engine_for([url(s) for s in srvs] + [dead], tmp_path, api_key="k3y")
        try:
            http.pause()
            http.resume()
            assert http.flush_cache() == 6
            stats = http.stats()
        finally:
            http.close()
    assert (stats["control_skipped_down"], stats["servers_marked_down"], stats["servers_up"]) == (
        1, 1, 2)
    for srv in srvs:
        assert [(p, a) for p, _, a in srv.calls] == [
            ("/pause_generation", "Bearer k3y"), ("/continue_generation", "Bearer k3y"),
            ("/flush_cache", "Bearer k3y")]
        # what tiller serve requires of every POST (415 otherwise)
        assert srv.post_types == ["application/json"] * 3


@pytest.mark.integration
def test_a_failed_push_says_it_failed_not_that_the_weights_are_not_the_trainers(model, tmp_path):
    """SGLang's answer when a push loaded the weights but could not flush the cache (review
    s9-i21 F7): the error quotes it and says the push failed, not a false 'does not hold'."""
    said = ("Weights were updated, but the cache was not flushed because requests are still "
            "running or queued. Retract or finish them, then call /flush_cache.")
    answers = {"/update_weights_from_disk": {"success": False, "message": said,
                                             "num_paused_requests": 0}}
    with recorders(1, answers) as srvs:
        http = engine_for([url(srvs[0])], tmp_path, dialect=SglangDialect())
        try:
            with pytest.raises(RunError) as e:
                http.update_weights(WeightUpdate.full(model, 2))
        finally:
            http.close()
    msg = str(e.value)
    assert msg.startswith(f"weight push v2: server {url(srvs[0])} answered {{'message': "
                          "'Weights were updated, but the cache was not flush")
    assert msg.endswith("(expected success and weight_version 2): the push failed (the "
                        "server's answer says how; its weights may have changed)")
    assert "does not hold" not in msg and "\n" not in msg


@pytest.mark.integration
def test_abort_goes_to_the_server_running_the_request(params, tmp_path):
    partial = {"output_ids": [4, 9], "meta_info": {
        "finish_reason": {"type": "abort"}, "output_token_logprobs": [[-0.5, 4, None],
                                                                      [-1.5, 9, None]],
        "weight_version": 0}}
    with recorders(2, {"/generate": partial}, hold=True) as srvs:
        http = engine_for([url(s) for s in srvs], tmp_path)

        async def main():
            task = asyncio.create_task(http.generate([1, 2], params, 0, request_id="r1"))
            await asyncio.to_thread(srvs[0].generating.wait, 10)
            assert await asyncio.to_thread(http.abort, "r1")
            return await asyncio.wait_for(task, 10)

        try:
            gen = asyncio.run(main())
            assert not http.abort("r1")  # finished: nothing to abort
        finally:
            http.close()
    assert gen.finish_reason == "abort" and gen.token_ids == [4, 9] and gen.logprobs == [-0.5,
                                                                                         -1.5]
    assert ("/abort_request", {"rid": "r1"}) in [(p, b) for p, b, _ in srvs[0].calls]
    assert srvs[1].calls == []
    sent = srvs[0].calls[0][1]
    assert sent["rid"] == "r1" and sent["return_logprob"] is True and sent["input_ids"] == [1, 2]
    assert sent["sampling_params"]["seed"] == 0


@pytest.mark.integration
def test_tokens_the_server_did_not_sample_are_a_loud_error(params, tmp_path):
    lying = {"output_ids": [4, 9, 2], "meta_info": {
        "finish_reason": {"type": "stop"}, "weight_version": 0,
        "output_token_logprobs": [[-0.5, 4, None], [-1.5, 8, None], [-0.1, 2, None]]}}
    with recorders(1, {"/generate": lying}) as srvs:
        http = engine_for([url(srvs[0])], tmp_path)
        try:
            with pytest.raises(RunError, match=r"output_token_logprobs' token ids differ from "
                                               r"output_ids at position 1 \(3 vs 3 tokens\)"):
                asyncio.run(http.generate([1], params, 0))
            assert (http.stats()["failed_requests"], http.stats()["retries"]) == (1, 0)
        finally:
            http.close()


@pytest.mark.integration
def test_truncated_logprobs_must_be_of_the_kind_the_trainer_recomputes(params, tmp_path):
    answer = {"output_ids": [4, 2], "meta_info": {
        "finish_reason": {"type": "stop"}, "weight_version": 0,
        "output_token_logprobs": [[-0.5, 4, None], [-0.1, 2, None]]}}
    top_p = dataclasses.replace(params, top_p=0.5)
    with recorders(1, {"/generate": answer}) as srvs:  # a server that does not say which
        http = engine_for([url(srvs[0])], tmp_path)
        try:
            with pytest.raises(RunError, match=r"reports untruncated logprobs \(meta_info."
                               r"logprob_kind\) under top_k 0 / top_p 0.5, but sampling."
                               r"logprobs is sampled: set sampling.logprobs: untruncated"):
                asyncio.run(http.generate([1], top_p, 0))
            assert http.stats()["failed_requests"] == 1
            untruncated = dataclasses.replace(top_p, logprobs="untruncated")
            assert asyncio.run(http.generate([1], untruncated, 0)).logprobs == [-0.5, -0.1]
            assert asyncio.run(http.generate([1], params, 0)).token_ids == [4, 2]  # no top-p
        finally:
            http.close()
    answer["meta_info"]["logprob_kind"] = "sampled"  # as tiller serve says
    with recorders(1, {"/generate": answer}) as srvs:
        http = engine_for([url(srvs[0])], tmp_path)
        try:
            assert asyncio.run(http.generate([1], top_p, 0)).token_ids == [4, 2]
        finally:
            http.close()


@pytest.mark.integration
def test_abort_of_nothing_is_false_and_seeds_are_masked_to_63_bits(params, tmp_path):
    partial = {"output_ids": [], "meta_info": {
        "finish_reason": {"type": "abort"}, "output_token_logprobs": [], "weight_version": 0}}
    answers = {"/generate": partial, "/abort_request": {"success": True, "aborted": 0}}
    with recorders(1, answers, hold=True) as srvs:
        http = engine_for([url(srvs[0])], tmp_path)

        async def main():
            task = asyncio.create_task(http.generate([1, 2], params, 2**64 + 7, request_id="r"))
            await asyncio.to_thread(srvs[0].generating.wait, 10)
            aborted = await asyncio.to_thread(http.abort, "r")
            return aborted, await asyncio.wait_for(task, 10)

        try:
            aborted, gen = asyncio.run(main())
        finally:
            http.close()
    assert aborted is False and gen.finish_reason == "abort"  # the server ended nothing
    assert srvs[0].calls[0][1]["sampling_params"]["seed"] == 7  # as the embedded engine


GENERATED = {"output_ids": [4], "meta_info": {
    "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 4, None]],
    "weight_version": 0}}


@pytest.mark.slow
@pytest.mark.integration
def test_a_500_of_a_healthy_server_fails_only_that_request(params, tmp_path):
    """tiller serve's 500 "the engine failed" is about the request: no retry, no server down;
    a 503 (or a 500 whose server no longer answers /health) is a dead server: retried."""
    broken = {"/generate": (500, {"error": {"message": "the engine failed: ValueError: x"}})}
    with recorders(2, broken) as srvs:
        http = engine_for([url(s) for s in srvs], tmp_path)
        try:
            with pytest.raises(RunError, match=rf"server {url(srvs[0])}: /generate answered "
                                               r"HTTP 500: .*the engine failed: ValueError: x"):
                asyncio.run(http.generate([1, 2], params, 0))
            stats = http.stats()
        finally:
            http.close()
    assert [p for p, _, _ in srvs[0].calls] == ["/generate", "/health"] and srvs[1].calls == []
    assert (stats["failed_requests"], stats["retries"], stats["servers_up"]) == (1, 0, 2)

    for dead in ({"/generate": (503, {})},
                 {"/generate": (500, {}), "/health": (500, {})}):
        with recorders(1, dead) as bad, recorders(1, {"/generate": GENERATED}) as good:
            http = engine_for([url(bad[0]), url(good[0])], tmp_path)
            try:
                gen = asyncio.run(http.generate([1, 2], params, 0))
                stats = http.stats()
            finally:
                http.close()
        assert gen.token_ids == [4]
        assert (stats["retries"], stats["servers_marked_down"], stats["failed_requests"]) == (
            1, 1, 0)


@pytest.mark.integration
def test_a_refusal_names_the_servers_own_message_past_a_long_path(tmp_path):
    """CI's run at d5bf579: a 400 whose message named a long temp path was cut inside its JSON
    wrapping, before the reason. The one-line error shows the body's message (OpenAI-style
    `error.message`, `message`, FastAPI's `detail`) with room for the reason after a path."""
    path = "/tmp/pytest-of-root/pytest-2/" + "a_long_test_folder_name_" * 6 + "0/weights/v2"
    reason = "delta update v2 is against base version v1, but this server holds v0"
    for body in ({"error": {"message": f"cannot load {path!r}: WeightSyncError: {reason}"}},
                 {"detail": f"cannot load {path!r}: {reason}"},
                 {"message": f"cannot load {path!r}: {reason}"}):
        with recorders(1, {"/update_weights_from_disk": (400, body)}) as srvs:
            http = engine_for([url(srvs[0])], tmp_path)
            try:
                with pytest.raises(RunError) as e:
                    asyncio.run(http._post(http.servers[0], "/update_weights_from_disk", {}))
            finally:
                http.close()
        assert str(e.value).startswith(
            f"server {url(srvs[0])}: /update_weights_from_disk answered HTTP 400: cannot load ")
        assert str(e.value).endswith(reason) and '{"' not in str(e.value)


def test_an_error_body_of_any_shape_is_one_printable_line():
    """Review s10 F3: a body nested past the JSON parser's depth, an empty message and a
    terminal escape in a server's text each still give one printable line."""
    assert error_text("[" * 100_000) == "[" * 600 + "..."
    assert error_text('{"message": " "}') == '{"message": " "}'
    assert error_text("bad \x1b[31mred\x07 \u00e9") == "bad \\x1b[31mred\\x07 \u00e9"
    assert short("a\n\tb\x00") == "a b\\x00"


@pytest.mark.integration
def test_the_health_check_after_a_500_is_retried_once_counted_and_within_the_budget(
        tmp_path, caplog):
    """After a 500, /health decides whether the server is down; a first /health on a broken
    connection is tried once more (counted in health_retries, a warning), and both checks fit
    in what is left of the request's own timeout (not HEALTH_TIMEOUT_S each)."""
    broken = {"/collective_rpc": (500, {"error": "x"}), "/health": ["drop", {"status": "ok"}]}
    with recorders(1, broken) as srvs:
        http = engine_for([url(srvs[0])], tmp_path)
        try:
            with caplog.at_level(logging.WARNING, logger="tiller.engine.http"), \
                    pytest.raises(RunError, match=r"/collective_rpc answered HTTP 500"):
                asyncio.run(http._post(http.servers[0], "/collective_rpc", {}, timeout=5.0))
            stats = http.stats()
        finally:
            http.close()
    assert [p for p, _, _ in srvs[0].calls] == ["/collective_rpc", "/health", "/health"]
    assert stats["health_retries"] == 1 and stats["servers_up"] == 1
    assert [r.getMessage() for r in caplog.records if "once more" in r.getMessage()] == [
        f"server {url(srvs[0])}: /collective_rpc answered HTTP 500 and /health then failed "
        f"(RemoteProtocolError: Server disconnected without sending a response.); trying "
        f"/health once more"]

    hanging = {"/collective_rpc": (500, {"error": "x"}), "/health": 8.0}
    with recorders(1, hanging) as srvs:
        http = engine_for([url(srvs[0])], tmp_path)
        try:
            start = time.monotonic()
            with pytest.raises(ServerDown, match=r"^HTTP 500: .*; then /health: /health: no "
                               r"answer within 1\.\d+ s"):
                asyncio.run(http._post(http.servers[0], "/collective_rpc", {}, timeout=1.5))
            took = time.monotonic() - start
        finally:
            http.close()
    assert took < 2.5, took  # the request's 1.5 s, not 5 s more for /health


# ---------------------------------------------------------------- training runs
CONFIG = "configs/calculator.yaml"


def rl_config(sft_dir: Path, *more: str):
    return load_config(CONFIG, tiny_rl(sft_dir, "model.dtype=float32", "rl.steps=3",
                                       "rl.tasks_per_step=4", *more))


def http_config(sft_dir: Path, servers: Servers, name: str):
    return rl_config(sft_dir, "engine.backend=http", f"engine.urls={json.dumps(servers.urls)}",
                     f"engine.weights_dir={servers.root / name}")


def record_pushes(run: Run, servers: Servers) -> list[tuple[int, list[int]]]:
    """After each of the run's weight pushes, (the trainer's version, each server's)."""
    pushes: list[tuple[int, list[int]]] = []
    push = run.push_weights

    def push_and_check(in_flight: str = "continue") -> dict[str, float]:
        metrics = push(in_flight)
        pushes.append((run.trainer.version, [server_version(u) for u in servers.urls]))
        return metrics

    run.push_weights = push_and_check
    return pushes


@pytest.mark.slow
@pytest.mark.integration
def test_a_training_run_over_two_servers_learns_like_the_embedded_run(two_servers, calc_sft_dir,
                                                                      tmp_path):
    """Servers started from the untrained model get the run's (SFT) weights at start-up and
    every version after it; the run samples what the embedded engine samples."""
    run = Run(http_config(calc_sft_dir, two_servers, tmp_path.name), tmp_path / "http")
    pushes = record_pushes(run, two_servers)
    try:
        out = rl(run)
    finally:
        run.close()
    embedded = Run(rl_config(calc_sft_dir), tmp_path / "embedded")
    try:
        rl(embedded)
    finally:
        embedded.close()
    assert pushes and all(servers == [v, v] for v, servers in pushes)
    rows, ref = rl_rows(tmp_path / "http"), rl_rows(tmp_path / "embedded")
    assert len(rows) == 3 and out["ledger"]["started"] == out["ledger"]["trained"] == 3 * 4 * 4
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["aborted_rate"] == 0 for r in rows)
    assert [(r["engine/retries"], r["engine/session_moves"]) for r in rows] == [(0, 0)] * 3
    assert rows[-1]["engine/requests"] >= 48  # every episode took at least one turn
    assert [r["reward_mean"] for r in rows] == pytest.approx([r["reward_mean"] for r in ref])


@pytest.mark.slow
@pytest.mark.integration
def test_an_async_run_over_two_servers_pushes_every_version_and_counts_every_episode(
        two_servers, calc_sft_dir, tmp_path):
    """rl.mode: async against `tiller serve` processes: the servers take each version while
    episodes run on them (aborted and resumed), every server echoes it, and the ledger
    accounts for every episode started."""
    cfg = rl_config(calc_sft_dir, "engine.backend=http",
                    f"engine.urls={json.dumps(two_servers.urls)}",
                    f"engine.weights_dir={two_servers.root / tmp_path.name}", "rl.mode=async",
                    "rl.max_staleness=1", "rollout.partial=abort_resume", "rl.steps=4",
                    "sampling.max_new_tokens=32")
    run = Run(cfg, tmp_path)
    pushes = record_pushes(run, two_servers)
    try:
        out = rl(run)
    finally:
        run.close()
    assert [v for v, _ in pushes] == [1, 2, 3, 4]
    assert all(servers == [v, v] for v, servers in pushes)
    rows = rl_rows(tmp_path)
    assert len(rows) == 4 and all(r["staleness_max"] <= 1 for r in rows)
    ledger = out["ledger"]
    assert ledger["trained"] == 4 * 4 * 4 and ledger_unaccounted(Counter(ledger)) == 0
    assert out["staleness_max"] <= 1 and "dropped/aborted" not in ledger


@pytest.mark.slow
@pytest.mark.integration
def test_a_server_killed_mid_run_is_retried_and_every_episode_counted(own_servers,
                                                                      calc_sft_dir, tmp_path):
    run = Run(http_config(calc_sft_dir, own_servers, tmp_path.name), tmp_path)
    a = run.engine.servers[0]
    killed: list[int] = []

    def killer() -> None:  # in step 2: freeze server 0 until requests hang there, then kill it
        deadline = time.monotonic() + 300
        while run.engine.version < 1 and time.monotonic() < deadline:  # step 1 pushed
            time.sleep(0.01)
        done = a.completed  # and its parity check done: server 0 answers step 2's requests
        while a.completed == done and time.monotonic() < deadline:
            time.sleep(0.001)
        own_servers.freeze(0)
        while a.inflight < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        killed.append(a.inflight)
        own_servers.kill(0)

    watchdog = threading.Thread(target=killer, daemon=True)
    watchdog.start()
    try:
        out = rl(run)
    finally:
        run.close()
        own_servers.kill(0)
        watchdog.join(10)
    rows = rl_rows(tmp_path)
    assert killed and killed[0] >= 1 and len(rows) == 3
    last = rows[-1]
    assert last["engine/retries"] >= killed[0] and last["engine/servers_up"] == 1
    assert last["engine/failed_requests"] == 0 and last["engine/push_skipped_down"] >= 1
    # the ledger accounts for every episode: tasks x samples, none aborted
    ledger = out["ledger"]
    assert ledger["started"] == ledger["trained"] == 3 * 4 * 4 and "dropped/aborted" not in ledger
    assert all(r["aborted_rate"] == 0 for r in rows)
    assert server_version(own_servers.urls[1]) == run.trainer.version


@pytest.mark.slow
@pytest.mark.integration
def test_pause_abort_and_resume_on_real_servers(two_servers, params, tmp_path):
    """A request queued on a paused server is aborted there and comes back empty, "abort"."""
    http = engine_for(two_servers, tmp_path)

    async def main():
        http.pause()
        task = asyncio.create_task(http.generate([5, 6, 7], params, 0, request_id="r1"))
        deadline = time.monotonic() + 30
        # False until the request has reached its server (404 there, meanwhile)
        while not await asyncio.to_thread(http.abort, "r1"):
            assert time.monotonic() < deadline, "the request never reached a server"
            await asyncio.sleep(0.05)
        aborted = await asyncio.wait_for(task, 30)
        http.resume()
        after = await asyncio.wait_for(http.generate([5, 6, 7], params, 0), 30)
        return aborted, after

    try:
        aborted, after = asyncio.run(main())
        dropped = (http.flush_cache(), http.flush_cache())
    finally:
        http.close()
    assert dropped == (1, 0)  # the finished request's KV, kept for prefix sharing; then none
    assert aborted.finish_reason == "abort" and aborted.token_ids == []
    assert after.finish_reason in ("stop", "length") and len(after.token_ids) > 0


@pytest.mark.integration
def test_the_servers_context_bounds_a_turn(params, tmp_path):
    """As in the embedded engine: max_new_tokens is cut to what fits, and a prompt that fills
    the context comes back empty ("length") without a request."""
    answer = {"output_ids": [4], "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 4, None]],
        "weight_version": 0}}
    with recorders(1, {"/generate": answer}) as srvs:
        http = engine_for([url(srvs[0])], tmp_path)
        http.max_context = 10
        try:
            full = asyncio.run(http.generate(list(range(10)), params, 0))
            asyncio.run(http.generate(list(range(9)), params, 0))
        finally:
            http.close()
    assert (full.token_ids, full.finish_reason, full.prompt_tokens) == ([], "length", 10)
    assert [(p, b["sampling_params"]["max_new_tokens"]) for p, b, _ in srvs[0].calls] == [
        ("/generate", 1)]  # 12 asked, 1 fits



@pytest.mark.integration
def test_a_server_dying_at_the_sglang_read_back_is_marked_down_not_raised(model, tmp_path):
    """SGLang's push answer carries no version, so it is read back from /model_info; a server
    that dies there is a dead server at the push (marked down, counted, skipped), not a bare
    ServerDown escaping the push."""
    pushed = {"/update_weights_from_disk": {"success": True, "message": "ok"}}
    with recorders(1, {**pushed, "/model_info": {"weight_version": "1"}}) as good, \
            recorders(1, {**pushed, "/model_info": (503, {"error": "shutting down"})}) as dying:
        http = engine_for([url(good[0]), url(dying[0])], tmp_path, dialect=SglangDialect())
        try:
            assert http.update_weights(WeightUpdate.full(model, 1)) == 1
            stats = http.stats()
            down = http.servers[1]
        finally:
            http.close()
    assert (stats["push_skipped_down"], stats["servers_marked_down"], stats["servers_up"]) == (
        1, 1, 1)
    assert down.down and "HTTP 503" in down.last_error and down.version == 0


class Started:
    """What marks servers as tiller's own (`HttpEngine(managed=...)`): none has exited, and
    closing is these recorders' context's job."""

    def exited(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


def pushed(version: int, boot: str = "b") -> dict:
    return {"/update_weights_from_disk": {"success": True, "weight_version": version,
                                          "boot_id": boot},
            "/get_model_info": {"weight_version": version, "boot_id": boot}}


@pytest.mark.integration
@pytest.mark.parametrize(("managed", "answers", "rejoins"), [
    (None, {**pushed(2), "/health": (404, {"detail": "Not Found"})}, False),
    (Started(), {**pushed(2), "/health": (404, {"detail": "Not Found"})}, False),
    (Started(), pushed(2, boot="OTHER"), False),  # tiller's server is gone, another took its port
    (Started(), pushed(2), True),  # the same server, answering again
    (None, pushed(2, boot="OTHER"), True),  # at engine.urls: its operator restarted it
], ids=["404-attached", "404-managed", "other-boot-managed", "same-boot-managed",
        "other-boot-attached"])
def test_a_down_server_whose_port_answers_otherwise_stays_down(model, tmp_path, managed,
                                                               answers, rejoins):
    """A down server's URL, answered at the next full push by what may be another process: a
    4xx /health, or for a server tiller started another boot id, keeps it down (the push goes
    on to the others, skipped counted and logged); its own boot id (or, for a server at
    engine.urls, any healthy answer) lets it rejoin."""
    model_v1 = WeightUpdate.full(model, 1)
    with recorders(2, pushed(1)) as srvs, recorders(1, answers) as other:
        http = engine_for([url(srvs[0]), url(srvs[1])], tmp_path, managed=managed)
        try:
            assert http.update_weights(model_v1) == 1
            http.servers[0].url = url(other[0])  # server 0 died; its port now answers `answers`
            http._mark_down(http.servers[0], "died")
            srvs[1].answers.update(pushed(2))
            assert http.update_weights(WeightUpdate(2, model_v1.tensors)) == 2
            stats, first = http.stats(), http.servers[0]
        finally:
            http.close()
    assert (stats["servers_rejoined"], stats["push_skipped_down"]) == (
        (1, 0) if rejoins else (0, 1))
    assert first.down is not rejoins and first.version == (2 if rejoins else 1)
    if not rejoins:
        assert ("HTTP 404" in first.last_error if "/health" in answers else
                first.last_error == "/get_model_info answered boot id 'OTHER', not 'b': another "
                "process has its port (tiller does not restart the servers it started)")


@pytest.mark.integration
def test_an_answer_past_the_cap_is_one_line_not_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(transport, "MAX_ANSWER_BYTES", 1000)
    with recorders(1, {"/flush_cache": {"entries_dropped": 1, "pad": "x" * 5000}}) as srvs:
        http = engine_for([url(srvs[0])], tmp_path)
        try:
            with pytest.raises(RunError, match=rf"^server {url(srvs[0])}: /flush_cache answered "
                               r"more than 1000 bytes \(the largest answer tiller reads"):
                http.flush_cache()
            assert not http.servers[0].down  # a broken answer, not a dead server
        finally:
            http.close()
