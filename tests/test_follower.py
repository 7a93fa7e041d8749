"""A follower engine (`engine/follower.py`) takes the pusher's view of the servers, and the
counters of a pusher and its followers merge without counting a server once per follower."""

from __future__ import annotations

import pytest

from tiller.engine.follower import adopt, router_state
from tiller.engine.http import HttpEngine
from tiller.errors import RunError
from tiller.rollout.ray_http import merged_stats

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
