"""`tiller view`: headless Chromium on a real tiny run (filter, open an episode, the token
strip's marks against the database, its group, the curves; screenshots kept), and the JSON API
over HTTP on a run synthesized through the real TraceWriter (pages, filters, bad requests)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from browser import artifacts_dir, chromium_page
from helpers import cli, traces_of_version

from tiller.config import RLConfig
from tiller.engine.api import SamplingParams
from tiller.engine.embedded import EmbeddedEngine
from tiller.envs.calculator import CalculatorEnv as Calc
from tiller.errors import RunFolderError
from tiller.models import load_model
from tiller.observe.traces import TraceWriter, connect, query, read_episode
from tiller.observe.viewer.app import create_app
from tiller.rollout.agent_loop import EngineActor, run_episode
from tiller.rollout.collect import collect
from tiller.train.batch import Batch
from tiller.train.trainer import PolicyTrainer

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_viewer", ROOT / "benchmarks/viewer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def flagged(ep: dict, threshold: float, mask: str = "train_mask") -> int:
    """Tokens of the train mask (the trainer's logprobs are 0 off it), or of another `mask`,
    whose |rollout - trainer| logprob exceeds `threshold`."""
    return sum(1 for m, a, b in zip(ep[mask], ep["logprobs"], ep["trainer_logprobs"],
                                    strict=True) if m and abs(a - b) > threshold)


@pytest.mark.slow
@pytest.mark.integration
def test_viewer_in_chromium_marks_exactly_the_loss_mask(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    db = run_dir / "traces.sqlite"
    with closing(connect(db)) as con:
        failed = con.execute("SELECT COUNT(*) FROM episodes WHERE phase = 'rl' AND "
                             "status = 'truncated' AND reward <= 0").fetchone()[0]
        total = con.execute("SELECT COUNT(*) FROM episodes").fetchone()[0]
    assert failed > 0
    with bench.serve_viewer(run_dir) as url, chromium_page(tmp_path / "profile") as page:
        page.goto(f"{url}/")
        page.wait_for_selector("main[data-view=episodes] #episodes")
        assert int(page.get_attribute("#episodes", "data-total")) == total
        # filter to failed RL episodes through the form
        page.select_option("select[name=phase]", "rl")
        page.select_option("select[name=status]", "truncated")
        page.fill("input[name=reward_max]", "0")
        page.click("#apply")
        page.wait_for_function("location.hash.includes('status=truncated')")
        page.wait_for_selector("main[data-view=episodes] #episodes")
        assert int(page.get_attribute("#episodes", "data-total")) == failed
        cells = page.locator("#episodes tbody tr td:nth-child(6)").all_inner_texts()
        assert cells == ["truncated"] * min(failed, 50)
        page.screenshot(path=str(artifacts_dir() / "viewer_list.png"), full_page=True)
        # open one
        first = int(page.get_attribute("#episodes tbody tr:first-child", "data-id"))
        page.click("#episodes tbody tr:first-child")
        page.wait_for_selector("main[data-view=episode] #token-strip")
        ep = read_episode(db, first)
        assert ep["trained_step"] is not None  # an RL episode the trainer saw
        strip = page.eval_on_selector_all(
            "#token-strip .tok", "s => s.map(x => [x.dataset.mask, x.dataset.train])")
        assert [int(m) for m, _ in strip] == ep["loss_mask"]
        assert [int(t) for _, t in strip] == ep["train_mask"]
        assert sum(ep["loss_mask"]) == ep["n_generated"] > 0
        default = int(page.get_attribute("#token-strip", "data-flagged"))
        assert default == flagged(ep, 1e-3)
        page.screenshot(path=str(artifacts_dir() / "viewer_episode.png"), full_page=True)
        # a threshold under the fp32 noise flags the generated tokens that differ at all
        page.goto(f"{url}/#/episode/{first}?threshold=1e-12")
        page.wait_for_selector("main[data-view=episode] #token-strip")
        assert int(page.get_attribute("#token-strip", "data-flagged")) == flagged(ep, 1e-12)
        # the group side by side: the task's rl.group_size samples of that step
        page.click("#group-link")
        page.wait_for_selector("main[data-view=group] #group-compare")
        members = page.eval_on_selector_all(".member", "s => s.map(x => +x.dataset.id)")
        assert len(members) == 4 and first in members
        assert sorted(members) == sorted(e["id"] for e in query(
            db, phase="rl", task_id=ep["task_id"], rl_step=ep["rl_step"], limit=100))
        page.screenshot(path=str(artifacts_dir() / "viewer_group.png"), full_page=True)
        page.click("#nav-curves")
        page.wait_for_selector("main[data-view=curves] .chart")
        assert page.get_attribute(".chart[data-metric=reward_mean]", "data-points") == "3"
        page.screenshot(path=str(artifacts_dir() / "viewer_curves.png"), full_page=True)
        assert page.locator("#error").is_hidden()


@pytest.mark.slow
@pytest.mark.integration
def test_a_token_dropped_from_training_is_not_flagged(tiny_run, tmp_path):
    """A generated token the trainer dropped (loss mask 1, train mask 0: its trainer logprob
    is 0) shows as dropped and is not flagged, though |rollout - 0| is over the threshold: the
    flag counts the train mask's tokens only (on a copy of the run, one token dropped)."""
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run[0], run_dir)
    db = run_dir / "traces.sqlite"
    with closing(connect(db)) as con:
        (first,) = con.execute("SELECT MIN(id) FROM episodes WHERE trained_step IS NOT NULL"
                               ).fetchone()
    ep = read_episode(db, first)
    k = next(i for i, (m, lp) in enumerate(zip(ep["train_mask"], ep["logprobs"], strict=True))
             if m and abs(lp) > 1e-3)
    train, trainer = list(ep["train_mask"]), list(ep["trainer_logprobs"])
    train[k], trainer[k] = 0, 0.0
    with closing(sqlite3.connect(db)) as con, con:
        con.execute("UPDATE episodes SET train_mask = ?, trainer_logprobs = ? WHERE id = ?",
                    (np.asarray(train, "u1").tobytes(), np.asarray(trainer, "<f4").tobytes(),
                     first))
    ep = read_episode(db, first)
    assert ep["loss_mask"][k] == 1 and ep["train_mask"][k] == 0
    # the loss mask would flag the dropped one
    assert flagged(ep, 1e-3, "loss_mask") == flagged(ep, 1e-3) + 1
    with bench.serve_viewer(run_dir) as url, chromium_page(tmp_path / "profile") as page:
        page.goto(f"{url}/#/episode/{first}")
        page.wait_for_selector("main[data-view=episode] #token-strip")
        assert int(page.get_attribute("#token-strip", "data-flagged")) == flagged(ep, 1e-3)
        tok = f"#token-strip .tok[data-i='{k}']"
        assert (page.get_attribute(tok, "data-mask"), page.get_attribute(tok, "data-train"),
                page.get_attribute(tok, "data-flag")) == ("1", "0", "0")
        assert page.locator("#error").is_hidden()


