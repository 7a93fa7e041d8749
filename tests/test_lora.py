"""LoRA through peft (`model.lora`, `train/lora.py`) on the tiny calculator model: only the
adapters train, a step moves only them, the KL reference is the base, the merged copy the
engine gets computes the policy's logits, checkpoints hold the adapter and load back."""

from __future__ import annotations

import copy
import json
import shutil
import sys

import pytest
import torch
from test_distributed import batch_of

from tiller.config import LoRAConfig, RLConfig, WeightSyncConfig, load_config
from tiller.engine.embedded import EmbeddedEngine
from tiller.engine.weight_sync import WeightSync
from tiller.errors import ConfigError
from tiller.models import load_model
from tiller.train.lora import Lora, LoraTrainer
from tiller.train.trainer import PolicyTrainer

LORA = LoRAConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def lora_of(model_dir) -> Lora:
    torch.manual_seed(0)
    return Lora(load_model(model_dir), LORA)


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def test_only_adapter_tensors_train(calc_model_dir):
    lora = lora_of(calc_model_dir)
    trainable = {n: p for n, p in lora.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    config = lora.merged.config  # 2 layers, q_proj and v_proj each: r (in + out)
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim
    per_layer = 4 * (hidden + heads * head_dim) + 4 * (hidden + kv * head_dim)
    assert lora.trainable() == config.num_hidden_layers * per_layer
    trainer = LoraTrainer(lora)
    trainer.set_optimizer(1e-3)
    opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert opt == {id(p) for p in trainable.values()}


def test_a_step_moves_only_the_adapters_and_merged_follows(calc_model_dir, tokenizer):
    lora = lora_of(calc_model_dir)
    base = {k: t.clone() for k, t in lora.policy.state_dict().items()}
    trainer = LoraTrainer(lora)
    trainer.set_optimizer(1e-2)
    trainer.sft_step(batch_of(tokenizer), 4)
    after = lora.policy.state_dict()
    moved = {k for k in base if not torch.equal(base[k], after[k])}
    assert moved and all(".lora_" in k for k in moved)
    assert any(".lora_B." in k for k in moved)  # B starts at 0: it moved off it
    # merged = W + (alpha / r) B A, by hand, on one targeted layer
    prefix = "base_model.model.model.layers.0.self_attn.q_proj."
    w, a, b = (after[prefix + k] for k in ("base_layer.weight", "lora_A.default.weight",
                                            "lora_B.default.weight"))
    merged = lora.merged.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.allclose(merged, w + (8.0 / 4) * b @ a, atol=1e-7)
    assert not torch.equal(merged, w)
    # the untargeted tensors are the base's own storage: no second copy
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert lora.merged.state_dict()[k_proj].data_ptr() == after[
        "base_model.model." + k_proj].data_ptr()
    batch = batch_of(tokenizer)
    assert torch.allclose(logits(lora.merged, batch), logits(lora.policy, batch), atol=1e-5)


def test_kl_reference_is_the_policy_at_rl_start(calc_model_dir, tokenizer):
    """SFT moves the adapters; the reference frozen when RL starts (a second adapter holding
    a copy of them) equals the post-SFT policy, not the base; the first RL step's KL is 0, and
    the step trains the policy's adapter only, never the reference's."""
    lora = lora_of(calc_model_dir)
    trainer = LoraTrainer(lora)
    trainer.set_optimizer(1e-2)
    batch = batch_of(tokenizer)
    trainer.sft_step(batch, 4)
    lora.freeze_reference()
    ref = trainer._reference_logprobs(trainer.model, batch, 4)
    base = PolicyTrainer(load_model(calc_model_dir))._logprobs(
        load_model(calc_model_dir), batch, 4)
    policy = trainer._logprobs(trainer.model, batch, 4)
    on = batch.loss_mask.bool()
    assert (ref - policy)[on].abs().max() < 1e-6
    assert (policy - base)[on].abs().max() > 1e-3  # SFT moved the policy off the base
    trainable = {n for n, p in lora.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)  # the reference is frozen
    trainer.set_optimizer(1e-2)
    cfg = RLConfig(micro_batch_size=4, algorithm={"advantage": "grpo",
                                                  "kl": {"beta": 0.1, "placement": "loss"}})
    metrics = trainer.rl_step(batch, cfg, 8, ref_model=trainer.model)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-9)
    after = trainer._logprobs(trainer.model, batch, 4)
    assert (after - policy)[on].abs().max() > 1e-4  # the step moved the policy
    again = trainer._reference_logprobs(trainer.model, batch, 4)
    assert torch.equal(again, ref)  # and not the reference
    assert {n for n, p in lora.policy.named_parameters() if p.requires_grad} == trainable
    # the next step's KL is the distance to the frozen post-SFT policy
    assert trainer.rl_step(batch, cfg, 8, ref_model=trainer.model)["kl"] > 1e-7


