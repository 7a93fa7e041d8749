"""rl.judge: the shaping term is paid only where the verifier says success (hand-computed),
the shipped rubric judge scores real messages, the model judge is P(yes) / (P(yes) + P(no))
of a real HF model, a judge out of range stops the run, the hacking detector fires on a
hacking trace and not on healthy ones, and real tiny runs (with either judge) log judge/* and
train on exactly the gated reward (the traced advantages, hand-computed)."""

import json
import logging
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import tiny_rl, trained_episodes
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiller.config import ConfigError, load_config
from tiller.controller import rl
from tiller.envs.base import Task
from tiller.envs.verifiers import Reward
from tiller.errors import RunError
from tiller.observe.health import JudgeHackingTrend
from tiller.rollout.trajectory import Status, Trajectory
from tiller.run import Run
from tiller.train.judges import ModelJudge, grounded_answer
from tiller.train.shaping import JUDGE, judge_metrics, judged, train_reward

CONFIG = "configs/calculator.yaml"
TASK = Task("calc-1", "Ada has 12 bags with 3 coins in each. How many coins?", 36, "train")
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"name": "calculate", "arguments": {"expression": "12 * 3"}}]}


def episode(final_text, tool_output="36", value=None, status=Status.COMPLETED, generated=4,
            tool_errors=0):
    messages = ({"role": "user", "content": TASK.prompt}, CALL,
                {"role": "tool", "name": "calculate", "content": tool_output},
                {"role": "assistant", "content": final_text})
    if value is None:
        value = float(final_text == "The answer is 36.")
    return Trajectory(TASK.id, 0, (1,) * (generated + 1), (0,) + (1,) * generated,
                      (0.0,) * (generated + 1), 1, ((1, generated + 1),), (0,), messages,
                      Reward(value, {"correct": value}), status, tool_calls=1,
                      tool_errors=tool_errors)


def without_final_answer(t):
    return replace(t, messages=t.messages[:-1])


def algorithm(*more):
    return load_config(CONFIG, ["model.build={}", *more]).rl.algorithm


def test_the_judge_term_is_paid_only_on_verifier_success():
    alg = algorithm()
    right = judged(lambda task, t: 0.5, TASK, episode("The answer is 36."))
    wrong = judged(lambda task, t: 1.0, TASK, episode("The answer is 1203."))
    assert right.reward.checks == {"correct": 1.0, JUDGE: 0.5}
    assert right.reward.value == 1.0  # the verifier's value is untouched
    # 1 + 0.2 * 0.5 = 1.1; the wrong answer, judged 1.0, gets the verifier's 0 and nothing more
    assert train_reward(right, alg, 100, 20, 0.2) == pytest.approx(1.1)
    assert train_reward(wrong, alg, 100, 20, 0.2) == 0.0
    assert train_reward(right, alg, 100, 20, 0.0) == 1.0
    # with DAPO's soft overlong: 90 of l_max 100 generated, l_cache 20 -> -0.5 on top
    soft = algorithm("rl.algorithm={preset: dapo, l_max: 100, overlong: {mode: soft, "
                     "l_cache: 20}}")
    long_right = judged(lambda task, t: 0.5, TASK, episode("The answer is 36.", generated=90))
    long_wrong = judged(lambda task, t: 1.0, TASK, episode("The answer is 7.", generated=90))
    assert train_reward(long_right, soft, 100, 20, 0.2) == pytest.approx(1.0 + 0.1 - 0.5)
    assert train_reward(long_wrong, soft, 100, 20, 0.2) == pytest.approx(-0.5)
    # judge/paid_mean: 0.2 * 0.5 paid on 1 of 2 episodes
    m = judge_metrics([right, wrong], 0.2)
    assert m == {"judge/mean": 0.75, "judge/mean_on_success": 0.5,
                 "judge/paid_mean": pytest.approx(0.05)}


