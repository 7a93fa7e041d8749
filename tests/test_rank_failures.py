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


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_hung_rank_is_named_and_killed_at_close(calc_model_dir, tokenizer, caplog):
    """Rank 1 alive but not answering (SIGSTOP) in a step: rank 0's collective times out at
    train.rank_timeout_s and the step fails in one line naming the rank, the step and the
    setting, not with gloo's bare timeout; close kills the rank still in the call at once
    rather than waiting STOP_TIMEOUT_S for it to read the stop."""
    leader = start_ranks(load_model(calc_model_dir), 2, TrainerOptions(), "local", TIMEOUT_S)
    try:
        leader.set_optimizer(1e-3)
        _set_pg_timeout(timedelta(seconds=2))  # rank 0's side of the collectives, as the
        leader.timeout_s = 2.0  # setting would make it, without a 2 s start
        os.kill(leader.ranks[0].proc.pid, signal.SIGSTOP)
        with pytest.raises(RunError) as e:
            leader.sft_step(batch_of(tokenizer), 2)
        assert str(e.value).startswith(
            "trainer rank(s) [1] did not take part in sft_step within train.rank_timeout_s=2 "
            "(alive, not answering; ")
        assert "Timed out" in str(e.value) and "\n" not in str(e.value)
    finally:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tiller.train.distributed"):
            leader.close()
        closed_s = time.monotonic() - t0
    assert closed_s < 5, closed_s
    assert not leader.ranks[0].proc.is_alive()
    assert [r.getMessage() for r in caplog.records if "closing" in r.getMessage()] == [
        "closing: 1 trainer rank(s) [1] still in a call rank 0 has left: killed"]
