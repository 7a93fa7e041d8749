"""Training: batches, the trainer (SFT and policy-gradient steps), the PPO critic, reward
shaping and judges; the algorithm library it calls is its own box, `tiller.algorithms`.

This package is also the API's `tiller.train(config_or_path, **overrides)` (tiller.api.train):
Python sets `tiller.train` to this package whenever a module under it is imported, so a plain
function of that name in tiller/__init__.py would be replaced by the package; calling the
package instead runs the API function.
"""

import sys
from types import ModuleType
from typing import Any


class _CallablePackage(ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from tiller.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
