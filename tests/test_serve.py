"""`tiller serve`: a real server subprocess on 127.0.0.1 answering the official `openai` client,
SGLang's /generate and every bad input with JSON errors; weight updates only from below
--weights-root. A few checks that need no engine traffic (api key, a failing engine) run
in-process on FastAPI's TestClient."""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from http.client import HTTPConnection

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
import uvicorn
from fastapi.testclient import TestClient
from helpers import cli, free_port, serve_process
from safetensors import safe_open
from safetensors.torch import save_file

from tiller.engine.delta import DeltaUpdate
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.parts import PartsUpdate, ShardCopy, part_name
from tiller.engine.updates import WeightUpdate
from tiller.envs import ENVS
from tiller.models import load_model, load_tokenizer
from tiller.rollout.agent_loop import EpisodeLimits
from tiller.rollout.chat import ChatFormat, stop_token_ids
from tiller.rollout.collect import collect_expert
from tiller.serve.app import create_app
from tiller.serve.guard import META_MAX_BYTES, is_loopback, open_below
from tiller.serve.openai_routes import json_values, parse_chat
from tiller.serve.protocol import APIError
from tiller.serve.server import MAX_JSON_VALUES, ServeSettings

MAX_PROMPT, MAX_BODY, MAX_N = 512, 65536, 4


@pytest.fixture(scope="module")
def episode(calc_model_dir):
    """One scripted calculator episode: its opening messages, tools and first (tool-call) turn."""
    env_cls = ENVS["calculator"]
    tokenizer = load_tokenizer(calc_model_dir)
    task = env_cls.make_tasks("train", 1, 3, 2)[0]
    (traj,) = collect_expert(env_cls, [task], tokenizer, guess=0.0,
                             limits=EpisodeLimits(6, 512), seed=0)
    start, end = traj.turn_spans[0]
    opening = [m for m in traj.messages if m["role"] in ("system", "user")][:2]
    return {"ids": list(traj.token_ids[:end]), "start": start, "messages": opening,
            "tools": env_cls().tool_schemas(), "call": traj.messages[2]["tool_calls"][0]}


