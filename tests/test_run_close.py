"""A run closes every part it opened, in reverse order, each even when one before it failed;
each failure is logged, and the last one raised carries the earlier ones as its context (as
the nested `finally` blocks it replaced did). What makes episodes (the gateway, the engine)
closes before what they are written to (the trace writer, the metrics logger)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tiller import run as run_module
from tiller.config import load_config
from tiller.engine.embedded import EmbeddedEngine
from tiller.gateway.server import Gateway
from tiller.observe.metrics import MetricsLogger
from tiller.observe.traces import TraceWriter
from tiller.run import Run
from tiller.tools import sandbox
from tiller.tools.stack import ToolStack


class Spy:
    """Each part's close appends its class name to `closed` ("sandbox policy" for the reset of
    the sandbox policy), then closes for real, or raises the part's error in `fail` (leaving
    it open). Installed before the run opens its parts."""

    def __init__(self, monkeypatch):
        self.closed: list[str] = []
        self.fail: dict[type, Exception] = {}
        for cls in (EmbeddedEngine, MetricsLogger, TraceWriter, ToolStack, Gateway):
            monkeypatch.setattr(cls, "close", self.wrap(cls, cls.close))
        real_policy = run_module.set_unsafe_fallback

        def policy(allowed: bool) -> None:
            if not allowed:  # the run's end resets it (the runs here allow it at start)
                self.closed.append("sandbox policy")
            real_policy(allowed)

        monkeypatch.setattr(run_module, "set_unsafe_fallback", policy)

    def wrap(self, cls, real):
        def close(part):
            self.closed.append(cls.__name__)
            if cls in self.fail:
                raise self.fail[cls]
            return real(part)
        return close


@pytest.fixture()
def spied(calc_sft_dir, tmp_path, monkeypatch):
    """A run whose parts' closes are spied on; the engine's worker is stopped at the end."""
    real_engine_close = EmbeddedEngine.close
    spy = Spy(monkeypatch)
    sandbox.set_unsafe_fallback(False)
    cfg = load_config("configs/calculator.yaml", [
        f"model.path={calc_sft_dir}", "model.build=null", "logging.tensorboard=false",
        "env.tools.sandbox.allow_unsafe_fallback=true"])
    run = Run(cfg, tmp_path)
    assert sandbox._fallback_allowed is True
    yield run, spy
    real_engine_close(run.engine)  # idempotent: the worker may already be stopped


# the engine first: an episode still running cannot write into closed traces or metrics
ORDER = ["EmbeddedEngine", "TraceWriter", "MetricsLogger", "sandbox policy", "ToolStack"]


def test_close_closes_every_part_in_reverse_order(spied):
    run, spy = spied
    run.close()
    assert spy.closed == ORDER  # the reverse of the order they opened in
    assert run.logger._file.closed and sandbox._fallback_allowed is False
    run.close()  # a second close has nothing left to close
    assert spy.closed == ORDER


@pytest.mark.integration  # the agent gateway serves on 127.0.0.1
def test_the_gateway_and_the_engine_close_before_the_sinks(calc_sft_dir, tmp_path,
                                                           monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    spy = Spy(monkeypatch)
    cfg = load_config("configs/calculator.yaml", [
        f"model.path={calc_sft_dir}", "model.build=null", "logging.tensorboard=false",
        "env.tools.sandbox.allow_unsafe_fallback=true", "agent.program=openai_agent.agent:main"])
    run = Run(cfg, tmp_path)
    assert run.gateway is not None
    run.close()
    assert spy.closed == ["Gateway", *ORDER]


def test_a_failing_engine_close_still_closes_the_rest_then_raises(spied, caplog):
    run, spy = spied
    spy.fail[EmbeddedEngine] = RuntimeError("engine (injected)")
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError, match="engine"):
        run.close()
    assert spy.closed == ORDER
    assert run.logger._file.closed and sandbox._fallback_allowed is False
    assert "closing the run's engine failed: RuntimeError: engine (injected)" in caplog.text


def test_when_several_parts_fail_each_is_logged_and_the_last_raised(spied, caplog):
    run, spy = spied
    spy.fail.update({MetricsLogger: OSError("logger (injected)"),
                     ToolStack: ValueError("tools (injected)")})
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="tools") as e:
        run.close()
    assert isinstance(e.value.__context__, OSError)  # the logger's error, kept as context
    assert spy.closed == ORDER
    assert sandbox._fallback_allowed is False
    assert "closing the run's metrics logger failed: OSError: logger (injected)" in caplog.text
    assert "closing the run's tool stack failed: ValueError: tools (injected)" in caplog.text
    run.logger._file.close()
