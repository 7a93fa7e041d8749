"""An agent loop for tests that need a policy that sometimes succeeds: odd samples are played by
the env's scripted expert, even ones by the policy, both through tiller's own loop.

Name it as `agent.loop: half_expert_loop:run_episode` (with tests/ importable). The expert's
tokens are stamped with the engine's current weight version, as if the policy had sampled
them, so that RL trains on them rather than filtering them as stale. Sample 3 words its
final answer differently from sample 1 (still correct), so a judge can score the two apart.
"""

from dataclasses import dataclass, replace

from tiller.rollout.agent_loop import EngineActor, ExpertActor
from tiller.rollout.agent_loop import run_episode as tiller_episode

REWORDED = "I checked each step, so the answer is {}."


@dataclass
class OnPolicyExpert:
    expert: ExpertActor
    policy: EngineActor
    sample_index: int

    async def act(self, prompt_ids, messages, seed, session_id=None):
        gen = await self.expert.act(prompt_ids, messages, seed, session_id)
        text = self.expert.tokenizer.decode(gen.token_ids[:-1])
        if self.sample_index == 3 and text.startswith("The answer is "):
            ids = self.expert.tokenizer.encode(
                REWORDED.format(text.removeprefix("The answer is ").rstrip(".")),
                add_special_tokens=False)
            gen = replace(gen, token_ids=[*ids, gen.token_ids[-1]],
                          logprobs=[0.0] * (len(ids) + 1))
        version = self.policy.engine.version
        return replace(gen, version=version, versions=(version,) * len(gen.token_ids))


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    if sample_index % 2:
        actor = OnPolicyExpert(ExpertActor(type(env), task, tokenizer), actor, sample_index)
    return await tiller_episode(env, task, actor, tokenizer, seed=seed, limits=limits,
                                sample_index=sample_index)


def tempting_judge(task, trajectory):
    """A judge that likes the policy's (wrong) answers best: 1.0 for every even sample, 0.2
    and 0.6 for the expert's samples 1 and 3. Paying it on failures would reverse the ranking
    the verifier gives."""
    return 1.0 if trajectory.sample_index % 2 == 0 else 0.2 * trajectory.sample_index
