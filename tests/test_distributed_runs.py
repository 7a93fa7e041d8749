"""Whole runs on 2 trainer ranks (`train.world_size=2`) with what each rank now holds besides
the policy: PPO's critic and the KL reference model, and model.lora's adapters with the
reference adapter. (A module of its own: each run makes the process's one process group, so no
module-scoped group may be open.)"""

import json

import pytest
from helpers import TINY_RUN, saved_model

from tiller.config import load_config
from tiller.controller import train


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("more, keys", [
    (["rl.algorithm.preset=ppo", "rl.algorithm.advantage=gae"],
     ("kl", "value_loss", "value_grad_norm")),
    (["model.lora.r=4", "model.lora.alpha=8", "rl.algorithm.kl.beta=0.05",
      "rl.algorithm.kl.placement=loss", "rl.algorithm.kl.estimator=k3"], ("kl",)),
], ids=["ppo", "lora-kl"])
def test_a_run_trains_on_two_ranks_with_its_reference_and_critic(calc_model_dir, tmp_path,
                                                                 more, keys):
    cfg = load_config("configs/calculator.yaml", [
        *TINY_RUN, *saved_model(calc_model_dir), "eval.tasks=4", "train.world_size=2", *more])
    summary = train(cfg, tmp_path)
    assert summary["rl"]["ledger"]["trained"] == 32  # 2 steps of 4 tasks x 4 samples
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    rl = [r for r in rows if r["phase"] == "rl" and "loss" in r]
    assert len(rl) == 2 and all(key in r for r in rl for key in keys)
    synced = [r for r in rows if "sync/parity_max_abs" in r]
    assert synced and max(r["sync/parity_max_abs"] for r in synced) < 1e-4
