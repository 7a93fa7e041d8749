"""An agent written against the official `openai` SDK, trained by tiller through its gateway
(`agent.program: openai_agent.agent:main`; see agent.py and docs/gateway.md)."""