def test_the_rubric_judge_scores_answered_grounded_clean():
    assert grounded_answer(TASK, episode("The answer is 36.")) == 1.0
    # a number the tools never produced: answered and clean only
    assert grounded_answer(TASK, episode("The answer is 1203.")) == pytest.approx(2 / 3)
    # grounded in a failed call's output still loses "clean"
    assert grounded_answer(TASK, episode("The answer is 36.", tool_errors=1)) == pytest.approx(
        2 / 3)
    # truncated mid-call: not answered, so not grounded either
    cut = episode("The answer is 36.", status=Status.TRUNCATED)
    assert grounded_answer(TASK, cut) == pytest.approx(1 / 3)
    # the hackable part: quoting any tool output is "grounded", right or wrong
    assert grounded_answer(TASK, episode("The answer is 99.", tool_output="99")) == 1.0


@pytest.mark.parametrize("score", [1.5, -0.1, math.nan, "0.5", True, None])
def test_a_judge_score_outside_0_1_stops_the_run(score):
    with pytest.raises(RunError, match=r"rl.judge.fn returned .* for task calc-1; expected a "
                       r"float in \[0, 1\]"):
        judged(lambda task, t: score, TASK, episode("The answer is 36."))


def test_a_bad_judge_path_is_one_config_error_line(tmp_path):
    cfg = load_config(CONFIG, ["model.build={}", "rl.judge.fn=tiller.train.judges:nope"])
    with pytest.raises(ConfigError, match=r"^config field rl.judge.fn: got "
                       r"'tiller.train.judges:nope'; cannot import it"):
        Run(cfg, tmp_path)
    with pytest.raises(ConfigError, match="rl.judge.weight"):
        load_config(CONFIG, ["model.build={}", "rl.judge.weight=-1"])


def run_trace(trace, window=3, margin=0.05):
    trend = JudgeHackingTrend(window, margin)
    return [trend.update(j, s)["judge/hacking_suspected"] for j, s in trace], trend


def test_the_detector_fires_when_judge_rises_and_success_does_not(caplog):
    # judge 0.40 -> 0.80 over 12 steps, success flat at 0.35 (noise +-0.01)
    trace = [(0.4 + 0.04 * i, 0.35 + (0.01 if i % 2 else -0.01)) for i in range(12)]
    with caplog.at_level(logging.WARNING, logger="tiller.observe.health"):
        flags, trend = run_trace(trace)
    # from step 6 on, each window's judge mean is 0.12 above the one before (> 0.05) while
    # success moves by +-0.0067 (<= 0.05)
    assert flags == [0.0] * 5 + [1.0] * 7
    warnings = [r for r in caplog.records if "gaming the judge" in r.message]
    assert len(warnings) == trend.warnings == 1  # one warning per suspicion, not per step


def test_the_detector_stays_quiet_on_healthy_runs(caplog):
    rising_together = [(0.4 + 0.04 * i, 0.3 + 0.04 * i) for i in range(12)]
    plateau = [(0.7 + (0.01 if i % 2 else -0.01), 0.6) for i in range(12)]
    falling_judge = [(0.8 - 0.04 * i, 0.5) for i in range(12)]
    with caplog.at_level(logging.WARNING, logger="tiller.observe.health"):
        for trace in (rising_together, plateau, falling_judge):
            flags, trend = run_trace(trace)
            assert flags == [0.0] * 12 and trend.warnings == 0
    assert not caplog.records


def test_the_detector_hand_computed():
    # window 2: steps [a, b | c, d]: judge (0.2, 0.2 | 0.3, 0.3) rose 0.1 > 0.06 while success
    # (0.5, 0.5 | 0.5, 0.4) fell 0.05: suspected at step 4; at step 5 the judge rose 0.3 - 0.25
    # = 0.05 < 0.06 and at step 6 not at all: cleared
    trend = JudgeHackingTrend(window=2, margin=0.06)
    out = [trend.update(j, s) for j, s in [(0.2, 0.5), (0.2, 0.5), (0.3, 0.5), (0.3, 0.4),
                                           (0.3, 0.5), (0.3, 0.5)]]
    assert [o["judge/hacking_suspected"] for o in out] == [0, 0, 0, 1, 0, 0]
    assert out[3]["judge/rise"] == pytest.approx(0.1)
    assert out[3]["judge/success_rise"] == pytest.approx(-0.05)
    assert out[-1]["judge/hacking_warnings"] == 1