@contextmanager
def serving(run_dir: Path) -> Iterator[str]:
    """The viewer app under uvicorn on a free 127.0.0.1 port, in a thread of this process."""
    server = uvicorn.Server(uvicorn.Config(create_app(run_dir), host="127.0.0.1",
                                           port=bench.free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the viewer did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("synthetic")
    made = bench.synthesize(run_dir, 300, group_size=8, tasks_per_step=8, seed=1)
    assert made["episodes"] == made["trained"] == 300
    with serving(run_dir) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield run_dir / "traces.sqlite", client


@pytest.mark.integration
def test_pages_cover_every_episode_once(synthetic):
    db, client = synthetic
    seen = []
    for offset in range(0, 300, 50):
        page = client.get("/api/episodes", params={"offset": offset, "limit": 50}).json()
        assert page["total"] == 300 and len(page["episodes"]) == 50
        seen += [e["id"] for e in page["episodes"]]
    assert seen == sorted(set(seen)) and len(seen) == 300
    assert "messages" not in page["episodes"][0] and "token_ids" not in page["episodes"][0]
    worst = client.get("/api/episodes", params={"order": "reward", "limit": 500}).json()
    assert [e["reward"] for e in worst["episodes"]] == sorted(e["reward"] for e in
                                                              worst["episodes"])


@pytest.mark.integration
@pytest.mark.parametrize("params, keep", [
    ({"status": "env_error"}, lambda e: e["status"] == "env_error"),
    ({"env_error": "true"}, lambda e: e["env_error"] == 1),
    ({"tool_errors_min": 1}, lambda e: e["tool_errors"] >= 1),
    ({"tokens_min": 150, "tokens_max": 250}, lambda e: 150 <= e["n_tokens"] <= 250),
    ({"step_min": 2, "step_max": 3, "reward_max": 0},
     lambda e: 2 <= e["rl_step"] <= 3 and e["reward"] <= 0),
    ({"q": "task-00003"}, lambda e: e["task_id"] == "task-00003"),
    ({"q": "100%"}, lambda e: False),  # % is a literal, not a wildcard
])
def test_filters_match_the_database(synthetic, params, keep):
    db, client = synthetic
    page = client.get("/api/episodes", params={**params, "limit": 500}).json()
    everything = query(db, limit=1000)  # the traces module's own reader
    expected = [e["id"] for e in everything if keep(e)]
    assert page["total"] == len(expected)
    assert [e["id"] for e in page["episodes"]] == expected


@pytest.mark.integration
def test_episode_and_group(synthetic):
    db, client = synthetic
    ep = client.get("/api/episodes/9").json()
    stored = read_episode(db, 9)
    arrays = ep["arrays"]
    assert arrays["loss_mask"] == stored["loss_mask"]
    assert arrays["text"] == [f"<{i}>" for i in stored["token_ids"]]  # no tokenizer here
    assert all(math.isclose(a, b) for a, b in zip(arrays["advantages"], stored["advantages"],
                                                  strict=True))
    assert [c["outcome"] for c in ep["tool_calls_list"]] == [
        c["outcome"] for c in stored["tool_calls_list"]]
    group = client.get("/api/episodes/9/group").json()["members"]
    assert sorted(m["sample_index"] for m in group) == list(range(8))
    assert {m["task_id"] for m in group} == {stored["task_id"]}
    assert [m["reward"] for m in group] == sorted((m["reward"] for m in group), reverse=True)


@pytest.mark.integration
def test_a_group_is_one_draw_of_its_task_under_one_tag(calc_model_dir, tokenizer, limits,
                                                       tmp_path):
    """Unit 0 draws task a twice (draws 0 and 1) and b once; unit 1 draws a again (draw 0
    under its own tag); step 1 trains all four groups, as async trains groups of two units in
    one step. The group page shows each group alone, and an eval draw with its samples under
    both eval seeds."""
    model = load_model(calc_model_dir)
    engine = EmbeddedEngine(model, tokenizer.pad_token_id)
    actor = EngineActor(engine, SamplingParams(max_new_tokens=24,
                                               stop_token_ids=(tokenizer.eos_token_id,)))
    a, b = Calc.make_tasks("train", 2, 0, 2)

    def sample(tasks, tag):
        return asyncio.run(collect(tasks, 2, actor, episode_fn=run_episode,
                                   make_env=lambda *key: Calc(), tokenizer=tokenizer,
                                   limits=limits, seed=0, tag=tag))

    try:
        rl = sample([a, a, b], ("rl", 0)) + sample([a], ("rl", 1))
        evals = sample([a, a], ("eval", "rl", "seed0")) + sample([a, a], ("eval", "rl", "seed1"))
    finally:
        engine.close()
    writer = TraceWriter(tmp_path / "traces.sqlite")
    for t in rl:
        writer.put_episode(t, "rl", "train", 0, 1)
    for t in evals:
        writer.put_episode(t, "eval_rl", "heldout", 1)
    trainer = PolicyTrainer(model)
    trainer.set_optimizer(1e-4)
    batch = Batch.collate(rl, tokenizer.pad_token_id, group_index=[0, 0, 1, 1, 2, 2, 3, 3])
    trainer.rl_step(batch, RLConfig(), l_max=256)
    writer.put_training(1, rl, batch, trainer.last_rl)
    assert writer.close()["traces/trained"] == 8
    db = tmp_path / "traces.sqlite"
    with closing(connect(db)) as con:
        # one step trained a's three groups: its step and task alone would merge them
        assert con.execute("SELECT count(*) FROM episodes WHERE task_id = ? AND "
                           "trained_step = 1", (a.id,)).fetchone()[0] == 6
        assert [(r["tag"], r["draw"]) for r in query(con, phase="rl")] == [
            (["rl", 0], 0)] * 2 + [(["rl", 0], 1)] * 2 + [(["rl", 0], 0)] * 2 + [
            (["rl", 1], 0)] * 2
    # ids in write order: the RL groups 1-2 (a, draw 0), 3-4 (a, draw 1), 5-6 (b), 7-8 (a in
    # unit 1); eval a's draw 0 is 9-10 (seed 0) and 13-14 (seed 1), its draw 1 11-12, 15-16
    groups = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10, 13, 14], [11, 12, 15, 16]]
    with serving(tmp_path) as url, httpx.Client(base_url=url, timeout=30) as client:
        for members in groups:
            for episode_id in members:
                got = client.get(f"/api/episodes/{episode_id}/group").json()["members"]
                assert sorted(m["id"] for m in got) == members, episode_id


