"""Errors a user can act on. Each message is one line: what went wrong and what to change."""


class RunError(RuntimeError):
    """The run cannot learn (a broken engine, a step with nothing to train, no demonstrations):
    it stops with one line naming the cause instead of finishing without learning."""