def test_the_model_judge_is_p_yes_over_p_yes_plus_no(calc_model_dir):
    prompt = "Q: {question}\nA: {answer}\nCorrect?"
    judge = ModelJudge(calc_model_dir, prompt)
    # by hand: one forward pass per continuation over the whole text, its tokens' logprobs
    tok = AutoTokenizer.from_pretrained(calc_model_dir)
    model = AutoModelForCausalLM.from_pretrained(calc_model_dir, dtype=torch.float32).eval()

    def logp(answer, word):
        ctx = tok.encode(prompt.format(question=TASK.prompt, answer=answer),
                         add_special_tokens=False)
        cont = tok.encode(word, add_special_tokens=False)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0], -1)
        return sum(float(lp[len(ctx) - 1 + i, c]) for i, c in enumerate(cont))

    scores = {}
    for answer in ("The answer is 36.", "The answer is 1203."):
        y, n = logp(answer, " yes"), logp(answer, " no")
        scores[answer] = judge(TASK, episode(answer))
        assert scores[answer] == pytest.approx(math.exp(y) / (math.exp(y) + math.exp(n)),
                                               rel=1e-5)
        assert 0.0 < scores[answer] < 1.0
    # it reads the answer: two answers, two scores; the same answer, the same score
    assert scores["The answer is 36."] != scores["The answer is 1203."]
    assert judge(TASK, episode("The answer is 36.")) == scores["The answer is 36."]
    # an episode that did not end on an assistant answer is judged on an empty answer
    cut = without_final_answer(episode("The answer is 36."))
    assert judge(TASK, cut) == pytest.approx(
        math.exp(logp("", " yes")) / (math.exp(logp("", " yes")) + math.exp(logp("", " no"))),
        rel=1e-5)


def test_the_model_judge_scores_an_empty_context(calc_model_dir):
    # prompt "{answer}" and no final answer: the context encodes to nothing, so the
    # continuations are scored after the tokenizer's start token
    judge = ModelJudge(calc_model_dir, "{answer}")
    cut = without_final_answer(episode("The answer is 36."))
    assert 0.0 < judge(TASK, cut) < 1.0


def test_a_judge_tokenizer_without_special_tokens_is_a_config_error(calc_model_dir,
                                                                   monkeypatch):
    real = AutoTokenizer.from_pretrained

    def bare(path):
        tok = real(path)
        tok.bos_token = tok.eos_token = tok.pad_token = None
        return tok

    monkeypatch.setattr("tiller.train.judges.AutoTokenizer.from_pretrained", bare)
    with pytest.raises(ConfigError, match=r"^config field rl.judge.model: the tokenizer at .* "
                       "has no bos, eos or pad token"):
        ModelJudge(calc_model_dir, "{answer}")


def test_model_judge_config_errors_are_one_line(calc_model_dir, tmp_path):
    base = ["model.build={}"]
    with pytest.raises(ConfigError, match=r"^config field rl.judge.model: .* a run has one "
                       "judge"):
        load_config(CONFIG, [*base, f"rl.judge.model={calc_model_dir}",
                             "rl.judge.fn=tiller.train.judges:grounded_answer"])
    judge = f"rl.judge.model={calc_model_dir}"
    with pytest.raises(ConfigError, match=r"^config field rl.judge.prompt: it must contain "
                       r"\{answer\}"):
        load_config(CONFIG, [*base, judge, "rl.judge.prompt='Is {question} right?'"])
    with pytest.raises(ConfigError, match=r"^config field rl.judge.prompt: KeyError: 'x'"):
        load_config(CONFIG, [*base, judge, "rl.judge.prompt='{answer} {x}'"])
    with pytest.raises(ConfigError, match=r"^config field rl.judge.prompt: got .*; it only "
                       "applies with rl.judge.model: leave it out, or drop it with "
                       r"rl.judge.prompt=null$"):
        load_config(CONFIG, [*base, "rl.judge.prompt='{answer}?'"])
    for knob in ("weight=0.3", "window=5", "margin=0.1"):
        with pytest.raises(ConfigError, match=rf"^config field rl.judge.{knob.split('=')[0]}: "
                           r"got .*; it only applies with rl.judge.fn or rl.judge.model: "
                           rf"leave it out, or drop it with rl.judge.{knob.split('=')[0]}=null$"):
            load_config(CONFIG, [*base, f"rl.judge.{knob}"])
    with pytest.raises(ConfigError, match=r"^config field rl.judge.model: got .* "
                       "rl.reward_control: random"):
        load_config(CONFIG, [*base, f"rl.judge.model={calc_model_dir}",
                             "rl.reward_control=random"])
    cfg = load_config(CONFIG, [f"model.path={calc_model_dir}", "model.build=null",
                               f"rl.judge.model={tmp_path / 'nothing'}"])
    with pytest.raises(ConfigError, match=r"^config field rl.judge.model: got .*nothing'; no "
                       "Hugging Face model there"):
        Run(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"encodes ' yes' as \[.*\] and ' yes' as"):
        ModelJudge(calc_model_dir, "{answer}", yes=" yes", no=" yes")


