"""A trainer rank whose step fails while rank 0 waits in a collective: rank 0's wait ends at
once (the failed rank leaves the process group), not at train.rank_timeout_s, and the step
fails in one line naming the rank and its error. (Its own group: one per process, and
tests/test_distributed.py's lives for its whole module.)"""

import logging
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
from test_distributed import batch_of
from torch.distributed.distributed_c10d import _set_pg_timeout

from tiller.errors import RunError
from tiller.models import load_model
from tiller.train.distributed import TrainerOptions
from tiller.train.ranks import ProcessRank, start_ranks

TIMEOUT_S = 120.0


def fail_on(rank):
    """Rank `rank` gets no batch with its steps: its sft_step raises, rank 0's does not."""
    rank.send = lambda name, args, lrs: ProcessRank.send(rank, name, (None, *args[1:]), lrs)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_rank_that_fails_ends_rank_0s_wait_and_names_itself(calc_model_dir, tokenizer):
    leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(), "local", TIMEOUT_S)
    try:
        leader.set_optimizer(1e-3)
        fail_on(leader.ranks[0])
        t0 = time.monotonic()
        with pytest.raises(RunError) as e:
            leader.sft_step(batch_of(tokenizer), 2)
        assert time.monotonic() - t0 < TIMEOUT_S / 4
        assert str(e.value) == ("trainer rank 1 failed (AttributeError: 'NoneType' object has "
                                "no attribute 'loss_mask') during sft_step")
    finally:
        leader.close()


class DiesWhenLoaded(torch.nn.Linear):
    """A model whose copy kills the process that loads it (a rank dying during start)."""

    def __reduce__(self):
        return os._exit, (3,)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_rank_that_dies_during_start_fails_it_at_once_naming_it():
    """Rank 0 waits for the others to reach the process group watching that they live: the
    start fails in one line when rank 1 dies, not after train.rank_timeout_s."""
    t0 = time.monotonic()
    with pytest.raises(RunError) as e:
        start_ranks(DiesWhenLoaded(2, 2), 2, TrainerOptions(), "local", 60.0)
    assert time.monotonic() - t0 < 20
    assert str(e.value) == "trainer rank 1 died during start: exit code 3"


def hung_rank_step_and_close(leader, hang, tokenizer, caplog) -> str:
    """`hang()` makes rank 1 of `leader` hang (alive, not answering) in the next step: rank
    0's collective times out at train.rank_timeout_s (2 s here) and the step fails in one line
    naming the rank, the step and the setting, not with gloo's bare timeout; close kills the
    rank still in the call at once (under 5 s, logged) rather than waiting STOP_TIMEOUT_S.
    The step's error."""
    try:
        leader.set_optimizer(1e-3)
        _set_pg_timeout(timedelta(seconds=2))  # rank 0's side of the collectives, as the
        leader.timeout_s = 2.0  # setting would make it, without a 2 s start
        hang()
        with pytest.raises(RunError) as e:
            leader.sft_step(batch_of(tokenizer), 2)
        said = str(e.value)
        assert said.startswith(
            "trainer rank(s) [1] did not take part in sft_step within train.rank_timeout_s=2 "
            "(alive, not answering; ") and "\n" not in said
    finally:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tiller.train.distributed"):
            leader.close()
        closed_s = time.monotonic() - t0
    assert closed_s < 5, closed_s
    assert "closing: 1 trainer rank(s) [1] still in a call rank 0 has left: killed" in [
        r.getMessage() for r in caplog.records]
    return said


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_hung_rank_is_named_and_killed_at_close(calc_model_dir, tokenizer, caplog):
    """Rank 1 in a spawned process, stopped (SIGSTOP) in a step: `hung_rank_step_and_close`;
    the error quotes gloo's timeout, and the rank's process is gone after close."""
    leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(), "local", TIMEOUT_S)
    said = hung_rank_step_and_close(
        leader, lambda: os.kill(leader.ranks[0].proc.pid, signal.SIGSTOP), tokenizer, caplog)
    assert "Timed out" in said and not leader.ranks[0].proc.is_alive()
