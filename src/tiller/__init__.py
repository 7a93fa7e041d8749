"""tiller: reinforcement learning for multi-turn, tool-using LLM agents.

`tiller.train(config_or_path, **overrides)` and `tiller.Trainer(...).train()` (tiller.api) are
loaded on first use, so `import tiller` stays fast and imports no torch. This module imports
nothing at all: `python -m tiller` runs it while the current folder is still on the import path
(tiller/__main__.py takes it off).
"""

__version__ = "0.1.0"
__all__ = ["Trainer", "train"]


def __getattr__(name: str) -> object:
    if name == "Trainer":
        from tiller.api import Trainer

        return Trainer
    if name == "train":  # the package tiller.train is callable: it runs tiller.api.train
        import tiller.train

        return tiller.train
    raise AttributeError(f"module 'tiller' has no attribute {name!r}")
