"""Attacks on tiller's HTTP servers (`tiller serve`, the agent gateway, `tiller view`), kept in
the suite (issue 19): cross-site POSTs and DNS rebinding, a chat request that stalls the event
loop, slowloris connections, one API client probing another's prompt through the prefix
cache, short API keys. Real servers on 127.0.0.1 (subprocesses or uvicorn in a thread), real
sockets, the tiny model."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from helpers import cli, free_port, serve_process

from tiller.engine.api import SamplingParams
from tiller.engine.delta import DeltaUpdate, TensorDelta, encode_gaps
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.kv_cache import PrefixCache
from tiller.engine.updates import WeightUpdate
from tiller.errors import ConfigError
from tiller.gateway.server import Gateway
from tiller.models import load_model
from tiller.observe.traces import TraceWriter
from tiller.observe.viewer.app import create_app as create_viewer
from tiller.observe.viewer.app import viewer_server
from tiller.rollout.agent_loop import EngineActor, EpisodeLimits
from tiller.rollout.chat import stop_token_ids
from tiller.rollout.trajectory import TrajectoryBuilder
from tiller.serve import listen, native
from tiller.serve.app import create_app
from tiller.serve.guard import Hosts, host_name
from tiller.serve.listen import ConnectionLimits, GuardedH11
from tiller.serve.server import ServeSettings

GEN = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
KEY_A, KEY_B, KEY_C = "client-a-0123456789", "client-b-0123456789", "client-c-0123456789"


def raw_status(port: int, head: str) -> int:
    """The status a raw HTTP request (`head`, sent as it is) gets; the request must ask for
    `Connection: close` (HTTP/1.0 does by default)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


# ---- 3: cross-site POSTs and DNS rebinding ------------------------------------------------

def test_host_names():
    assert [host_name(h) for h in (b"a.example:80", b"[::1]:8", b"[::1]", b"127.0.0.1",
                                   b"a:b:c", b"[::1", b"[::1]x", b":80", b"\xff")] == [
        "a.example", "::1", "::1", "127.0.0.1", None, None, None, None, None]
    loop = Hosts("127.0.0.1")
    assert all(map(loop.allows, ["localhost", "LOCALHOST.", "127.0.0.1", "127.8.9.1", "::1"]))
    assert not any(map(loop.allows, ["evil.example", "localhost.evil.example", "10.0.0.1",
                                     "0.0.0.0", "127.0.0.1.nip.io"]))
    wide = Hosts("0.0.0.0", ("gpu-node-3",))  # a wildcard bind: any IP literal, listed names
    assert all(map(wide.allows, ["10.0.0.1", "2001:db8::1", "gpu-node-3", "localhost"]))
    assert not wide.allows("gpu-node-4")
    assert Hosts("10.1.2.3").allows("10.1.2.3") and not Hosts("10.1.2.3").allows("10.1.2.4")


@pytest.fixture(scope="module")
def served(calc_model_dir, tmp_path_factory):
    """`tiller serve` with a weights root holding a copy of the served weights ("same")."""
    root = tmp_path_factory.mktemp("weights_root")
    WeightUpdate.full(load_model(calc_model_dir), 0).save(root / "same")
    with serve_process(calc_model_dir, "--weights-root", str(root)) as live:
        yield live


