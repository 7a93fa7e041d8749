"""A trainer rank whose step fails while rank 0 waits in a collective: rank 0's wait ends at
once (the failed rank leaves the process group), not at train.rank_timeout_s, and the step
fails in one line naming the rank and its error. (Its own group: one per process, and
tests/test_distributed.py's lives for its whole module.)"""

import os
import time

import pytest
import torch
from test_distributed import batch_of

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
