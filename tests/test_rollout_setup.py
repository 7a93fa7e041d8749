"""End of turn and start-up checks: what would fail in every episode fails once, as one line."""

import asyncio
import copy
import shutil

import pytest
from helpers import cli, saved_model
from transformers import GenerationConfig

from tiller.config import ConfigError, load_config
from tiller.envs import ENVS
from tiller.models import load_tokenizer
from tiller.rollout.agent_loop import ExpertActor, check_rollout_setup, run_episode
from tiller.rollout.chat import CHAT_TEMPLATE, stop_token_ids
from tiller.rollout.trajectory import Status
from tiller.run import Run

Calc = ENVS["calculator"]
CONFIG = "configs/calculator.yaml"
NOT_PREFIX_STABLE = "{{- messages | length }}" + CHAT_TEMPLATE  # the header counts messages
NO_END_OF_TURN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def with_eos(tokenizer, eos):
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = eos
    return tok


def model_dir(calc_model_dir, tmp_path, *, eos=None, template=None, gen_eos=None):
    """A copy of the tiny model with its tokenizer's eos, chat template or generation
    config's eos ids changed."""
    out = tmp_path / "model"
    shutil.copytree(calc_model_dir, out)
    tok = load_tokenizer(out)
    if eos is not None:
        tok.eos_token = eos
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(out)
    if gen_eos is not None:
        GenerationConfig(eos_token_id=gen_eos).save_pretrained(out)
    return out


def run_config(path, *overrides):
    return load_config(CONFIG, [*saved_model(path), *overrides])


def test_stop_tokens_are_end_of_turn_and_every_generation_config_eos(tokenizer):
    tok = with_eos(tokenizer, "<|endoftext|>")  # eos ends a document here, not a turn
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert stop_token_ids(tok) == (im_end,)
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=endoftext)) == (im_end, endoftext)
    gen = GenerationConfig(eos_token_id=[endoftext, im_end, 7])
    assert stop_token_ids(tok, gen) == (im_end, endoftext, 7)


def test_an_episode_ends_turns_on_the_templates_end_of_turn_not_eos(tokenizer, limits):
    tok = with_eos(tokenizer, "<|endoftext|>")
    task = next(t for t in Calc.make_tasks("train", 50, 3, 2) if t.metadata["problem"].steps)
    traj = asyncio.run(run_episode(Calc(), task, ExpertActor(Calc, task, tok), tok, seed=0,
                                   limits=limits))
    assert traj.status is Status.COMPLETED and traj.reward.value == 1.0 and traj.num_turns == 3
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert [traj.token_ids[end - 1] for _, end in traj.turn_spans] == [im_end] * 3


def test_run_samples_until_end_of_turn_when_eos_differs(calc_model_dir, tmp_path):
    path = model_dir(calc_model_dir, tmp_path, eos="<|endoftext|>", gen_eos=[0, 7])
    run = Run(run_config(path), tmp_path / "run")
    im_end = run.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert run.tokenizer.eos_token == "<|endoftext|>"
    assert run.sampling(1.0).stop_token_ids == (im_end, 0, 7)
    run.close()


def test_a_template_without_end_of_turn_token_stops_the_run_at_start_up(calc_model_dir,
                                                                          tmp_path):
    path = model_dir(calc_model_dir, tmp_path, template=NO_END_OF_TURN)
    with pytest.raises(ConfigError) as err:
        Run(run_config(path), tmp_path / "run")
    assert ("cannot determine the chat template's end-of-turn token: after an assistant "
            "message it renders '\\n', not a special token") in str(err.value)
    assert "\n" not in str(err.value)


def test_a_template_that_is_not_prefix_stable_runs_exactly(tokenizer, limits):
    """The header counts messages, so every render changes the first line: the bridge still
    appends exactly what the template renders after the turn just generated."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = NOT_PREFIX_STABLE
    task = next(t for t in Calc.make_tasks("train", 50, 3, 2) if t.metadata["problem"].steps)
    traj = asyncio.run(run_episode(Calc(), task, ExpertActor(Calc, task, tok), tok, seed=0,
                                   limits=limits))
    assert traj.status is Status.COMPLETED and traj.reward.value == 1.0 and traj.num_turns == 3
    full = tok.apply_chat_template(list(traj.messages), tools=Calc().tool_schemas(),
                                   tokenize=False)
    stream = tok.decode(list(traj.token_ids))
    assert stream.startswith("2") and full.startswith(str(len(traj.messages)))  # 2, 7 messages
    assert stream[1:] + "\n" == full[1:]  # everything else is the template's text


def test_episode_budget_above_the_context_is_one_cli_line(calc_model_dir, tmp_path):
    code, out = cli("train", CONFIG, f"model.path={calc_model_dir}", "model.build=null",
                    "env.max_episode_tokens=4096", "--output-dir", tmp_path / "r")
    assert code == 2 and "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == ["error: config field env.max_episode_tokens: got 4096; expected at most "
                     "the model's context length (max_position_embeddings=2048)"]


PLAIN_TOOLS = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_of_no_known_tool_format_is_warned_about(tokenizer, limits, caplog):
    """auto falls back to the Hermes parser; a template that does not teach <tool_call> says so
    at start-up instead of parsing every tool call as a plain answer in silence."""
    from transformers import PretrainedConfig

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = PLAIN_TOOLS
    with caplog.at_level("WARNING", logger="tiller.rollout.agent_loop"):
        check_rollout_setup(tok, PretrainedConfig(), limits)
    assert "holds no marker of a tool-call format tiller parses" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tiller.rollout.agent_loop"):
        check_rollout_setup(tokenizer, PretrainedConfig(), limits)  # tiller's own template
    assert "tool-call format" not in caplog.text
