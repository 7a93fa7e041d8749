"""A custom agent loop in about 20 lines, as docs/plugins.md's "Your own agent loop" shows it.

Name it in a config as `agent.loop: custom_loop:run_episode` (with this folder importable).
It has no token budget and lets exceptions propagate; tiller's own loop adds both.
tests/test_custom_loop.py checks that it writes the same tokens as tiller's loop.
"""

from tiller.envs.actions import assistant_message
from tiller.rollout.chat import ChatFormat
from tiller.rollout.trajectory import Status, TrajectoryBuilder
from tiller.seeds import derive_seed


async def run_episode(env, task, actor, tokenizer, *, seed, limits, sample_index=0):
    messages = await env.reset(task, seed)
    try:
        chat = ChatFormat(tokenizer, env.tool_schemas())
        traj = TrajectoryBuilder(task.id, sample_index)
        traj.append_prompt(chat.prompt_ids(messages))
        final, status = None, Status.TRUNCATED
        for turn in range(limits.max_turns):
            gen = await actor.act(traj.token_ids, messages, derive_seed(seed, turn),
                                  session_id=f"{task.id}/{sample_index}/{seed}")
            traj.append_generated(gen.token_ids, gen.logprobs, gen.version)
            parsed = chat.parse(gen.token_ids)
            messages.append(assistant_message(parsed))
            if gen.finish_reason != "stop":  # cut off by max_new_tokens
                break
            result = await env.step(parsed)
            if result.done:
                final, status = parsed, Status.COMPLETED
                break
            traj.append_observation(chat.observation_ids(messages, result.messages))
            messages.extend(result.messages)
        reward = await env.verify(final)
    finally:
        await env.close()
    return traj.finish(reward, status, messages=messages)
