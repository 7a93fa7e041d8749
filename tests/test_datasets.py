"""The dataset env: a user's JSONL / Parquet / datasets file of prompts as tasks, rewards from
library verifiers and TRL-style functions (weighted, gated, logged per check), SFT from a
conversations file, every malformed row one line naming file, row and column, and `tiller
train` end to end on it."""

from __future__ import annotations

import asyncio
import json
import textwrap
from pathlib import Path

import pytest
from helpers import cli, rl_rows
from typer.testing import CliRunner

from tiller.cli import app
from tiller.config import Config
from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Task
from tiller.envs.dataset import DatasetEnv
from tiller.envs.rewards import RewardEntry, combine
from tiller.envs.rows import read_rows
from tiller.errors import ConfigError
from tiller.preflight import check_sft_source
from tiller.rollout.chat import ChatFormat
from tiller.train.conversations import assistant_text, conversation_trajectory

ROWS = [{"prompt": "What is 2 + 3?", "answer": 5, "level": "easy"},
        {"prompt": "What is 9 + 9?", "answer": 18, "level": "hard"},
        {"prompt": "What is 2 + 3?", "answer": 5, "level": "easy"}]  # a repeated prompt

# A package outside tiller: TRL-signature reward functions that record every call.
REWARD_MODULE = '''
import json, os

def _log(name, prompts, completions, kwargs):
    with open(os.environ["USER_REWARDS_LOG"], "a") as f:
        f.write(json.dumps({"fn": name, "prompts": prompts, "completions": completions,
                            "columns": kwargs}) + "\\n")

def correct(prompts, completions, answer, **kwargs):
    _log("correct", prompts, completions, {"answer": answer, **kwargs})
    text = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(t.strip() == str(a)) for t, a in zip(text, answer)]

def length(prompts, completions, **kwargs):
    _log("length", prompts, completions, kwargs)
    return [min(1.0, len(c if isinstance(c, str) else c[-1]["content"]) / 10)
            for c in completions]

def not_applicable(prompts, completions, **kwargs):
    return [None for _ in completions]

def broken(prompts, completions, **kwargs):
    raise KeyError("no such column")

def wrong_length(prompts, completions, **kwargs):
    return [1.0, 1.0]

def judge(prompts, completions, **kwargs):
    return [1.0 for _ in completions]

def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''


@pytest.fixture()
def user_pkg(tmp_path, monkeypatch):
    """The reward module on sys.path; its calls go to the returned log file."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "user_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(pkg))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("USER_REWARDS_LOG", str(log))
    return log


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_answers(path: Path, rows: list) -> Path:
    """SFT conversations that answer each row's prompt with its answer."""
    return write_jsonl(path, [{"messages": [
        {"role": "user", "content": r["prompt"]},
        {"role": "assistant", "content": str(r["answer"])}]} for r in rows])


def dataset_config(train: Path, rewards: list | None = None, **data) -> Config:
    return Config.model_validate({
        "model": {"build": {}}, "env": {"name": "dataset"}, "sft": {"enabled": False},
        "data": {"train": str(train), **data},
        "rewards": rewards or [{"function": "user_rewards:correct"}]})


def test_jsonl_parquet_and_datasets_files_read_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "rows_hf"))
    arrow = next((tmp_path / "rows_hf").glob("*.arrow"))
    want = [(i + 1, r) for i, r in enumerate(ROWS)]
    for name in ("rows.jsonl", "rows.parquet", "rows_hf", arrow.relative_to(tmp_path)):
        assert read_rows(tmp_path / name, "data.train") == want, name


def test_every_row_is_its_own_task_and_passes_visit_every_row(tmp_path, user_pkg):
    env = DatasetEnv.configure(dataset_config(write_jsonl(tmp_path / "t.jsonl", ROWS)))
    assert [t.id for t in env.source.train] == ["t.jsonl:1", "t.jsonl:2", "t.jsonl:3"]
    drawn = env.make_tasks("train", 7, seed=3, difficulty=1)
    assert len({t.id for t in drawn}) == 7  # repeated prompts and later passes: distinct ids
    for start in (0, 3):  # each full pass holds every row once
        assert sorted(t.id.split("#")[0] for t in drawn[start:start + 3]) == \
            ["t.jsonl:1", "t.jsonl:2", "t.jsonl:3"]
    assert all(t.id.endswith("#1") for t in drawn[3:6]) and drawn[6].id.endswith("#2")
    assert env.make_tasks("train", 7, 3, 1) == drawn  # seeded
    assert env.make_tasks("heldout", 5, 0, 1) == [] and env.task_space("heldout", 1) == 0


@pytest.mark.parametrize("rows, data, rewards, column, row", [
    ([{"answer": 1}], {}, None, "prompt", 1),  # missing column
    ([ROWS[0], {"prompt": 7, "answer": 1}], {}, None, "prompt", 2),  # wrong type
    ([{"prompt": "p"}], {}, [{"verifier": "exact_match"}], "answer", 1),
    ([{"prompt": "p", "answer": "seven"}], {}, [{"verifier": "numeric_match"}], "answer", 1),
    ([{"prompt": "p", "answer": {"a": 1}}], {}, [{"verifier": "exact_match"}], "answer", 1),
    ([{"prompt": "p", "tools": "user_rewards:add"}], {}, None, "tools", 1),
    ([ROWS[0], ROWS[1], {"prompt": "p", "tools": ["user_rewards:nope"]}], {}, None, "tools", 3),
    ([{"prompt": "p", "messages": "hi"}], {"messages_column": "messages"}, None, "messages", 1),
    ([{"messages": [{"role": "user", "content": 3}]}], {"messages_column": "messages"}, None,
     "messages", 1),
    ([{"prompt": "p"}], {"metadata_columns": ["level"]}, None, "level", 1),
    ([{"prompt": "p", "completions": "x"}], {}, None, "completions", 1),  # a TRL keyword
])
def test_a_malformed_row_is_one_line_naming_file_row_and_column(tmp_path, user_pkg, rows, data,
                                                                rewards, column, row):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError) as e:
        DatasetEnv.configure(dataset_config(path, rewards, **data))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path} row {row}, column {column!r}: "), msg


def test_invalid_json_and_unknown_format_are_one_line(tmp_path, user_pkg):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{oops\n")
    with pytest.raises(ConfigError, match=rf"^{path} row 3: not valid JSON"):
        DatasetEnv.configure(dataset_config(path))
    (tmp_path / "t.csv").write_text("prompt\n")
    with pytest.raises(ConfigError, match=r"^config field data.train: .*expected a .jsonl"):
        DatasetEnv.configure(dataset_config(tmp_path / "t.csv"))


@pytest.mark.parametrize("data, words", [
    ({"env": {"name": "dataset"}, "rewards": [{"verifier": "exact_match"}]}, ["data.train"]),
    ({"env": {"name": "dataset"}, "data": {"train": "x.jsonl"}}, ["rewards", "at least one"]),
    ({"rewards": [{"verifier": "exact_match"}]}, ["rewards", "only used with env.name"]),
    ({"data": {"train": "x.jsonl"}}, ["data.train", "only used with env.name"]),
    ({"env": {"name": "dataset"}, "data": {"train": "x"}, "rewards": [{"verifier": "nope"}]},
     ["rewards.0", "expected one of", "exact_match"]),
    ({"env": {"name": "dataset"}, "data": {"train": "x"},
      "rewards": [{"verifier": "exact_match", "function": "a:b"}]}, ["exactly one"]),
    ({"data": {"sft": "c.jsonl"}, "sft": {"tasks": 10}}, ["sft.tasks", "data.sft"]),
    ({"data": {"sft": "c.jsonl"}, "sft": {"difficulty": 1}}, ["sft.difficulty", "data.sft"]),
])
def test_data_and_rewards_config_errors_name_the_field(data, words):
    from tiller.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{k}={json.dumps(v)}" for k, v in {"model": {"build": {}},
                                                               **data}.items()])
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("judge", [None, {"fn": "tiller.train.judges:grounded_answer"}])
@pytest.mark.parametrize("rewards, index", [
    ([{"function": "user_rewards:judge"}], 0),  # the function's own name
    ([{"verifier": "exact_match"}, {"function": "user_rewards:length", "name": "judge"}], 1),
    ([{"verifier": "exact_match", "name": "judge"}], 0),
])
def test_a_reward_entry_named_judge_is_refused(tmp_path, user_pkg, rewards, index, judge):
    """`judge` is the check rl.judge's score is recorded and paid under: a reward entry of
    that name would be paid as the judge with a judge, and shown as one without."""
    cfg = dataset_config(write_jsonl(tmp_path / "t.jsonl", ROWS), rewards)
    if judge is not None:
        cfg = Config.model_validate({**cfg.model_dump(), "rl": {"judge": judge}})
    with pytest.raises(ConfigError) as e:
        DatasetEnv.configure(cfg)
    assert str(e.value) == (f"config field rewards[{index}]: named 'judge', a name reserved "
                            "for rl.judge's score; give the entry another `name`")


def test_a_reward_function_named_judge_is_one_cli_line(tmp_path, user_pkg):
    config = tmp_path / "run.yaml"
    config.write_text(textwrap.dedent(f"""\
        model: {{build: {{}}}}
        env: {{name: dataset}}
        data: {{train: {write_jsonl(tmp_path / "t.jsonl", ROWS)}}}
        rewards: [{{function: "user_rewards:judge"}}]
    """))
    code, out = cli("train", config, "-o", tmp_path / "run")
    assert code == 2 and out.strip().splitlines() == [
        "error: config field rewards[0]: named 'judge', a name reserved for rl.judge's score; "
        "give the entry another `name`"], out


def test_sft_without_expert_or_conversations_is_a_config_error_only_when_enabled(tmp_path):
    cfg = dataset_config(write_jsonl(tmp_path / "t.jsonl", ROWS))
    check_sft_source(cfg, DatasetEnv)  # sft disabled: fine
    cfg.sft.enabled = True
    with pytest.raises(ConfigError, match="^config field sft.enabled: env dataset has no "
                                          "scripted expert.*data.sft"):
        check_sft_source(cfg, DatasetEnv)


def test_weighted_and_gated_rewards_hand_computed():
    entries = [RewardEntry("correct", 1.0, False), RewardEntry("short", 0.5, False),
               RewardEntry("format", 0.0, True), RewardEntry("extra", 2.0, False)]
    r = combine(entries, [1.0, 0.4, 1.0, None])  # None: not applicable, left out
    assert r.value == pytest.approx(1.0 + 0.5 * 0.4)
    assert r.checks == {"correct": 1.0, "short": 0.4, "format": 1.0}
    assert combine(entries, [1.0, 0.4, 0.9, 1.0]).value == 0.0  # the gate fails below 1
    assert combine(entries, [0.0, 1.0, None, 0.25]).value == pytest.approx(0.5 + 2 * 0.25)


def run_turns(env_cls, task: Task, turns: list[ParsedTurn]):
    async def go():
        env = env_cls()
        await env.reset(task, 0)
        for t in turns:
            result = await env.step(t)
            if result.done:
                break
        return await env.verify(t), env

    return asyncio.run(go())


def test_reward_functions_get_trl_arguments_single_and_multi_turn(tmp_path, user_pkg):
    rows = [ROWS[0], {**ROWS[1], "tools": ["user_rewards:add"]}]
    rewards = [{"function": "user_rewards:correct"},
               {"function": "user_rewards:length", "weight": 0.5, "name": "len"},
               {"verifier": "numeric_match", "extract": "text", "gate": True, "weight": 0.0},
               {"function": "user_rewards:not_applicable"}]
    env_cls = DatasetEnv.configure(dataset_config(write_jsonl(tmp_path / "t.jsonl", rows),
                                                  rewards, system="Be brief."))
    single, multi = env_cls.source.train
    reward, _ = run_turns(env_cls, single, [ParsedTurn("5")])
    assert reward.value == pytest.approx(1.0 + 0.5 * 0.1)
    assert reward.checks == {"correct": 1.0, "len": 0.1, "numeric_match": 1.0}
    call = json.loads(user_pkg.read_text().splitlines()[0])  # standard format: strings
    assert call == {"fn": "correct", "prompts": ["What is 2 + 3?"], "completions": ["5"],
                    "columns": {"answer": [5], "level": ["easy"]}}

    from tiller.tools.registry import ToolCall

    calls = [ParsedTurn("", [ToolCall("add", {"a": 9, "b": 9})]), ParsedTurn("18")]
    reward, env = run_turns(env_cls, multi, calls)
    assert reward.value == pytest.approx(1.0 + 0.5 * 0.2) and env.tool_schemas()
    call = json.loads(user_pkg.read_text().splitlines()[2])  # conversational: messages
    assert call["prompts"] == [[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is 9 + 9?"}]]
    assert call["completions"] == [[
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 9, "b": 9}}}]},
        {"role": "tool", "name": "add", "content": "18"},
        {"role": "assistant", "content": "18"}]]
    assert call["columns"] == {"answer": [18], "level": ["hard"], "tools": [["user_rewards:add"]]}
    # a wrong guess fails the gate, so the other entries' credit is 0 too
    reward, _ = run_turns(env_cls, single, [ParsedTurn("five")])
    assert reward.value == 0.0 and reward.checks["len"] == pytest.approx(0.4)


def test_a_raising_reward_function_is_an_env_error_and_a_bad_result_stops_the_run(
        tmp_path, user_pkg):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS[:1])
    env_cls = DatasetEnv.configure(dataset_config(path, [{"function": "user_rewards:broken"}]))
    reward, _ = run_turns(env_cls, env_cls.source.train[0], [ParsedTurn("5")])
    assert reward.env_error and "user_rewards:broken: KeyError" in reward.error
    env_cls = DatasetEnv.configure(dataset_config(path, [{"function":
                                                          "user_rewards:wrong_length"}]))
    with pytest.raises(ConfigError, match="user_rewards:wrong_length: expected a list with one "
                                          "value per completion"):
        run_turns(env_cls, env_cls.source.train[0], [ParsedTurn("5")])
    with pytest.raises(ConfigError, match=r"^config field rewards\[0\].function: got "
                                          "'user_rewards:missing'; cannot import"):
        DatasetEnv.configure(dataset_config(path, [{"function": "user_rewards:missing"}]))


def test_sft_conversation_mask_is_exactly_the_assistant_tokens(tokenizer, user_pkg):
    from tiller.envs.dataset import resolve_tools

    schemas = [t.schema for t in resolve_tools(["user_rewards:add"], "test")]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "add", "content": "5"},
                {"role": "assistant", "content": "The answer is 5."}]
    traj = conversation_trajectory(messages, schemas, tokenizer, "sft:1")
    chat = ChatFormat(tokenizer, schemas)
    eot = chat.end_of_turn_id
    texts = [assistant_text(chat, messages[:i], messages[i]) for i in (2, 4)]
    assert texts[1] == "The answer is 5." and "<tool_call>" in texts[0]
    masked = [i for i, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    assert masked == [*tokenizer.encode(texts[0], add_special_tokens=False), eot,
                      *tokenizer.encode(texts[1], add_special_tokens=False), eot]
    assert [traj.loss_mask[s:e] for s, e in traj.turn_spans] == \
        [(1,) * (e - s) for s, e in traj.turn_spans] and len(traj.turn_spans) == 2
    # the whole trajectory is the template's rendering of the conversation, up to the last
    # end-of-turn token: nothing is lost between the pieces
    full = chat.render(messages, False)
    assert tokenizer.decode(traj.token_ids) == full[: full.rfind(chat.end_of_turn)
                                                    + len(chat.end_of_turn)]
    assert traj.prompt_len == len(chat.prompt_ids(messages[:2]))


@pytest.mark.slow
def test_tiller_train_on_a_user_jsonl_with_dotted_path_rewards(tmp_path, user_pkg):
    """`tiller train` end to end: a tiny model built on the dataset's text, SFT from a
    conversations file, RL with the user's reward functions, held-out eval on data.eval."""
    pairs = [(a, b) for a in range(1, 7) for b in range(1, 5)]
    rows = [{"prompt": f"What is {a} + {b}?", "answer": a + b, "level": a % 2}
            for a, b in pairs]
    train = write_jsonl(tmp_path / "train.jsonl", rows[:16])
    evals = write_jsonl(tmp_path / "eval.jsonl", rows[16:20])
    sft = write_answers(tmp_path / "sft.jsonl", rows)
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""
        model: {{build: {{vocab_size: 400, hidden_size: 64, num_layers: 1, num_heads: 2,
                         corpus_tasks: 16}}}}
        env: {{name: dataset, max_turns: 2, max_episode_tokens: 128}}
        data: {{train: {train}, eval: {evals}, sft: {sft}}}
        rewards:
          - function: user_rewards:correct
          - {{function: user_rewards:length, weight: 0.5}}
        sampling: {{max_new_tokens: 8}}
        sft: {{epochs: 8, batch_size: 8, warmup_steps: 2}}
        rl: {{steps: 2, tasks_per_step: 4, group_size: 2}}
        eval: {{tasks: 4}}
        logging: {{progress: false, tensorboard: false}}
    """))
    result = CliRunner().invoke(app, ["train", str(config), "-o", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sft"]["demonstrations"] == len(rows)
    assert summary["heldout_after_rl"]["tasks"] == 4
    calls = [json.loads(line) for line in user_pkg.read_text().splitlines()]
    by_prompt = {r["prompt"]: r for r in rows}
    assert calls, "the reward functions were never called"
    for c in calls:  # each call: one row's prompt, a string completion, the row's columns
        row = by_prompt[c["prompts"][0]]
        assert len(c["prompts"]) == len(c["completions"]) == 1
        assert isinstance(c["completions"][0], str)
        assert c["columns"] == {"answer": [row["answer"]], "level": [row["level"]]}
    trained = {c["prompts"][0] for c in calls}
    assert trained <= {r["prompt"] for r in rows[:20]}
    steps = rl_rows(tmp_path / "run")
    assert len(steps) == 2
    for m in steps:  # per-check values beside the total
        assert 0.0 <= m["check/correct"] <= 1.0 and 0.0 <= m["check/length"] <= 1.0
        assert m["reward_mean"] == pytest.approx(
            m["check/correct"] + 0.5 * m["check/length"], abs=1e-9)


def test_a_messages_prompt_is_conversational(tmp_path, user_pkg):
    opening = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2 + 3?"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"chat": opening, "answer": 5}])
    env_cls = DatasetEnv.configure(dataset_config(path, messages_column="chat"))
    reward, env = run_turns(env_cls, env_cls.source.train[0], [ParsedTurn("5")])
    call = json.loads(user_pkg.read_text().splitlines()[0])
    assert reward.value == 1.0 and not env.tool_schemas()  # no tools: single-turn
    assert call["prompts"] == [opening]
    assert call["completions"] == [[{"role": "assistant", "content": "5"}]]
    assert call["columns"] == {"answer": [5]}


def test_the_built_tokenizer_learns_from_the_rows_and_conversations(tmp_path, user_pkg):
    from tiller.models import train_tokenizer

    rows = [{**ROWS[0], "tools": ["user_rewards:add"]}, ROWS[1]]
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Vermilion."}]}])
    env_cls = DatasetEnv.configure(dataset_config(write_jsonl(tmp_path / "t.jsonl", rows),
                                                  sft=str(sft)))
    corpus = env_cls.tokenizer_corpus(env_cls.make_tasks("train", 2, 1, 1),
                                      train_tokenizer([], 0))
    assert len(corpus) == 3
    with_tool = next(t for t in corpus if "2 + 3" in t)
    assert '"name": "add"' in with_tool and "<|im_start|>assistant\n5<|im_end|>" in with_tool
    assert "Vermilion." in corpus[2]


def test_sft_conversation_is_the_trajectory_the_agent_loop_builds(tmp_path, tokenizer,
                                                                 user_pkg):
    """A dataset row with a tool, played through the real agent loop by an actor writing the
    conversation's assistant turns: the loop's tokens and mask are the SFT trajectory's."""
    from helpers import TextActor

    from tiller.envs.dataset import resolve_tools
    from tiller.rollout.agent_loop import run_episode

    row = {"prompt": "What is 2 + 3?", "answer": 5, "tools": ["user_rewards:add"]}
    env_cls = DatasetEnv.configure(dataset_config(write_jsonl(tmp_path / "t.jsonl", [row]),
                                                  system="Use the tools."))
    schemas = [t.schema for t in resolve_tools(row["tools"], "test")]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    conversation = [{"role": "system", "content": "Use the tools."},
                    {"role": "user", "content": "What is 2 + 3?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "add", "content": "5"},
                    {"role": "assistant", "content": "5"}]
    chat = ChatFormat(tokenizer, schemas)
    texts = [assistant_text(chat, conversation[:i], conversation[i]) for i in (2, 4)]
    played = asyncio.run(run_episode(env_cls(), env_cls.source.train[0],
                                     TextActor(tokenizer, texts), tokenizer, seed=0))
    assert played.status.value == "completed" and played.tool_calls == 1
    assert played.reward.value == 1.0  # correct: "5" == str(5)
    assert list(played.messages) == conversation
    demo = conversation_trajectory(conversation, schemas, tokenizer, "sft:1")
    assert demo.token_ids == played.token_ids and demo.loss_mask == played.loss_mask
    assert demo.turn_spans == played.turn_spans


def test_unreadable_table_files_are_one_line(tmp_path):
    import datasets

    from tiller.envs.rows import read_rows

    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"config field data.train: got '.*bad.parquet'; "
                                          r"cannot read it: ArrowInvalid"):
        read_rows(bad, "data.train")
    folder = tmp_path / "notadataset"
    folder.mkdir()
    with pytest.raises(ConfigError, match="config field data.train: got .*notadataset'; cannot "
                                          "read it: FileNotFoundError"):
        read_rows(folder, "data.train")
    splits = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a"}])}
                         ).save_to_disk(str(splits))
    with pytest.raises(ConfigError, match=r"holds the splits \['train'\]: name one split's "):
        read_rows(splits, "data.train")
    assert read_rows(splits / "train", "data.train") == [(1, {"prompt": "a"})]


PLUGIN_PKG = Path(__file__).resolve().parents[1] / "examples" / "plugin_pkg"


def test_tiller_train_on_a_user_jsonl_with_dotted_path_rewards_and_env(tmp_path, user_pkg,
                                                                      monkeypatch):
    """The three together: a user's JSONL, reward functions from the user's module and an env
    from a package outside tiller (a subclass of the dataset env), all by dotted path."""
    monkeypatch.syspath_prepend(str(PLUGIN_PKG))
    rows = [{"prompt": f"What is {a} + {b}?", "answer": a + b} for a in range(1, 5)
            for b in range(1, 4)]
    train = write_jsonl(tmp_path / "train.jsonl", rows[:8])
    evals = write_jsonl(tmp_path / "eval.jsonl", rows[8:])
    sft = write_answers(tmp_path / "sft.jsonl", rows)
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""
        model: {{build: {{vocab_size: 400, hidden_size: 64, num_layers: 1, num_heads: 2,
                         corpus_tasks: 10}}}}
        env: {{name: "tiller_example_plugin.envs:BriefRowsEnv", max_turns: 2,
              max_episode_tokens: 128}}
        data: {{train: {train}, eval: {evals}, sft: {sft}}}
        rewards: [{{function: user_rewards:correct}}]
        sampling: {{max_new_tokens: 8}}
        sft: {{epochs: 8, batch_size: 8, warmup_steps: 2}}
        rl: {{steps: 1, tasks_per_step: 4, group_size: 2}}
        eval: {{tasks: 4}}
        logging: {{progress: false, tensorboard: false, report: false}}
    """))
    result = CliRunner().invoke(app, ["train", str(config), "-o", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["heldout_after_rl"]["tasks"] == 4
    assert user_pkg.read_text().strip(), "the user's reward function was never called"
    (step,) = rl_rows(tmp_path / "run")
    # the plug-in's own gate sits beside the user's reward function, per step
    assert 0.0 <= step["check/correct"] <= 1.0 and 0.0 <= step["check/brief_gate"] <= 1.0


def test_data_for_a_plugin_env_that_is_not_a_dataset_env_is_one_line(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_PKG))
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1 + 1?", "answer": 2}])
    cfg = Config.model_validate({
        "model": {"build": {}}, "env": {"name": "tiller_example_plugin.envs:PairSumEnv"},
        "data": {"train": str(train)}, "rewards": [{"verifier": "exact_match"}]})
    from tiller.preflight import check_env_data, get_env

    with pytest.raises(ConfigError, match="config field data.train: env tiller_example_plugin"
                                          ".envs:PairSumEnv is not the dataset env"):
        check_env_data(cfg, get_env(cfg.env.name))