@pytest.mark.slow
@pytest.mark.integration
def test_serve_refuses_cross_site_posts(served):
    """A web page may POST text/plain, form and multipart bodies (or none) to any server
    without a CORS preflight: none of them changes the weights or pauses generation."""
    with httpx.Client(base_url=served["url"], timeout=60) as http:
        before = http.get("/get_model_info").json()["weight_version"]
        update = json.dumps({"model_path": "same", "weight_version": before + 7})
        for ctype in ("text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", "text/plain; a=application/json",
                      None):
            headers = {"content-type": ctype} if ctype else {}
            r = http.post("/update_weights_from_disk", content=update, headers=headers)
            assert r.status_code == 415, r.text
            assert "needs 'Content-Type: application/json'" in r.json()["error"]["message"]
            assert http.post("/pause_generation", content=b"", headers=headers
                             ).status_code == 415
        assert http.get("/get_model_info").json()["weight_version"] == before
        r = http.post("/generate", json=GEN, timeout=60)  # not paused: it is answered
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
        r = http.post("/flush_cache", content=b"{}",  # case and parameters do not matter
                      headers={"content-type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("host, status", [
    ("evil.example:{port}", 421), ("localhost.evil.example", 421), ("10.0.0.1", 421),
    ("127.0.0.1.nip.io:{port}", 421), ("[::1", 421),
    ("127.0.0.1:{port}", 200), ("localhost:{port}", 200), ("LOCALHOST", 200),
    ("[::1]:{port}", 200), ("127.9.9.9", 200),
])
def test_serve_answers_only_its_own_host_names(served, host, status):
    """A DNS-rebinding page (its name now pointing at 127.0.0.1) can neither read
    /get_model_info nor send a JSON POST: both carry its name in Host."""
    port = served["port"]
    host = host.format(port=port)
    assert raw_status(port, f"GET /get_model_info HTTP/1.1\r\nHost: {host}\r\n"
                            "Connection: close\r\n\r\n") == status
    body = "{}"
    assert raw_status(port, f"POST /flush_cache HTTP/1.1\r\nHost: {host}\r\n"
                            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                            f"Connection: close\r\n\r\n{body}") == status


@pytest.mark.slow
@pytest.mark.integration
def test_serve_needs_exactly_one_host_header(served):
    port = served["port"]
    assert raw_status(port, "GET /get_model_info HTTP/1.0\r\n\r\n") == 400
    assert raw_status(port, "GET /get_model_info HTTP/1.0\r\nHost: 127.0.0.1\r\n"
                            "Host: evil.example\r\n\r\n") == 400


@contextmanager
def uvicorn_thread(server) -> Iterator[None]:
    """Run a uvicorn server in a thread of this process until the block ends."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        assert not thread.is_alive()


@pytest.mark.integration
def test_viewer_refuses_rebound_hosts_and_posts(tmp_path):
    """A rebound page cannot read the traces; tiller view shares serve's guard and limits."""
    TraceWriter(tmp_path / "traces.sqlite").close()
    port = free_port()
    server, _ = viewer_server(create_viewer(tmp_path), port)
    assert issubclass(server.config.http, GuardedH11)  # the read deadline and connection cap
    with uvicorn_thread(server):
        for path in ("/", "/api/run", "/api/episodes"):
            assert raw_status(port, f"GET {path} HTTP/1.1\r\nHost: evil.example:{port}\r\n"
                                    "Connection: close\r\n\r\n") == 421
            assert raw_status(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                    "Connection: close\r\n\r\n") == 200
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert http.post("/api/run", content=b"x").status_code == 415
            assert http.post("/api/run", json={}).status_code == 405  # no route takes a POST


@pytest.fixture()
def actor(model, tokenizer):
    engine = EmbeddedEngine(model, tokenizer.pad_token_id, max_batch_size=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=8,
                            stop_token_ids=stop_token_ids(tokenizer, model.generation_config))
    yield EngineActor(engine, params)
    engine.close()