@pytest.mark.integration
@pytest.mark.parametrize("path, code, says", [
    ("/api/episodes?status=bogus", 422, "status"),
    ("/api/episodes?limit=0", 422, "limit"),
    ("/api/episodes?limit=501", 422, "limit"),
    ("/api/episodes?order=messages", 422, "order"),
    ("/api/episodes?tokens_min=abc", 422, "tokens_min"),
    ("/api/episodes/999999", 404, "no episode 999999"),
    ("/api/episodes/999999/group", 404, "no episode 999999"),
])
def test_malformed_requests_are_clear_errors(synthetic, path, code, says):
    _, client = synthetic
    r = client.get(path)
    assert r.status_code == code
    assert says in r.text


def test_a_folder_without_traces_is_one_line(tmp_path):
    with pytest.raises(RunFolderError, match="has no traces.sqlite"):
        create_app(tmp_path)
    (tmp_path / "old").mkdir()
    traces_of_version(tmp_path / "old" / "traces.sqlite", 1)
    with pytest.raises(RunFolderError, match="holds traces of schema version 1; this tiller "
                                             "reads version 2"):
        create_app(tmp_path / "old")
    code, out = cli("view", tmp_path)
    assert code == 2
    assert out.strip().splitlines() == [
        f"error: {tmp_path} has no traces.sqlite (is it a run folder? traces are written "
        f"when observe.traces.enabled=true)"]


