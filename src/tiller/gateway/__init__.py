"""The agent gateway: black-box agent programs (written against the `openai` client or any HTTP
client) run unmodified against an OpenAI-compatible endpoint in the training process, and every
call they make becomes part of an exact token-in-token-out trajectory. `session` assembles a
session's calls into a trajectory, `server` is the HTTP side, `program` the `agent.program`
episode. See docs/gateway.md."""
