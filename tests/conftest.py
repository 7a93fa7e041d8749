"""Shared fixtures: one tiny HF model built (not downloaded) for the whole session."""

from __future__ import annotations

import pytest
import torch

from tiller.agent_loop import EpisodeLimits
from tiller.config import BuildConfig
from tiller.controller import build_env_model
from tiller.envs import ENVS
from tiller.models import load_model, load_tokenizer


@pytest.fixture(scope="session")
def calc_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "calc"
    build = BuildConfig(vocab_size=600, hidden_size=64, num_layers=2, num_heads=4,
                        corpus_tasks=60)
    return build_env_model(ENVS["calculator"], out, build, seed=0, difficulty=2, max_turns=6)


@pytest.fixture(scope="session")
def tokenizer(calc_model_dir):
    return load_tokenizer(calc_model_dir)


@pytest.fixture()
def model(calc_model_dir):
    torch.manual_seed(0)
    return load_model(calc_model_dir)


@pytest.fixture()
def limits():
    return EpisodeLimits(max_turns=6, max_episode_tokens=512)