@pytest.mark.integration
def test_gateway_refuses_cross_site_rebound_and_oversized_calls(actor, tokenizer):
    """The gateway: a text/plain POST 415, a rebound Host 421, a conversation that cannot fit
    the episode's token budget 400 before it is rendered (too many messages, or too many
    characters in tool-call arguments); each counted, none reaches the engine; an idle
    connection is closed after the read timeout and counted."""
    limits = ConnectionLimits(read_timeout_s=0.5, keep_alive_s=30, max_connections=64)
    gateway = Gateway(limits=limits).start()
    port = int(gateway.base_url.split(":")[2].split("/")[0])
    budget = EpisodeLimits(max_turns=4, max_episode_tokens=64)

    async def go() -> list[tuple[int, str]]:
        session = gateway.open(actor, tokenizer, TrajectoryBuilder("t"), seed=0,
                               limits=budget)
        auth = {"Authorization": f"Bearer {session.key}"}
        call = {"model": gateway.model, "messages": [{"role": "user", "content": "hi"}]}
        args = json.dumps({"expression": "1" * 3000})
        big = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "calculate", "arguments": args}}]}]
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
            answers = [
                await http.post("/chat/completions", content=json.dumps(call),
                                headers={**auth, "content-type": "text/plain"}),
                await http.post("/chat/completions", json=call,
                                headers={**auth, "host": f"evil.example:{port}"}),
                await http.post("/chat/completions", headers=auth, json={
                    **call, "messages": [{"role": "user"}] * 65}),
                await http.post("/chat/completions", headers=auth,
                                json={**call, "messages": big}),
            ]
        assert session.calls == 0 and session.history is None  # nothing reached the engine
        gateway.close_session(session)
        return [(r.status_code, r.json()["error"]["message"]) for r in answers]

    try:
        before = gateway.stats()
        answers = asyncio.run(go())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            t0 = time.monotonic()
            assert idle.recv(1) == b""  # closed by the gateway, not by this timeout
            assert time.monotonic() - t0 < 8
        stats = gateway.stats()
    finally:
        gateway.close()
    assert [s for s, _ in answers] == [415, 421, 400, 400]
    assert "65 messages, over the limit of 64" in answers[2][1]
    assert "env.max_episode_tokens" in answers[2][1] and "characters" in answers[3][1]
    grew = {k: stats[k] - before.get(k, 0.0) for k in stats if stats[k] != before.get(k)}
    assert grew == {"gateway/sessions": 1, "gateway/rejected/415": 1,
                    "gateway/rejected/421": 1, "gateway/rejected/400": 2,
                    "gateway/read_timeouts": 1}


# ---- 4: a chat request must not stall the server ------------------------------------------

@pytest.fixture(scope="module")
def long_context_dir(calc_model_dir, tmp_path_factory):
    """The tiny model with a 131072-token context (RoPE: only the config changes), so a
    request of megabytes passes the size bounds and is rendered."""
    out = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(calc_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 17
    (out / "config.json").write_text(json.dumps(config))
    return out


def health_while(url: str, body: bytes) -> tuple[httpx.Response, list[float]]:
    """POST `body` to /v1/chat/completions and, until it is answered, GET /health every
    50 ms (once at least); returns the chat answer and each /health latency in seconds."""
    answer: list[httpx.Response] = []

    def post() -> None:
        answer.append(httpx.post(f"{url}/v1/chat/completions", content=body, timeout=300,
                                 headers={"content-type": "application/json"}))

    thread = threading.Thread(target=post)
    # this (pytest) process holds models and fixtures: a full collection of its own heap
    # would stall the measuring client, not the server, for most of a second
    gc.collect()
    gc.disable()
    try:
        thread.start()
        latencies = []
        with httpx.Client(base_url=url, timeout=120) as http:
            http.get("/health")  # connected before the big request lands
            while True:
                t0 = time.perf_counter()
                assert http.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                if not thread.is_alive():
                    break
                time.sleep(0.05)
        thread.join()
    finally:
        gc.enable()
    return answer[0], latencies


@pytest.mark.slow
@pytest.mark.integration
def test_health_answers_while_a_huge_chat_request_is_in_flight(long_context_dir):
    """Issue 19's attack: megabytes of tool-call arguments, and a quarter of a million empty
    messages, held every route (/health included) for seconds while the chat template was
    rendered on the event loop. Now the size is bounded before rendering (arguments and
    message count included) and parsing and rendering run in a worker thread. The review's
    shapes that the message count missed (320,000 empty content parts in one message, 120,000
    tool calls) held it during validation (pydantic holds the GIL): the JSON values are now
    counted before validation."""
    args = json.dumps({"x": "a" * 1_000_000})  # under 32 chars x 131071 tokens: rendered
    calls = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]},
        {"role": "tool", "content": "1"}]
    many_calls = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "", "arguments": "{}"}}] * 120_000}]
    too_many = "JSON values, the limit of --max-json-values"
    cases = [(calls, "tokens, over the limit of 131071"),
             ([{"role": "user"}] * 250_000, "the conversation has 250000 messages, over the "
                                            "limit of 131071"),
             ([{"role": "user", "content": [{"type": "text", "text": ""}] * 320_000}],
              too_many),
             (many_calls, too_many)]
    with serve_process(long_context_dir, "--max-body-bytes", str(8 << 20)) as live:
        for messages, says in cases:
            body = json.dumps({"model": str(long_context_dir), "messages": messages,
                               "max_tokens": 1}, separators=(",", ":")).encode()
            assert len(body) < 8 << 20  # under --max-body-bytes
            answer, latencies = health_while(live["url"], body)
            assert answer.status_code == 400 and says in answer.json()["error"]["message"]
            assert max(latencies) < 0.5, (says, max(latencies), len(latencies))


