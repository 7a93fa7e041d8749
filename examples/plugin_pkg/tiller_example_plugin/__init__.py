"""An example tiller plug-in, outside tiller: `PairSumEnv` (envs.py) and its tools (tools.py)."""
