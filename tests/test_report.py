"""`tiller report`: the HTML report of a real tiny run opens in headless Chromium with every
plot rendered, and a run folder it cannot read is one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from browser import artifacts_dir, chromium_page
from helpers import TINY_RUN, cli

from tiller.errors import RunFolderError
from tiller.observe.report import SECTIONS, load_run, render_report, write_report


@pytest.mark.slow
@pytest.mark.integration
def test_train_writes_a_report_that_renders_in_chromium(tiny_run, tmp_path):
    run_dir, summary = tiny_run
    report = run_dir / "report.html"
    assert summary["report"] == report.resolve().as_uri()
    html = report.read_text()
    assert "http://" not in html and "https://" not in html  # nothing to fetch: self-contained
    with chromium_page(tmp_path / "profile") as page:
        page.goto(summary["report"])
        titles = page.locator("h2").all_inner_texts()
        assert titles == list(SECTIONS)
        widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete ? "
                                                  "i.naturalWidth : -1)")
        # held-out, learning curve, difficulty, 2 tool plots, env_error, mismatch,
        # timing, ledger (staleness is one line in a sync run)
        assert len(widths) == 9 and min(widths) > 0, widths
        staleness = page.locator("section", has_text="Staleness").inner_text()
        assert "sync run" in staleness
        page.screenshot(path=str(artifacts_dir() / "report.png"), full_page=True)


@pytest.mark.slow
def test_report_tables_hold_the_summary_numbers(tiny_run):
    run_dir, summary = tiny_run
    run = load_run(run_dir)
    after_rl = dict(run.evals())["after RL"]
    assert after_rl["success"] == summary["heldout_after_rl"]["success"]
    # calculator tasks carry their difficulty (the operations): the levels cover every task
    levels = {k.split("/")[1] for k in after_rl if k.startswith("difficulty/")}
    assert levels and levels <= {"1", "2"}
    assert sum(after_rl[f"difficulty/{d}/tasks"] for d in levels) == after_rl["tasks"] == 16
    html = render_report(run)
    for key, n in summary["rl"]["ledger"].items():
        assert f"<td>{key}</td><td>{n}</td>" in html


@pytest.mark.slow
def test_unfinished_run_reports_what_it_has(tiny_run, tmp_path):
    """A run that stopped before RL (no summary.json, no RL rows): each RL section says so in
    one line, the eval it logged is plotted."""
    run_dir, _ = tiny_run
    rows = [r for r in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(r)["phase"] in ("sft", "eval_sft")]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    html = write_report(tmp_path).read_text()
    assert html.count("<img") == 2  # held-out success, and by difficulty
    assert html.count("No RL step was logged") == 7
    assert "no (no summary.json)" in html


def test_malformed_metrics_line_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"phase": "rl", "step": 1}\n{"step": 2\n')
    with pytest.raises(RunFolderError, match=r"metrics.jsonl:2: not a metrics record"):
        load_run(tmp_path)


@pytest.mark.integration
def test_cli_report_on_a_folder_that_is_not_a_run_is_one_line(tmp_path):
    """Through the `tiller` console script (pyproject's [project.scripts]) in a fresh process:
    the suite's one check that the entry point exists, runs the CLI and passes on its exit
    status. The other CLI tests call the CLI in-process (helpers.cli)."""
    script = Path(sys.executable).with_name("tiller")
    assert script.is_file(), f"no console script {script}: install tiller (scripts/setup.sh)"
    out = subprocess.run([str(script), "report", str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert out.stdout.strip().splitlines() == [
        f"error: {tmp_path} is not a run folder: it has no metrics.jsonl"]


@pytest.mark.slow
def test_async_run_plots_staleness(tiny_run, tmp_path):
    """The staleness section plots what an async run logs (the controller's own
    staleness_metrics rows) instead of the sync run's one line."""
    from tiller.observe.steps import staleness_metrics

    run_dir, _ = tiny_run
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r, stale in zip([r for r in rows if r["phase"] == "rl"], ([0, 1, 1], [1, 2], [2, 2]),
                        strict=True):
        r.update(staleness_metrics(stale))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("name: async\nrl:\n  mode: async\n")
    run = load_run(tmp_path)
    assert run.rl[0]["staleness/1"] == pytest.approx(2 / 3)
    html = render_report(run)
    staleness = html[html.index("<h2>Staleness</h2>"):html.index("<h2>Rollout and training")]
    assert staleness.count("<img") == 1 and "sync run" not in staleness


@pytest.mark.slow
def test_without_matplotlib_report_and_train_stop_with_one_line(tiny_run, monkeypatch):
    run_dir, _ = tiny_run
    # None in sys.modules: `import matplotlib` raises ImportError, as when it is not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out = cli("report", run_dir)
    assert code == 2
    assert out.strip().splitlines() == [
        "error: tiller report needs the 'matplotlib' package, which is not installed: pip "
        "install 'tiller[report]'"]
    from tiller.config import load_config
    from tiller.controller import train
    from tiller.errors import ConfigError

    with pytest.raises(ConfigError, match=r"logging.report=true needs the 'matplotlib' package"
                                          r".*or set logging.report=false"):
        train(load_config("configs/calculator.yaml", [*TINY_RUN, "logging.report=true"]),
              run_dir / "never")
    assert not (run_dir / "never").exists()  # stopped before the run folder was made


@pytest.mark.slow
def test_train_prints_the_report_link_last(tiny_run, capsys):
    from tiller.cli import _print_summary

    run_dir, summary = tiny_run
    _print_summary(summary)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"report: {(run_dir / 'report.html').resolve().as_uri()}"
