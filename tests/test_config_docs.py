"""Every config key is documented where it is declared, and docs/config.md (generated from the
models by tiller.config.reference) is current."""

from pathlib import Path

from tiller.config import (
    AsyncRLConfig,
    EvalSetConfig,
    FilterCurriculumConfig,
    HttpEngineConfig,
    ModelJudgeConfig,
    RewardConfig,
)
from tiller.config.reference import COMMAND, render, sections
from tiller.tools.executor import ToolPolicy

ROOT = Path(__file__).parent.parent


def test_the_walk_reaches_every_section_and_variant():
    models = {t.model for t in sections()}
    assert {AsyncRLConfig, HttpEngineConfig, FilterCurriculumConfig, ModelJudgeConfig,
            ToolPolicy, EvalSetConfig, RewardConfig} <= models
    keys = [f"{t.path}.{n}" for t in sections() for n, _ in t.fields]
    assert "rl.max_staleness" in keys and "env.tools.executor.tools.<name>.retries" in keys
    assert "rewards[].verifier" in keys and "rl.algorithm.kl.beta" in keys


def test_every_config_field_has_a_description():
    missing = sorted({f"{t.model.__module__}.{t.model.__name__}.{name}"
                      for t in sections() for name, f in t.model.model_fields.items()
                      if not (f.description or "").strip()})
    assert missing == [], f"config fields without Field(description=...): {missing}"


def test_the_reference_shows_type_default_range_and_description():
    text = render()
    assert ("| `rl.group_size` | int | `8` | >= 1 | episodes sampled per task (G); group "
            "baselines") in text
    assert "| `rl.max_staleness` | int or null | `null` | >= 0 |" in text
    assert ('| `engine.backend` | choice | `"http"` | "http" |' in text
            and "## `engine`, with engine.backend: http" in text)
    assert '| `sampling.top_p` | float | `1.0` | > 0.0 and <= 1.0 |' in text


def test_docs_config_md_is_current():
    on_disk = (ROOT / "docs" / "config.md").read_text()
    assert on_disk == render(), f"docs/config.md is out of date: regenerate it with `{COMMAND}`"