# ---- 5: slowloris -------------------------------------------------------------------------

def half_open(port: int) -> socket.socket:
    """A connection that sends half a request head and then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Wait: ")
    return s


def closed_within(s: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing `s` (AssertionError if it stays open)."""
    s.settimeout(seconds)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except TimeoutError as e:
        raise AssertionError(f"still open after {seconds} s") from e
    except ConnectionResetError:
        pass
    return data


@pytest.mark.slow
@pytest.mark.integration
def test_slowloris_connections_are_timed_out_capped_and_logged_once(calc_model_dir):
    """Connections that never finish their headers are closed after --read-timeout-s; past
    --max-connections a connection is answered 503 at once; a normal client is served
    meanwhile and after; the refusals are counted in two log lines per kind at most."""
    with serve_process(calc_model_dir, "--read-timeout-s", "2", "--max-connections",
                       "20") as live:
        port, url = live["port"], live["url"]
        first = [half_open(port) for _ in range(19)]
        t0 = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # below the cap
        more = [half_open(port) for _ in range(15)]
        answers = [closed_within(s, 10) for s in first + more]
        waited = time.monotonic() - t0
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) >= 10 and all(a == b"" for a in answers if a not in refused)
        assert waited >= 1.8  # the head-less ones lived until the read timeout
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        for s in first + more:
            s.close()
    lines = [line for line in live["log"] if "tiller.serve.listen" in line]
    timeouts = [line for line in lines if "sent no whole request within 2 s" in line]
    refusals = [line for line in lines if "connection(s): 20 were open" in line]
    assert len(timeouts) <= 2 and len(refusals) <= 2 and len(lines) == len(timeouts) + len(
        refusals), lines
    total = {kind: int(re.search(r"\((\d+) in all", found[-1]).group(1))
             for kind, found in (("timeouts", timeouts), ("refusals", refusals))}
    # every half-open connection was refused or timed out, counted in the last line
    assert total["timeouts"] + total["refusals"] == 34 and total["refusals"] >= len(refused)