@pytest.fixture(scope="module")
def tool_model_dir(calc_model_dir, episode, tmp_path_factory):
    """The tiny model overfit on the episode's first turn, so greedy decoding makes the call."""
    model = load_model(calc_model_dir)
    torch.manual_seed(0)
    ids, start = torch.tensor([episode["ids"]]), episode["start"]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(60):
        logits = model(ids).logits[0, start - 1 : -1]  # position t predicts token t + 1
        loss = F.cross_entropy(logits, ids[0, start:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    out = tmp_path_factory.mktemp("serve") / "tool_model"
    model.save_pretrained(out)
    load_tokenizer(calc_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights_root")


@pytest.fixture(scope="module")
def server(tool_model_dir, weights_root):
    """A live `tiller serve` on a free loopback port; stopped at teardown."""
    with serve_process(tool_model_dir, "--weights-root", str(weights_root),
                       "--max-prompt-tokens", str(MAX_PROMPT), "--max-body-bytes",
                       str(MAX_BODY), "--max-n", str(MAX_N)) as live:
        yield {**live, "model": str(tool_model_dir)}


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server["url"], timeout=60) as client:
        yield client


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", timeout=60,
                         max_retries=0)


# ---- the openai client ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.integration
def test_openai_chat_completion_returns_the_parsed_tool_call(server, client, episode):
    resp = client.chat.completions.create(
        model=server["model"], messages=episode["messages"], tools=episode["tools"],
        temperature=0, max_tokens=64, extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert resp.prompt_token_ids == episode["ids"][: episode["start"]]  # the rendered prompt
    assert choice.token_ids == episode["ids"][episode["start"]:]  # the trained turn, exactly
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == episode["call"]["function"]["name"] == "calculate"
    assert json.loads(call.function.arguments) == episode["call"]["function"]["arguments"]
    assert choice.message.content is None
    assert resp.usage.prompt_tokens == episode["start"]
    assert resp.usage.completion_tokens == len(choice.token_ids)
    assert [m.id for m in client.models.list().data] == [server["model"]]


@pytest.mark.slow
@pytest.mark.integration
def test_openai_streaming_chat_gives_the_same_call(server, client, episode):
    stream = client.chat.completions.create(
        model=server["model"], messages=episode["messages"], tools=episode["tools"],
        temperature=0, max_tokens=64, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [tc.function.name for tc in calls] == ["calculate"]
    assert json.loads(calls[0].function.arguments) == episode["call"]["function"]["arguments"]
    assert finish[-1] == "tool_calls" and all(f is None for f in finish[:-1])
    assert chunks[-1].usage.completion_tokens == len(episode["ids"]) - episode["start"]


@pytest.mark.slow
@pytest.mark.integration
def test_openai_completions_with_n_logprobs_and_streaming(server, client):
    kwargs = {"model": server["model"], "prompt": "Ben has 45 crates", "max_tokens": 6,
              "temperature": 1.0, "seed": 11, "n": 3, "logprobs": 0}
    resp = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.text for c in resp.choices]
    assert len(set(map(tuple, (c.token_ids for c in resp.choices)))) == 3  # one seed each
    for c in resp.choices:
        assert len(c.logprobs.token_logprobs) == len(c.token_ids) == 6
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    again = client.completions.create(**kwargs)  # seeded: the same choices
    assert [c.text for c in again.choices] == texts
    streamed = [""] * 3
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


# ---- /generate ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.integration
def test_generate_round_trips_ids_and_logprobs(http, tool_model_dir):
    tokenizer = load_tokenizer(tool_model_dir)
    prompt = tokenizer.encode("Ben has 45 crates with 31 beads in each.")
    sp = {"temperature": 0.8, "max_new_tokens": 12, "seed": 7, "stop_token_ids": [2]}
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp,
                                     "return_logprob": True, "rid": "round-trip"})
    assert r.status_code == 200, r.text
    out = r.json()
    ids, meta = out["output_ids"], out["meta_info"]
    assert meta["id"] == "round-trip" and meta["seed"] == 7 and meta["weight_version"] == 0
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(ids) > 0
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["logprob_kind"] == "sampled"  # of the distribution sampled from
    assert out["text"] == tokenizer.decode([t for t in ids if t != 2],
                                           skip_special_tokens=False)

    model = load_model(tool_model_dir)  # fp32: the engine's logprobs are the model's
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    served = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert (served - expected).abs().max().item() < 1e-4

    by_text = http.post("/generate", json={"text": "Ben has 45 crates with 31 beads in each.",
                                           "sampling_params": sp}).json()
    assert by_text["output_ids"] == ids  # text is tokenized to the same prompt


@pytest.mark.slow
@pytest.mark.integration
def test_generate_without_seed_reports_the_one_it_drew(http):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}}
    first = http.post("/generate", json=body).json()
    seed = first["meta_info"]["seed"]
    body["sampling_params"]["seed"] = seed
    assert http.post("/generate", json=body).json()["output_ids"] == first["output_ids"]


# ---- bad input: a 4xx with OpenAI's error shape, and the server lives on --------------------

CHAT = {"model": None, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CMPL = {"model": None, "prompt": "hi", "max_tokens": 4}
GEN = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}

