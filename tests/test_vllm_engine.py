"""The vLLM backend (engine/vllm.py) against live vLLM CPU servers that the tests start from
.venv-vllm (`bash scripts/setup.sh`), on a tiny Qwen3 with head_dim 32 (vLLM's CPU attention
has no head size 16). Every server is stopped; each start is bounded by startup_timeout_s."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiller.config import VllmEngineConfig
from tiller.engine.api import SamplingParams
from tiller.engine.updates import WeightSyncError, WeightUpdate
from tiller.engine.vllm import VllmEngine, connect_vllm, default_python
from tiller.errors import ConfigError, RunError
from tiller.models import build_tiny_model

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
    return VllmEngineConfig(startup_timeout_s=START_S, kv_cache_bytes=64 << 20,
                            request_timeout_s=60, **kw)


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


def test_abort_returns_the_partial_turn(served) -> None:
    engine, _, _ = served
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
    out = gen(engine, [9, 9, 9], 1, max_new_tokens=500, rid="long-one")
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


def test_an_aborting_push_ends_the_running_turn_with_its_tokens(served) -> None:
    """`update_weights(in_flight="abort")` (rollout.partial: abort_resume) pauses with
    mode=abort: a turn being generated ends with finish "abort" and the tokens sampled so far,
    under the old version, which the actor resumes under the new weights."""
    engine, model, _ = served
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(gen(
        engine, [9, 9, 9], 1, max_new_tokens=500, rid="cut-by-push")))
    worker.start()
    deadline = time.monotonic() + 30
    while "cut-by-push" not in engine._rids and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a few tokens in
    version = engine.version + 1
    assert engine.update_weights(WeightUpdate(version, model.state_dict()),
                                 in_flight="abort") == version
    worker.join(30)
    (out,) = done
    assert out.finish_reason == "abort", out.finish_reason  # type: ignore[attr-defined]
    assert 0 < len(out.token_ids) < 500  # type: ignore[attr-defined]
    assert set(out.versions) == {version - 1}  # type: ignore[attr-defined]


def test_an_update_that_does_not_fit_is_refused_before_it_is_sent(served) -> None:
    engine, model, _ = served
    tensors = dict(model.state_dict())
    tensors["model.norm.weight"] = torch.ones(7)
    with pytest.raises(WeightSyncError, match=r"model\.norm\.weight: shape \(7,\), served "
                       r"\(128,\).*\(not sent\)|not sent.*model\.norm\.weight"):
        engine.update_weights(WeightUpdate(9, tensors))
    tensors["model.norm.weight"] = torch.full((128,), float("nan"))
    with pytest.raises(WeightSyncError, match="model.norm.weight: not finite"):
        engine.update_weights(WeightUpdate(9, tensors))
    assert engine.version == 2 and gen(engine, [1, 2], 0, max_new_tokens=2).version == 2


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
    with pytest.raises(RunError) as e:  # a Python without vllm: it exits at once
        connect_vllm(cfg(python=sys.executable), model, tok, run_dir=tmp_path / "r2",
                     initial=WeightUpdate.full(model, 0), dtype="float32")
    assert time.monotonic() - start < 60
    msg = str(e.value)
    assert "\n" not in msg and "server vllm-0 (http://127.0.0.1:" in msg
    assert f"log {tmp_path / 'r2' / 'servers' / 'vllm-0.log'}: " in msg
    assert "No module named 'vllm'" in msg


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
        with pytest.raises(RunError, match="every engine server is down"):
            gen(engine, [1, 2, 3], 0, max_new_tokens=4)
        assert time.monotonic() - start < 30
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