def kept_alive(port: int, head: str) -> tuple[socket.socket, bytes]:
    """A connection that sent one HTTP/1.1 request (keep-alive) and read its whole answer."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head.encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(4096)
    length = int(re.search(rb"content-length: (\d+)", data, re.I).group(1))
    while len(data) < data.index(b"\r\n\r\n") + 4 + length:
        data += s.recv(4096)
    return s, data


def still_open(s: socket.socket) -> bool:
    s.settimeout(0.2)
    try:
        return s.recv(1) != b""
    except TimeoutError:
        return True


@pytest.mark.slow
@pytest.mark.integration
def test_idle_keep_alive_connections_make_room_for_new_clients(calc_model_dir):
    """The review's lockout: --max-connections sockets, each kept alive after one GET /health
    (no key needed), locked every new client out with 503. Now a new connection closes the
    one idle longest; a request the guard refuses closes its connection; a flood of
    connections all mid-request is still refused at the cap; each closing is counted."""
    health = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with serve_process(calc_model_dir, "--read-timeout-s", "5", "--max-connections",
                       "8") as live:
        port, url = live["port"], live["url"]
        idle = []
        for _ in range(8):
            idle.append(kept_alive(port, health)[0])
            time.sleep(0.02)  # idle since distinct times: the first is the oldest
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # 503 before
        assert closed_within(idle[0], 5) == b""  # the oldest made room
        assert all(map(still_open, idle[1:]))
        # refused by the guard: answered, then closed at once (not kept alive for 75 s)
        rebound = socket.create_connection(("127.0.0.1", port), timeout=10)
        rebound.sendall(b"GET /health HTTP/1.1\r\nHost: evil.example\r\n\r\n")
        assert closed_within(rebound, 5).startswith(b"HTTP/1.1 421")
        # mid-request connections are never closed to make room: past the cap, 503
        flood = [half_open(port) for _ in range(10)]
        time.sleep(0.5)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        assert not any(map(still_open, idle))  # every idle one gave its place
        answers = [closed_within(s, 10) for s in flood]
        assert sum(a.startswith(b"HTTP/1.1 503") for a in answers) >= 2
        for s in idle + [rebound] + flood:
            s.close()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    lines = [line for line in live["log"] if "idle keep-alive connection(s) to make room" in line]
    assert lines and len(lines) <= 2, lines  # logged at most once per 10 s
    assert int(re.search(r"\((\d+) in all", lines[-1]).group(1)) >= 8


# ---- 7: a weight file is opened as it was checked ------------------------------------------

def identity_and_poison_deltas(model, root: Path, outside: Path) -> Path:
    """A delta of the served weights below `root` (`root/d`, every element of the final norm
    set to what it is) and an attacker's outside it (`outside/p`, the same norm zeroed)."""
    own = model.state_dict()["model.norm.weight"]
    index = torch.from_numpy(encode_gaps(np.arange(own.numel())))
    for folder, values in ((root / "d", own.flatten().clone()),
                           (outside / "p", torch.zeros(own.numel(), dtype=own.dtype))):
        DeltaUpdate(1, 0, {"model.norm.weight": TensorDelta(own.numel(), index, values)}
                    ).save(folder)
    return root / "d"


@pytest.mark.parametrize("swap, error", [
    ("none", None),
    ("file", "OSError: [Errno 40] Too many levels of symbolic links"),  # O_NOFOLLOW: ELOOP
    ("folder", "NotADirectoryError: [Errno 20] Not a directory: 'd'"),  # with O_DIRECTORY
])
def test_a_delta_swapped_for_a_link_after_the_check_is_not_loaded(model, tokenizer, tmp_path,
                                                                 monkeypatch, swap, error):
    """A delta checked below --weights-root, then its file (or its folder) replaced by a link
    to an attacker's delta outside the root before the server opens it; the attacker acts
    between the two, here just after tiller_version.json was read. Before, DeltaUpdate.load
    looked delta.safetensors up again by name and applied the attacker's delta (200, the norm
    zeroed); now the checked path is opened one folder at a time without following a link:
    400 naming it, nothing applied. Without a swap the same delta applies."""
    root, outside = (tmp_path / "root").resolve(), (tmp_path / "outside").resolve()
    folder = identity_and_poison_deltas(model, root, outside)
    read = native.read_below

    def read_then_swap(*args, **kwargs):
        raw = read(*args, **kwargs)
        if swap == "file":
            (folder / "delta.safetensors").rename(folder / "checked.bin")
            (folder / "delta.safetensors").symlink_to(outside / "p" / "delta.safetensors")
        elif swap == "folder":
            folder.rename(root / "checked")
            folder.symlink_to(outside / "p", target_is_directory=True)
        return raw

    monkeypatch.setattr(native, "read_below", read_then_swap)
    engine = EmbeddedEngine(model, tokenizer.pad_token_id)
    settings = ServeSettings("tiny", stop_token_ids(tokenizer, model.generation_config),
                             weights_root=root)
    port = free_port()
    server, _ = listen.server(create_app(engine, tokenizer, settings), settings.connections,
                              name="tiller serve", host="127.0.0.1", port=port)
    try:
        with uvicorn_thread(server), httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                                  timeout=60) as http:
            probe = {"input_ids": [5, 6, 7, 8, 9]}
            before = http.post("/score", json=probe).json()["logprobs"]
            r = http.post("/update_weights_from_disk", json={"model_path": "d"})
            after = http.post("/score", json=probe).json()
    finally:
        engine.close()
    if swap == "none":
        assert r.status_code == 200 and after["weight_version"] == 1, r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(
            f"delta.safetensors cannot be opened below --weights-root: {error}"), r.text
        assert after["weight_version"] == 0
    assert after["logprobs"] == before  # the identity delta, or nothing, was applied


