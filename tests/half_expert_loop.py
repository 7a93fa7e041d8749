"""An agent loop for tests that need a policy that sometimes succeeds: odd samples are played by
the env's scripted expert, even ones by the policy, both through tiller's own loop.

Name it as `agent.loop: half_expert_loop:run_episode` (with tests/ importable). The expert's
tokens are stamped with the engine's current weight version, as if the policy had sampled
them, so that RL trains on them rather than filtering them as stale.
"""

from dataclasses import dataclass, replace

from tiller.rollout.agent_loop import EngineActor, ExpertActor
from tiller.rollout.agent_loop import run_episode as tiller_episode


@dataclass
class OnPolicyExpert:
    expert: ExpertActor
    policy: EngineActor

    async def act(self, prompt_ids, messages, seed, session_id=None):
        gen = await self.expert.act(prompt_ids, messages, seed, session_id)
        version = self.policy.engine.version
        return replace(gen, version=version, versions=(version,) * len(gen.token_ids))


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    if sample_index % 2:
        actor = OnPolicyExpert(ExpertActor(type(env), task, tokenizer), actor)
    return await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)