@pytest.mark.integration
def test_reads_a_database_while_training_writes_it(tmp_path):
    """The viewer's read-only connections see each batch the (background) writer commits,
    while the writer is still open: a running training can be watched."""
    writer = TraceWriter(tmp_path / "traces.sqlite")
    rng = random.Random(0)

    def total(client) -> int:
        return client.get("/api/episodes", params={"limit": 1}).json()["total"]

    def wait_for(client, n: int) -> None:
        deadline = time.monotonic() + 30
        while total(client) != n:
            assert time.monotonic() < deadline, f"the viewer never saw {n} episodes"
            time.sleep(0.05)

    try:
        with serving(tmp_path) as url, httpx.Client(base_url=url, timeout=30) as client:
            assert total(client) == 0
            for i in range(5):
                writer.put_episode(bench.episode(rng, 0, i, 1, seed=i), "rl", "train", 1, 1)
            wait_for(client, 5)
            for i in range(5, 12):
                writer.put_episode(bench.episode(rng, 1, i, 2, seed=i), "rl", "train", 2, 2)
            wait_for(client, 12)
            page = client.get("/api/episodes", params={"step_min": 2}).json()
            assert [e["seed"] for e in page["episodes"]] == list(range(5, 12))
    finally:
        writer.close()


@pytest.mark.integration
def test_tiller_view_starts_without_importing_torch_or_transformers():
    # `tiller view` is the CLI plus the viewer app: importing torch there cost seconds per start
    code = ("import sys, tiller.cli, tiller.observe.viewer.app; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