# ---- 8: one API client must not learn another's prompt from the prefix cache --------------

def test_prefix_cache_scopes_never_share():
    cache = PrefixCache(1 << 20, block_size=4)
    tokens = list(range(12))
    kv = [(torch.zeros(1, 1, 12, 2), torch.zeros(1, 1, 12, 2))]
    cache.put(tokens, kv, "s", scope="key0")
    assert cache.lookup(tokens + [99], "s", scope="key1") == (0, None)  # nor its session
    assert cache.lookup(tokens + [99], None, scope="key1") == (0, None)  # nor its blocks
    assert cache.lookup(tokens + [99], None) == (0, None)  # unscoped is a scope of its own
    assert cache.lookup(tokens + [99], "s", scope="key0")[0] == 12
    assert cache.lookup(tokens[:9] + [99], None, scope="key0")[0] == 8


def test_each_api_key_reuses_only_its_own_prefix_cache(model, tokenizer):
    """Client B cannot confirm a guess at client A's prompt through cached_tokens (nor
    through the time a cache hit saves): the clients' prefixes are never shared."""
    engine = EmbeddedEngine(model, tokenizer.pad_token_id)
    stops = stop_token_ids(tokenizer, model.generation_config)
    app = create_app(engine, tokenizer,
                     ServeSettings("tiny", stops, api_keys=(KEY_A, KEY_B, KEY_C)))
    secret = [5 + i % 50 for i in range(48)]  # A's prompt: three whole blocks of 16
    guess = secret[:32] + [99, 98]  # B's guess at its first 32 tokens

    with TestClient(app, base_url="http://127.0.0.1") as c:
        def cached(key: str, ids: list[int], **extra) -> int:
            r = c.post("/generate", headers={"Authorization": f"Bearer {key}"}, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 2}, **extra})
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]["cached_tokens"]

        assert cached(KEY_A, secret, session_id="s") == 0
        assert cached(KEY_B, guess) == 0  # a hit would confirm the guess
        assert cached(KEY_C, secret + [7], session_id="s") == 0  # nor A's session
        r = c.post("/v1/completions", headers={"Authorization": f"Bearer {KEY_B}"}, json={
            "model": "tiny", "prompt": secret[:40], "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # B's own
        assert cached(KEY_A, guess) == 32  # A reuses its own prefix
    engine.close()


# ---- 10: short API keys -------------------------------------------------------------------

def test_short_api_keys_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"api key 1 has 15 characters; use at least 16"):
        ServeSettings("m", (2,), api_keys=("x" * 15,))
    with pytest.raises(ConfigError, match="given twice"):
        ServeSettings("m", (2,), api_keys=(KEY_A, KEY_A))
    for args, key, says in [
        (["--api-key", "hunter2"], None, "api key 1 has 7 characters; use at least 16"),
        ([], f"{KEY_A} hunter2", "api key 2 has 7 characters"),
        (["--api-key", "has space inside the key"], None, "whitespace"),
    ]:
        code, out = cli("serve", tmp_path / "no_model", *args, env={"TILLER_API_KEY": key})
        lines = out.strip().splitlines()
        assert code == 2 and len(lines) == 1 and says in lines[0], lines
        assert lines[0].startswith("error: ")
    assert Path(tmp_path / "no_model").exists() is False