def group_rewards(db, weight):
    """Per trained group of a traced run, per member: (the gated reward, hand-computed from its
    verifier value and judge score; the advantage it was trained with; verifier success; the
    judge's score)."""
    groups = {}
    for r in trained_episodes(db):
        judge = json.loads(r["checks"])["judge"]
        success = r["reward"] >= 1.0 and not r["env_error"]
        paid = r["reward"] + (weight * judge if success else 0.0)
        groups.setdefault((r["trained_step"], r["task_id"]), []).append(
            (paid, r["advantage"], success, judge))
    return list(groups.values())


def grpo(r):
    """GRPO by hand (ALGORITHMS.md): (r - mean) / (std + 1e-6), std with Bessel's correction."""
    return (r - r.mean()) / (r.std(ddof=1) + 1e-6)


@pytest.mark.parametrize("judge", ["model", "fn"])
def test_a_real_run_trains_on_the_judge_only_where_the_verifier_says_success(
        judge, calc_model_dir, calc_sft_dir, tmp_path):
    # odd samples are the scripted expert's (they succeed, worded two ways), even ones the tiny
    # policy's (they fail): every group has both, and the judge (a real model, or one that
    # scores the failures highest) scores them all
    weight = 0.5
    cfg = load_config(CONFIG, tiny_rl(
        calc_sft_dir, "rl.steps=2",
        f"rl.judge.model={calc_model_dir}" if judge == "model"
        else "rl.judge.fn=half_expert_loop:tempting_judge",
        f"rl.judge.weight={weight}", "rl.judge.window=1",
        "agent.loop=half_expert_loop:run_episode"))
    run = Run(cfg, tmp_path)
    rl(run)
    run.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["phase"] == "rl"]
    assert len(rows) == 2 and all(r["success_rate"] == 0.5 for r in rows)
    groups = group_rewards(tmp_path / "traces.sqlite", weight)
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)
    for g in groups:
        paid = np.array([m[0] for m in g])
        assert [m[2] for m in g] == [False, True, False, True]
        # the failures are paid exactly 0 however the judge scored them, the successes more
        # than 1 (the judge's term), and differently: the judge term shows in the advantages
        assert paid[0] == paid[2] == 0.0 and (paid[[1, 3]] > 1.0).all()
        assert abs(paid[1] - paid[3]) > 1e-3  # the tiny model judge: ~0.005 apart
        expected = grpo(paid)
        assert [m[1] for m in g] == pytest.approx(expected.tolist(), abs=1e-5)
        # which the verifier alone, or a judge paid on every episode, would not have given
        verifier = np.array([0.0, 1.0, 0.0, 1.0])
        scores = np.array([m[3] for m in g])
        for other in (verifier, verifier + weight * scores):
            assert np.abs(grpo(other) - expected).max() > 1e-4  # 10x the match's tolerance
    for r in rows:
        assert 0.0 < r["judge/mean"] <= 1.0 and "judge/hacking_suspected" in r
        assert r["judge/paid_mean"] == pytest.approx(weight * r["judge/mean_on_success"] / 2)
