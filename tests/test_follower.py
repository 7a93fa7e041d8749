"""A follower engine (`engine/follower.py`) takes the pusher's view of the servers, and the
counters of a pusher and its followers merge without counting a server once per follower."""

from __future__ import annotations

import asyncio
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch
from helpers import TINY_RUN
from test_http_engine import Recorder, recorders, url

from tiller.config import load_config
from tiller.engine.api import SamplingParams
from tiller.engine.follower import Followed, adopt, follow_servers, router_state
from tiller.engine.http import HttpEngine
from tiller.engine.updates import WeightUpdate
from tiller.errors import RunError
from tiller.rollout.ray_http import merged_stats
from tiller.train.ranks import free_port

URLS = ["http://127.0.0.1:9", "http://127.0.0.1:10"]


@pytest.fixture
def engines(tmp_path):
    pusher = HttpEngine(URLS, weights_dir=tmp_path / "p")
    follower = HttpEngine(URLS, weights_dir=tmp_path / "f")
    yield pusher, follower
    pusher.close()
    follower.close()


def test_a_follower_takes_the_pending_then_the_pushed_versions(engines):
    pusher, follower = engines
    follower.servers[1].down = True  # the follower saw it die
    adopt(follower, router_state(pusher, pending=3))
    assert [s.pending for s in follower.servers] == [3, 3]
    assert follower.version == 0  # pending only: nothing else taken
    for s, boot in zip(pusher.servers, ("a", "b"), strict=True):
        s.version, s.previous, s.boot_id = 3, 2, boot
    pusher.version = 3
    adopt(follower, router_state(pusher))
    assert [(s.version, s.previous, s.boot_id, s.pending, s.down) for s in follower.servers] == [
        (3, 2, "a", None, False), (3, 2, "b", None, False)]
    assert follower.version == 3
    assert follower.counters["servers_rejoined"] == 1  # the push found it up


def test_a_follower_of_other_servers_is_refused(engines, tmp_path):
    pusher, _ = engines
    other = HttpEngine(URLS[:1], weights_dir=tmp_path / "o")
    try:
        with pytest.raises(RunError, match="are not this follower's"):
            adopt(other, router_state(pusher))
    finally:
        other.close()


def test_server_counts_are_the_most_any_engine_counts_and_request_counts_summed():
    own = {"requests": 10, "retries": 1, "servers_marked_down": 1, "servers_rejoined": 0,
           "push_skipped_down": 2, "servers_up": 1}
    per = [{"requests": 5, "retries": 2, "servers_marked_down": 1, "servers_rejoined": 1,
            "push_skipped_down": 0, "servers_up": 2}] * 2
    assert merged_stats(own, per) == {"requests": 20, "retries": 5, "servers_marked_down": 1,
                                      "servers_rejoined": 1, "push_skipped_down": 2,
                                      "servers_up": 1}


def answers_for(version: int) -> dict:
    """What a recorder server answers once it holds `version` (a push, a generation)."""
    return {"/update_weights_from_disk": {"success": True, "weight_version": version,
                                          "boot_id": "b"},
            "/generate": {"output_ids": [4], "meta_info": {
                "finish_reason": {"type": "length"}, "weight_version": version, "boot_id": "b",
                "output_token_logprobs": [[-0.5, 4, None]]}}}


@pytest.mark.integration
def test_a_server_the_follower_saw_die_is_not_adopted_back(tmp_path):
    """Two real HTTP servers; the pusher pushes v1 to both, then server 0 dies. The follower's
    request on it fails (marked down, retried on server 1); the pusher's state (from the push
    that reached server 0 before it died) says "up": the follower keeps it down. It comes back
    only when a later push finds a server there again (counted in `servers_rejoined`)."""
    weights = WeightUpdate.full(torch.nn.Linear(2, 2), 1)
    params = SamplingParams(temperature=1.0, max_new_tokens=1, stop_token_ids=(2,))
    answers = answers_for(1)
    with recorders(2, answers) as srvs:
        urls = [url(s) for s in srvs]
        pusher = HttpEngine(urls, weights_dir=tmp_path / "p")
        follower = HttpEngine(urls, weights_dir=tmp_path / "f")
        revived = None
        try:
            adopt(follower, router_state(pusher, pending=1))
            pusher.update_weights(weights)
            adopt(follower, router_state(pusher))
            srvs[0].shutdown()
            srvs[0].server_close()  # server 0 is gone: nothing listens at its port
            asyncio.run(follower.generate([1, 2], params, 0))  # on server 0 first: retried
            assert [s.down for s in follower.servers] == [True, False]
            adopt(follower, router_state(pusher))  # the pusher has not seen it die
            assert [s.down for s in follower.servers] == [True, False]
            answers.update(answers_for(2))
            adopt(follower, router_state(pusher, pending=2))
            pusher.update_weights(WeightUpdate(2, weights.tensors))  # finds it dead: skipped
            adopt(follower, router_state(pusher))
            assert [s.down for s in follower.servers] == [True, False]
            assert follower.counters["servers_rejoined"] == 0
            port = srvs[0].server_address[1]
            revived = ThreadingHTTPServer(("127.0.0.1", port), Recorder)
            revived.calls, revived.answers, revived.post_types = [], answers, []
            revived.hold = False
            threading.Thread(target=revived.serve_forever, daemon=True).start()
            answers.update(answers_for(3))
            adopt(follower, router_state(pusher, pending=3))
            pusher.update_weights(WeightUpdate(3, weights.tensors))  # finds it up: rejoins
            adopt(follower, router_state(pusher))
            assert [s.down for s in follower.servers] == [False, False]
            stats = follower.stats()
        finally:
            pusher.close()
            follower.close()
            if revived is not None:
                revived.shutdown()
                revived.server_close()
    assert (stats["servers_marked_down"], stats["servers_rejoined"], stats["retries"],
            stats["servers_up"]) == (1, 1, 1, 2)
    assert pusher.counters["push_skipped_down"] == 1



@pytest.mark.parametrize(("overrides", "hint"), [
    (["engine.servers=1"], "tiller started them and does not restart them: each server's log "
     "is in the run folder's servers/"),
    (["engine.urls=[http://127.0.0.1:9]"], "restart them (tiller serve) or fix engine.urls"),
])
def test_a_followers_servers_all_down_say_who_started_them(overrides, hint):
    """Under ray the episodes' requests go through the workers' followers, which hold no
    `managed`: for the servers the run started, the line no longer says "fix engine.urls"."""
    cfg = load_config("configs/calculator.yaml", [*TINY_RUN, "cluster.backend=ray",
                                                  "engine.backend=http", *overrides])
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    engine = follow_servers(cfg, Followed(urls=[dead], max_context=64))
    params = SamplingParams(temperature=1.0, max_new_tokens=1, stop_token_ids=(2,))
    try:
        with pytest.raises(RunError) as e:
            asyncio.run(engine.generate([1, 2], params, 0))
    finally:
        engine.close()
    assert str(e.value).startswith(f"every tiller serve server is down ({dead}: ConnectError")
    assert str(e.value).endswith(f"): {hint}")