def test_the_engine_gets_the_merged_weights(calc_model_dir, tokenizer):
    """A full sync after a step: the engine's logits equal the policy's (adapters on)."""
    lora = lora_of(calc_model_dir)
    trainer = LoraTrainer(lora)
    engine = EmbeddedEngine(copy.deepcopy(lora.merged), tokenizer.pad_token_id)
    sync = WeightSync(trainer.publisher, engine, WeightSyncConfig(), torch.float32)
    trainer.set_optimizer(1e-2)
    batch = batch_of(tokenizer)
    trainer.sft_step(batch, 4)
    before = logits(engine.model, batch)
    metrics = sync.push()
    state = lora.merged.state_dict()
    assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in state.values()
                                        if t.data_ptr() != state["lm_head.weight"].data_ptr()
                                        ) + state["lm_head.weight"].numel() * 4
    assert metrics["sync/parity_max_abs"] < 1e-5
    assert engine.version == trainer.version == 1
    after = logits(engine.model, batch)
    want = logits(lora.policy, batch)
    assert (before - want).abs().max() > 1e-4  # the step changed the policy
    assert torch.allclose(after, want, atol=1e-5)


def test_the_adapter_saves_and_loads(calc_model_dir, tokenizer, tmp_path):
    lora = lora_of(calc_model_dir)
    trainer = LoraTrainer(lora)
    trainer.set_optimizer(1e-2)
    batch = batch_of(tokenizer)
    trainer.sft_step(batch, 4)
    lora.save(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    again = lora_of(calc_model_dir)
    assert not torch.allclose(logits(again.merged, batch), logits(lora.merged, batch))
    again.load(tmp_path / "adapter")
    assert torch.allclose(logits(again.policy, batch), logits(lora.policy, batch), atol=1e-6)
    assert torch.allclose(logits(again.merged, batch), logits(lora.merged, batch), atol=1e-6)
    # peft's own loader reads it too
    from peft import PeftModel
    peft_model = PeftModel.from_pretrained(load_model(calc_model_dir), tmp_path / "adapter")
    assert torch.allclose(logits(peft_model, batch), logits(lora.policy, batch), atol=1e-6)
    other = Lora(load_model(calc_model_dir), LoRAConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match=r"r=4, alpha=8.0; model.lora has r=2"):
        other.load(tmp_path / "adapter")


def test_config_refusals_are_one_line(calc_model_dir, monkeypatch):
    with pytest.raises(ConfigError, match=r"^config field model.lora.target_modules: got "
                                          r"\['nope'\]; no layer"):
        Lora(load_model(calc_model_dir), LoRAConfig(target_modules=["nope"]))
    # trainer ranks train adapters too (tests/test_distributed_lora.py)
    assert load_config("configs/calculator.yaml", ["model.lora.r=4", "train.world_size=2"]
                       ).train.world_size == 2
    with pytest.raises(ConfigError, match=r"^config field model.lora.dropout: got 0.1"):
        load_config("configs/calculator.yaml", ["model.lora.dropout=0.1"])
    monkeypatch.setitem(sys.modules, "peft", None)  # as if the lora extra were not installed
    with pytest.raises(ConfigError, match=r"^config field model.lora needs the 'peft' package"
                                          r", which is not installed: pip install "
                                          r"'tiller\[lora\]'"):
        lora_of(calc_model_dir)


@pytest.mark.slow
def test_a_lora_run_checkpoints_the_adapter_and_resumes_exactly(tmp_path):
    """SFT then RL with the KL term under model.lora: every checkpoint holds the adapter and
    the reference adapter (no copy of the base), the final folder's merged weights are base +
    the saved adapter, the reference is the post-SFT policy (KL 0 at the first RL step), and a
    resume from step 1 of 3 (the reference read back, not re-frozen) ends where the whole run
    did."""
    from safetensors.torch import load_file
    from test_resume import RUN, comparable, weights

    from tiller.controller import train

    over = [*RUN, "rl.steps=3", "checkpoint.keep=5", "rl.algorithm.kl.beta=0.05",
            "rl.algorithm.entropy_coef=0.01", "model.lora.r=4", "model.lora.alpha=8"]
    whole = tmp_path / "whole"
    summary = train(load_config("configs/calculator.yaml", over), whole)
    step1 = whole / "checkpoints" / "step-000001"
    assert (step1 / "adapter" / "adapter_model.safetensors").is_file()
    assert (step1 / "adapter" / "reference" / "adapter_model.safetensors").is_file()
    assert "adapter/reference" in json.loads((step1 / "state.json").read_text())["holds"]
    assert "ref" not in torch.load(step1 / "trainer.pt", weights_only=True)
    final = whole / "checkpoints" / "final"
    lora = Lora(load_model(whole / "base_model"), LoRAConfig(r=4, alpha=8.0))
    lora.load(final / "adapter")
    merged = lora.merged.state_dict()
    saved = load_file(final / "model.safetensors")
    assert all(torch.allclose(merged[k], saved[k], atol=1e-7) for k in saved)
    assert not torch.equal(saved["model.layers.0.self_attn.q_proj.weight"],
                           load_model(whole / "base_model").state_dict()[
                               "model.layers.0.self_attn.q_proj.weight"])
    assert summary["rl"]["ledger"]["trained"] > 0
    # the reference is the policy at RL start (after SFT): KL 0 at the first step, then > 0
    kl = [json.loads(line)["kl"] for line in (whole / "metrics.jsonl").open()
          if '"phase": "rl"' in line and '"kl"' in line]
    assert len(kl) == 3 and kl[0] == pytest.approx(0.0, abs=1e-7) and kl[1] > 0 and kl[2] > 0
    run = tmp_path / "run"
    shutil.copytree(whole, run)
    for step in (2, 3):
        shutil.rmtree(run / "checkpoints" / f"step-00000{step}")
    train(load_config("configs/calculator.yaml", over), resume=run)
    a, b = weights(whole), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert comparable(run) == comparable(whole)


def test_keep_with_adapter_dropout_has_dropout_to_keep(calc_model_dir, tmp_path):
    """model.dropout=keep on the built Qwen3 (no dropout of its own) is refused, but not with
    model.lora.dropout > 0: the adapters' dropout is there to keep."""
    from tiller.run import Run

    cfg = load_config("configs/calculator.yaml", [
        f"model.path={calc_model_dir}", "model.build=null", "model.dropout=keep",
        "model.lora.dropout=0.1", "logging.tensorboard=false"])
    run = Run(cfg, tmp_path / "run")
    try:
        rates = {m.p for n, m in run.trainer.model.named_modules()
                 if n.endswith("lora_dropout.default")}
        assert rates == {0.1}
    finally:
        run.close()


@pytest.mark.slow
def test_a_resume_onto_another_base_model_is_refused_in_one_line(calc_model_dir, calc_sft_dir,
                                                                 tmp_path):
    """Under model.lora a checkpoint holds the adapter, not the base: the base at model.path
    (the same path) replaced by another model of the same shape, or its tokenizer edited, is
    refused in one line naming model.path, the run folder left as it was."""
    from helpers import tiny_rl
    from test_resume import refused

    from tiller.controller import train

    base, run = tmp_path / "base", tmp_path / "run"
    shutil.copytree(calc_sft_dir, base)
    train(load_config("configs/calculator.yaml", tiny_rl(
        base, "model.lora.r=4", "model.lora.alpha=8", "checkpoint.every=1", "eval.tasks=2")),
        run)
    weights = (base / "model.safetensors").read_bytes()
    shutil.copy(calc_model_dir / "model.safetensors", base / "model.safetensors")
    assert (base / "model.safetensors").stat().st_size == len(weights)  # same shape
    line = f"--resume: the model at config field model.path ({base}) is not the one checkpoint"
    refused(run, [], line)
    (base / "model.safetensors").write_bytes(weights)
    tokenizer = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "padding_side": "left"}))
    refused(run, [], line)


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_tied_embeddings_as_targets_are_refused(target):
    from test_trainer_memory import tiny_llama

    with pytest.raises(ConfigError, match=rf"^config field model.lora.target_modules: got "
                                          rf"\['q_proj', '{target}'\]; {target} is a tied "
                                          r"embedding of LlamaForCausalLM \(input and output "
                                          r"share one weight\): leave it out$"):
        Lora(tiny_llama(), LoRAConfig(target_modules=["q_proj", target]))
