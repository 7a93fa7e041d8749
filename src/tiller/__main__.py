"""`python -m tiller`: the CLI, without the current folder on the import path.

`python -m` puts the current folder first on `sys.path`, so a module file there (a run
folder's `yaml.py`, say) would be imported in place of the real one. It comes off before
anything else is imported (tiller/__init__.py imports nothing), as `python -P` does; the
`tiller` console script never had it. Python's own start-up still reads that folder before
tiller runs (a file named `importlib.py` there breaks it), so in a folder you do not trust run
`tiller` or `python -P -m tiller` (docs/evaluation.md).
"""

import os
import sys

if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from tiller.cli import main  # noqa: E402 (after the path is cleaned)

main()
