"""tiller: reinforcement learning for multi-turn, tool-using LLM agents.

`tiller.Trainer(...).train()` and `tiller.Trainer.from_config(config_or_path, **overrides)
.train()` (tiller.api) are loaded on first use, so `import tiller` stays fast and imports no
torch. This module imports nothing at all: `python -m tiller` runs it while the current folder
is still on the import path (tiller/__main__.py takes it off).
"""

__version__ = "0.1.0"
__all__ = ["Trainer"]


def __getattr__(name: str) -> object:
    if name == "Trainer":
        from tiller.api import Trainer

        return Trainer
    raise AttributeError(f"module 'tiller' has no attribute {name!r}")