BAD = [  # (id, route, body: dict, or bytes sent as they are, expected status, message part)
    ("malformed-json", "/generate", b'{"input_ids": [1, 2', 400, "Invalid JSON"),
    ("malformed-json-chat", "/v1/chat/completions", b"{'model': 1}", 400, "Invalid JSON"),
    ("invalid-utf8", "/generate", b'{"text": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("invalid-utf8-chat", "/v1/chat/completions", b"\xc3\x28", 400, "not valid UTF-8"),
    ("unknown-field", "/generate", {**GEN, "temprature": 0.5}, 400, "temprature"),
    ("unknown-sampling-field", "/generate",
     {"input_ids": [5], "sampling_params": {"max_new_tokens": 4, "min_p": 0.1}}, 400, "min_p"),
    ("unknown-field-chat", "/v1/chat/completions", {**CHAT, "presence_penalty": 1}, 400,
     "presence_penalty"),
    ("prompt-over-limit", "/generate", {"input_ids": [5] * (MAX_PROMPT + 1)}, 400,
     "--max-prompt-tokens"),
    ("prompt-plus-new-over-context", "/generate",
     {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 2000}}, 400, "context"),
    ("chat-over-context", "/v1/chat/completions", {**CHAT, "max_tokens": 2048}, 400, "context"),
    ("max-new-tokens-0", "/generate", {"input_ids": [5], "sampling_params":
                                       {"max_new_tokens": 0}}, 400, "max_new_tokens"),
    ("max-tokens-0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", {**CMPL, "max_tokens": -3}, 400, "max_tokens"),
    ("max-completion-tokens-0", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("n-over-max", "/v1/chat/completions", {**CHAT, "n": MAX_N + 1}, 400, "--max-n"),
    ("n-zero", "/v1/completions", {**CMPL, "n": 0}, 400, "n"),
    ("text-and-ids", "/generate", {"text": "a", "input_ids": [5]}, 400, "exactly one"),
    ("neither-text-nor-ids", "/generate", {"sampling_params": {}}, 400, "exactly one"),
    ("empty-prompt", "/generate", {"input_ids": []}, 400, "empty"),
    ("id-outside-vocab", "/generate", {"input_ids": [5, 10**9]}, 400, "vocabulary"),
    ("negative-id", "/generate", {"input_ids": [-1]}, 400, "vocabulary"),
    ("empty-stop-ids", "/generate", {**GEN, "sampling_params": {"stop_token_ids": []}}, 400,
     "stop_token_ids"),
    ("stop-strings", "/generate", {**GEN, "sampling_params": {"stop": ["\n"]}}, 400,
     "stop strings"),
    ("stop-strings-chat", "/v1/chat/completions", {**CHAT, "stop": "x"}, 400, "stop strings"),
    ("stream-generate", "/generate", {**GEN, "stream": True}, 400, "stream"),
    ("top-logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2},
     400, "top log-probabilities are not supported"),
    ("completion-top-logprobs", "/v1/completions", {**CMPL, "logprobs": 2}, 400,
     "not supported"),
    ("string-number", "/generate", {**GEN, "sampling_params": {"temperature": "0.5"}}, 400,
     "temperature"),
    ("nan", "/generate", b'{"input_ids": [5], "sampling_params": {"temperature": NaN}}', 400,
     "finite number"),
    ("negative-temperature", "/generate", {**GEN, "sampling_params": {"temperature": -1}}, 400,
     "temperature"),
    ("top-p-zero", "/v1/completions", {**CMPL, "top_p": 0}, 400, "top_p"),
    ("no-messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("bad-role", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("tool-args-not-json", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "arguments"),
    ("tool-choice-required", "/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400,
     "tool_choice"),
    ("unknown-model", "/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "gpt-9"),
    ("body-too-large", "/generate", {"text": "x" * MAX_BODY}, 413, "--max-body-bytes"),
    ("abort-unknown-rid", "/abort_request", {"rid": "nobody"}, 404, "nobody"),
    ("abort-nothing", "/abort_request", {}, 400, "rid"),
    ("update-unknown-field", "/update_weights_from_disk", {"model_path": "x", "pth": 1}, 400,
     "pth"),
    ("huge-top-k", "/generate", {**GEN, "sampling_params": {"top_k": 2**70}}, 400, "top_k"),
    ("huge-top-k-chat", "/v1/chat/completions", {**CHAT, "top_k": 2**31}, 400, "top_k"),
    ("text-over-char-bound", "/generate", {"text": "x" * (32 * MAX_PROMPT + 1)}, 400,
     "characters"),
    ("chat-over-char-bound", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "x" * (32 * MAX_PROMPT + 1)}]}, 400,
     "characters"),
    ("echo", "/v1/completions", {**CMPL, "echo": True}, 400, "echo"),
    ("tool-schema-not-object", "/v1/chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     400, "type"),
    ("pause-junk", "/pause_generation", {"junk": 1}, 400, "junk"),
    ("continue-junk", "/continue_generation", {"mode": "x"}, 400, "mode"),
    ("flush-junk", "/flush_cache", b"[1, 2]", 400, "invalid request"),
]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("route, body, status, part", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_input_gets_a_4xx(server, http, route, body, status, part):
    if isinstance(body, dict) and "model" in body:
        body = {**body, "model": body["model"] or server["model"]}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert part in error["message"] and error["code"] == status and error["type"]
    assert http.get("/health").status_code == 200


def test_the_json_value_bound_is_fixed_whatever_the_context():
    """A chat request's JSON values are bounded by --max-json-values, not by the context: with
    a 1M-token context the old bound (tokens + 64) let a million values through to pydantic,
    which validates them holding the GIL (0.2-0.35 s at 131,072). Each empty content part is 3
    values; the rest of this request is 6."""
    def body(parts: int) -> bytes:
        return json.dumps({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": ""}] * parts}]}).encode()

    at_cap = (MAX_JSON_VALUES - 6) // 3
    assert 6 + 3 * at_cap == MAX_JSON_VALUES == ServeSettings("m", ()).max_json_values
    assert json_values(json.loads(body(at_cap)), MAX_JSON_VALUES) == MAX_JSON_VALUES
    assert json_values(json.loads(body(at_cap + 1)), MAX_JSON_VALUES) == MAX_JSON_VALUES + 1
    accepted = parse_chat(body(at_cap), 1_000_000, "--max-prompt-tokens", MAX_JSON_VALUES,
                          "--max-json-values")
    assert len(accepted.messages[0].content) == at_cap
    with pytest.raises(APIError) as refused:
        parse_chat(body(at_cap + 1), 1_000_000, "--max-prompt-tokens", MAX_JSON_VALUES,
                   "--max-json-values")
    assert refused.value.status == 400
    assert refused.value.message.startswith(
        f"the request has over {MAX_JSON_VALUES} JSON values, the limit of --max-json-values")
    with pytest.raises(APIError, match="over 9 JSON values"):  # a smaller bound, given
        parse_chat(body(2), 1_000_000, "--max-prompt-tokens", 9, "--max-json-values")
    assert parse_chat(body(1), 1_000_000, "--max-prompt-tokens", 9, "--max-json-values")


def test_open_below_never_climbs_out_of_the_root_nor_opens_hard_links(tmp_path):
    """open_below checked `root in real.parents` by spelling: root/a/../../x passed it, and the
    walk opened a, .., .. and x: the file outside the root. A hard link in the root to a file
    elsewhere (any file the server's user can read) is refused too; a plain file opens."""
    root, outside = tmp_path / "root", tmp_path / "x"
    (root / "a").mkdir(parents=True)
    outside.write_bytes(b"secret")
    with pytest.raises(APIError) as climbed:
        open_below(root, root / "a" / ".." / ".." / "x")
    assert climbed.value.status == 403 and "outside --weights-root" in climbed.value.message
    (root / "a" / "linked.safetensors").hardlink_to(outside)
    with pytest.raises(APIError) as linked:
        open_below(root, root / "a" / "linked.safetensors")
    assert linked.value.status == 400
    assert linked.value.message == ("linked.safetensors has 2 hard links; a weight file must "
                                    "have one")
    (root / "a" / "w.safetensors").write_bytes(b"weights")
    fd = open_below(root, root / "a" / "w.safetensors")
    with os.fdopen(fd, "rb") as f:
        assert f.read() == b"weights"


@pytest.mark.slow
@pytest.mark.integration
def test_a_chunked_body_over_the_limit_gets_413(http):
    def chunks():
        yield b'{"text": "'
        for _ in range(MAX_BODY // 1000 + 1):
            yield b"x" * 1000
        yield b'"}'

    # no content-length: counted as it streams
    r = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.integration
def test_unknown_route_and_method_are_json_errors(http):
    assert http.get("/nowhere").json()["error"]["code"] == 404
    assert http.get("/generate").json()["error"]["code"] == 405


# ---- weights from disk ----------------------------------------------------------------------

def _greedy(http, max_new_tokens=8) -> dict:
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0,
                                                            "max_new_tokens": max_new_tokens}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def checkpoints(tool_model_dir, weights_root, tmp_path_factory):
    """Below the root: the served weights, the same plus noise, a misfit; outside it: a copy,
    reachable only through links from inside."""
    model = load_model(tool_model_dir)
    WeightUpdate.full(model, 0).save(weights_root / "same")
    gen = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in
             model.state_dict().items()}
    WeightUpdate(0, noisy).save(weights_root / "noisy")
    WeightUpdate(0, {"lm_head.weight": torch.zeros(3, 3)}).save(weights_root / "misfit")
    norm = model.state_dict()["model.norm.weight"]
    WeightUpdate(0, {"model.norm.weight": torch.zeros_like(norm)}, partial=True).save(
        weights_root / "partial")
    outside = tmp_path_factory.mktemp("outside")
    WeightUpdate(0, noisy).save(outside / "ckpt")
    (weights_root / "link").symlink_to(outside / "ckpt", target_is_directory=True)
    (weights_root / "file_link").mkdir()
    (weights_root / "file_link" / "model.safetensors").symlink_to(
        outside / "ckpt" / "model.safetensors")
    (weights_root / "loop_a").symlink_to(weights_root / "loop_b")  # a loop inside the root
    (weights_root / "loop_b").symlink_to(weights_root / "loop_a")
    (outside / "loop_c").symlink_to(outside / "loop_d")  # and one outside, linked from inside
    (outside / "loop_d").symlink_to(outside / "loop_c")
    (weights_root / "out_loop").symlink_to(outside / "loop_c")
    # tiller_version.json is read under the same rules as the weights (issue 19, item 7): a
    # link out of the root (its content would make any folder a delta), a FIFO (reading it
    # would block the update forever), a file too large to read
    (outside / "meta.json").write_text('{"kind": "full"}')
    for name in ("meta_link", "meta_fifo", "meta_huge"):
        WeightUpdate.full(model, 0).save(weights_root / name)
        (weights_root / name / "tiller_version.json").unlink(missing_ok=True)
    (weights_root / "meta_link" / "tiller_version.json").symlink_to(outside / "meta.json")
    os.mkfifo(weights_root / "meta_fifo" / "tiller_version.json")
    with open(weights_root / "meta_huge" / "tiller_version.json", "wb") as f:
        f.truncate(META_MAX_BYTES + 1)  # sparse: no disk used
    # and validated: a malformed one is a 400 with the reason, never a 500 or a guess
    for name, text in MALFORMED_META.items():  # beside the weights and a delta (of nothing)
        WeightUpdate.full(model, 0).save(weights_root / name)
        DeltaUpdate(1, 0, {}).save(weights_root / name)
        (weights_root / name / "tiller_version.json").write_text(text)
    for name, change in MALFORMED_PARTS.items():  # a valid part of the served weights, changed
        folder = weights_root / name
        folder.mkdir()
        ShardCopy(model, 0, 1).write(folder / part_name(0), weights_root, 1, None,
                                     torch.float32, "full")
        PartsUpdate(1, None, 1).save(folder, root=weights_root)
        with safe_open(str(folder / part_name(0)), "pt") as f:
            meta = json.loads(f.metadata()["tiller_part"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        change(meta, tensors)
        save_file(tensors, str(folder / part_name(0)),
                  metadata={"tiller_part": json.dumps(meta)})
    return outside


NORM = "model.norm.weight"
MALFORMED_PARTS = {  # name -> a change of a part's metadata or tensors: a 500 or taken before
    "part_ranges_list": lambda meta, _: meta.update(ranges=list(meta["ranges"].values())),
    "part_range_short": lambda meta, _: meta["ranges"][NORM].pop(),
    "part_start_text": lambda meta, _: meta["ranges"][NORM].__setitem__(1, "0"),
    "part_no_checksum": lambda meta, _: meta["checksums"].pop(NORM),
    "part_extra_tensor": lambda _, tensors: tensors.update({"extra/val": torch.zeros(1)}),
    "part_val_short": lambda _, tensors: tensors.update(
        {f"{NORM}/val": tensors[f"{NORM}/val"][:-1].clone()}),
}
PART = "part-0.safetensors (trainer rank 0's part)"


MALFORMED_META = {  # name -> tiller_version.json; each was a 500 or silently taken before
    "meta_array": "[1, 2]",
    "meta_numel_array": '{"kind": "delta", "base_version": 0, "numel": [1]}',
    "meta_numel_nested": '{"kind": "delta", "base_version": 0, "numel": {"x": [1]}}',
    "meta_base_array": '{"kind": "delta", "base_version": [0], "numel": {}}',
    "meta_no_base": '{"kind": "delta", "numel": {}}',
    "meta_checksums_text": '{"kind": "full", "checksums": "abc"}',
    "meta_deep": "[" * 100_000,
    "meta_kind": '{"kind": "sparse"}',
    "meta_extra": '{"kind": "full", "weights": "all"}',
    "meta_newline_key": '{"kind": "delta", "base_version": 0, "numel": {"a\\nb": "1"}}',
    "meta_parts_none": '{"kind": "parts"}',
    "meta_parts_zero": '{"kind": "parts", "parts": 0}',
    "meta_parts_missing": '{"kind": "parts", "parts": 2}',  # valid, and no part file beside it
}


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("path, status, part", [
    ("../outside", 403, "outside --weights-root"),
    ("same/../../x", 403, "outside --weights-root"),
    ("/etc", 403, "outside --weights-root"),
    ("link", 403, "outside --weights-root"),
    ("file_link", 403, "links outside"),
    ("missing", 400, "not a folder"),
    ("misfit", 400, "does not fit the model"),
    ("nul\x00byte", 400, "cannot be resolved"),
    ("a" * 300, 400, "cannot be resolved"),
    ("loop_a", 400, "cannot be resolved"),
    ("out_loop", 400, "cannot be resolved"),
    ("meta_link", 403, "tiller_version.json links outside --weights-root"),
    ("meta_fifo", 400, "tiller_version.json is not a regular file"),
    ("meta_huge", 400, f"tiller_version.json has {META_MAX_BYTES + 1} bytes"),
    ("meta_parts_missing", 400, "the part of trainer rank(s) [0, 1] (part-0.safetensors, "
                                "part-1.safetensors) is missing: nothing applied"),
    *[(name, 400, f"{PART} tiller_part metadata is malformed: {why}") for name, why in [
        ("part_ranges_list", "ranges: Input should be an object"),
        ("part_range_short", f"ranges.{NORM}.2: Field required"),
        ("part_start_text", f"ranges.{NORM}.1: Input should be a valid integer"),
        ("part_no_checksum", f"the metadata: Value error, ranges and checksums name other "
                             f"tensors ({NORM})"),
    ]],
    ("part_extra_tensor", 400, f"{PART}: its tensors are not its ranges' /val: unexpected "
                               "extra/val"),
    ("part_val_short", 400, f"{PART}: {NORM}/val has shape ["),
    *[(name, 400, f"tiller_version.json is malformed: {why}") for name, why in [
        ("meta_array", "the file: Input should be an object"),
        ("meta_numel_array", "numel: Input should be an object"),
        ("meta_numel_nested", "numel.x: Input should be a valid integer"),
        ("meta_base_array", "base_version: Input should be a valid integer"),
        ("meta_no_base", "the file: Value error, a delta needs base_version and numel"),
        ("meta_checksums_text", "checksums: Input should be an object"),
        ("meta_deep", "the file: Invalid JSON: recursion limit exceeded"),
        ("meta_kind", "kind: Input should be 'full', 'delta' or 'parts'"),
        ("meta_parts_none", "the file: Value error, parts is the count of kind 'parts'"),
        ("meta_parts_zero", "parts: Input should be greater than or equal to 1"),
        ("meta_extra", "weights: Extra inputs are not permitted"),
        ("meta_newline_key", "numel.a b: Input should be a valid integer"),
    ]],
])
def test_weights_outside_the_root_or_misfit_are_refused(http, checkpoints, path, status, part):
    before = _greedy(http)
    if path == "/etc":
        path = str(checkpoints / "ckpt")  # an absolute path outside the root
    r = http.post("/update_weights_from_disk", json={"model_path": path}, timeout=20)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert part in message and "\n" not in message, message
    after = _greedy(http)  # weights and version unchanged
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]


@pytest.mark.slow
@pytest.mark.integration
def test_a_fifo_named_safetensors_is_refused_without_hanging(http, weights_root):
    (weights_root / "fifo").mkdir()
    os.mkfifo(weights_root / "fifo" / "x.safetensors")  # opening it would block the load
    r = http.post("/update_weights_from_disk", json={"model_path": "fifo"}, timeout=20)
    assert r.status_code == 400 and "not a regular file" in r.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.integration
def test_update_weights_from_disk_echoes_the_version_and_changes_outputs(http, checkpoints):
    before = _greedy(http)
    version = before["meta_info"]["weight_version"]
    r = http.post("/update_weights_from_disk", json={"model_path": "noisy", "weight_version": 5})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["weight_version"] == 5
    assert http.get("/get_model_info").json()["weight_version"] == 5
    noisy = _greedy(http)
    assert noisy["meta_info"]["weight_version"] == 5
    assert noisy["output_ids"] != before["output_ids"]
    # the original weights again, version defaulting to the current + 1
    r = http.post("/update_weights_from_disk", json={"model_path": "same"})
    assert r.json()["weight_version"] == 6
    restored = _greedy(http)
    assert restored["output_ids"] == before["output_ids"] and version == 0


@pytest.mark.slow
@pytest.mark.integration
def test_a_partial_update_from_disk_changes_only_what_it_names(http, checkpoints):
    """tiller_version.json's `partial` is honoured (it was ignored: 400, missing tensors)."""
    before = _greedy(http)
    r = http.post("/update_weights_from_disk", json={"model_path": "partial"})
    assert r.status_code == 200, r.text
    after = _greedy(http)  # the norm was zeroed, everything else kept
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"] + 1
    assert after["output_ids"] != before["output_ids"]
    r = http.post("/update_weights_from_disk", json={"model_path": "same"})
    assert r.status_code == 200 and _greedy(http)["output_ids"] == before["output_ids"]


# ---- control routes (the engine's abort, pause/resume, cache) -------------------------------

@pytest.mark.slow
@pytest.mark.integration
def test_pause_queues_requests_and_abort_returns_them_partial(http, server):
    assert http.post("/pause_generation", json={}).json() == {"success": True}
    answers: dict[str, httpx.Response] = {}

    def ask(rid: str) -> None:
        with httpx.Client(base_url=server["url"], timeout=60) as c:
            answers[rid] = c.post("/generate", json={
                "input_ids": [5, 6, 7], "rid": rid, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 16, "stop_token_ids": [0]}})

    threads = [threading.Thread(target=ask, args=(rid,)) for rid in ("a", "b")]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
        assert not answers  # paused: queued, not answered
        r = http.post("/abort_request", json={"rid": "a"})
        assert r.status_code == 200 and r.json() == {"success": True, "aborted": 1}
        threads[0].join(timeout=30)
        a = answers["a"].json()
        assert a["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(a["output_ids"]) == len(a["meta_info"]["output_token_logprobs"]) < 16
        assert "b" not in answers
    finally:
        assert http.post("/continue_generation", json={}).json() == {"success": True}
        for t in threads:
            t.join(timeout=60)
    b = answers["b"].json()
    reason = b["meta_info"]["finish_reason"]["type"]
    # b was never aborted: it ran to its length or, unseeded, sampled the stop id first
    assert (reason == "length" and len(b["output_ids"]) == 16
            or reason == "stop" and b["output_ids"][-1] == 0), b


@pytest.mark.slow
@pytest.mark.integration
def test_session_reuses_the_kv_and_flush_cache_drops_it(http):
    first = http.post("/generate", json={
        "input_ids": [5, 6, 7, 8], "session_id": "s1",
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [0]}}).json()
    turn2 = [5, 6, 7, 8, *first["output_ids"], 9, 10]
    body = {"input_ids": turn2, "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                    "stop_token_ids": [0]}}
    cached = http.post("/generate", json={**body, "session_id": "s1"}).json()
    assert cached["meta_info"]["cached_tokens"] >= 4
    fresh = http.post("/generate", json=body).json()
    assert cached["output_ids"] == fresh["output_ids"]  # reuse changes nothing but the work
    flushed = http.post("/flush_cache", json={}).json()
    assert flushed["success"] is True and flushed["entries_dropped"] >= 1


# ---- start-up safety and in-process checks --------------------------------------------------

def test_a_non_loopback_host_without_a_key_is_refused(tool_model_dir):
    code, out = cli("serve", tool_model_dir, "--host", "0.0.0.0", "--port", "1",
                    env={"TILLER_API_KEY": None})
    assert code == 2
    out = out.strip()
    assert len(out.splitlines()) == 1 and "--api-key" in out and "Traceback" not in out


def test_loopback_hosts():
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "::", "example.com"]))


KEY = "s3cret-0123456789"


def _app(model, tokenizer, **settings):
    engine = EmbeddedEngine(model, tokenizer.pad_token_id)
    stops = stop_token_ids(tokenizer, model.generation_config)
    return create_app(engine, tokenizer, ServeSettings("tiny", stops, **settings))


def _client(app, **kwargs) -> TestClient:
    """FastAPI's in-process client, sending the Host header of a loopback address (its
    default, "testserver", is refused as DNS rebinding would be)."""
    return TestClient(app, base_url="http://127.0.0.1", **kwargs)


def test_api_key_guards_every_route_but_health(model, tokenizer):
    with _client(_app(model, tokenizer, api_keys=(KEY,))) as c:
        assert c.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.get("/get_model_info", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.post("/generate", json=GEN, headers=headers).status_code == 401
        ok = c.get("/get_model_info", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["model_path"] == "tiny"


def test_a_failing_engine_answers_500_json_and_logs(model, tokenizer, caplog):
    forward, calls = model.forward, []

    @functools.wraps(forward)  # the engine reads its signature
    def broken_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the accelerator fell over")
        return forward(*args, **kwargs)

    model.forward = broken_forward  # a fault inside the real engine: prefill works, decode not
    with _client(_app(model, tokenizer, request_timeout_s=60), \
                 raise_server_exceptions=False) as c, \
            caplog.at_level(logging.ERROR, logger="tiller.serve"):
        r = c.post("/generate", json=GEN)
        assert r.status_code == 500
        assert r.json()["error"]["message"] == ("the engine failed: RuntimeError: the "
                                                "accelerator fell over")
        assert c.get("/health").status_code == 200
    assert any("the engine failed" in rec.getMessage() for rec in caplog.records)


@pytest.mark.integration
def test_an_unexpected_error_is_a_json_500_and_the_connection_lives_on(model, tokenizer,
                                                                        caplog):
    """A real uvicorn on loopback: the 500 is answered without re-raising, so uvicorn keeps
    the kept-alive connection (it drops it after an exception escapes the app)."""
    app = _app(model, tokenizer)

    @app.get("/boom")
    async def boom() -> None:
        raise KeyError("a bug")

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    conn = HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        with caplog.at_level(logging.ERROR, logger="tiller.serve"):
            conn.request("GET", "/boom")
            r = conn.getresponse()
            assert r.status == 500
            assert json.loads(r.read())["error"]["message"] == "internal error: KeyError"
        sock = conn.sock
        conn.request("GET", "/health")  # on the same connection
        r = conn.getresponse()
        assert (r.status, json.loads(r.read())) == (200, {"status": "ok"})
        assert conn.sock is sock  # not reconnected
        assert any("GET /boom failed" in rec.getMessage() for rec in caplog.records)
    finally:
        conn.close()
        srv.should_exit = True
        thread.join(timeout=20)
    assert not thread.is_alive()


def test_a_generation_past_the_timeout_is_aborted_with_504(model, tokenizer):
    app = _app(model, tokenizer, request_timeout_s=1.0)
    engine = app.state.server.engine
    with _client(app) as c:
        engine.pause()  # nothing decodes: the request waits until the timeout
        r = c.post("/generate", json=GEN)
        assert r.status_code == 504
        assert "/continue_generation" in r.json()["error"]["message"]
        engine.resume()
        assert c.post("/generate", json=GEN).json()["meta_info"]["completion_tokens"] == 4


def test_chat_template_rendering_matches_the_agent_loop(tokenizer, episode):
    """The server renders OpenAI messages exactly as the agent loop rendered the episode."""
    from tiller.serve.openai_routes import template_message
    from tiller.serve.protocol import ChatMessage, ToolDef

    msgs = [template_message(ChatMessage.model_validate(m)) for m in episode["messages"]]
    tools = [ToolDef.model_validate(t).model_dump(exclude_none=True) for t in episode["tools"]]
    assert ChatFormat(tokenizer, tools).prompt_ids(msgs) == episode["ids"][: episode["start"]]
