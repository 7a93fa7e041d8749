"""tiller's agent loop with a seeded, heavy-tailed wait around each episode, so episode
lengths vary the way agent episodes do whatever the policy does (the tiny test policies rarely
call a tool, so tool latency alone would not slow them). Name it as
`agent.loop: slow_loop:run_episode`; tests set `SLOW` first. Half of the wait comes before the
episode and half after it, so a group can finish well after its tokens were sampled."""

import asyncio
import random
import time

from tiller.rollout.agent_loop import run_episode as tiller_episode

# prob: share of slow episodes, drawn from the episode's seed; or pattern: which episodes,
# in start order (cycled), are slow
SLOW = {"prob": 0.3, "slow_s": 0.2, "fast_s": 0.001, "pattern": None, "started": 0}


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    pattern, n = SLOW["pattern"], SLOW["started"]
    SLOW["started"] += 1
    slow = pattern[n % len(pattern)] if pattern else random.Random(seed).random() < SLOW["prob"]
    wait = SLOW["slow_s"] if slow else SLOW["fast_s"]
    await asyncio.sleep(wait / 2)
    traj = await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)
    await asyncio.sleep(wait / 2)
    return traj


# the judge's calls so far, and from which call on it takes `slow_s` seconds
JUDGE = {"calls": 0, "slow_from": 8, "slow_s": 3.0}


def slow_judge(task, trajectory):
    """rl.judge.fn that takes JUDGE["slow_s"] from call JUDGE["slow_from"] on: a model judge's
    cost, so that the end of RL finds a group being judged."""
    JUDGE["calls"] += 1
    if JUDGE["calls"] > JUDGE["slow_from"]:
        time.sleep(JUDGE["slow_s"])
    return 0.5
