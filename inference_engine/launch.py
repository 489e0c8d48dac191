"""How this package starts another Python process running itself (the BLAS re-exec, shard workers).

`python -m inference_engine` puts the current folder first on `sys.path`: started from a
checkout, or from any folder holding an `inference_engine/` directory, the child would run that
folder's code instead of the copy the parent runs. The child is therefore started with `-P`
(Python 3.11: no unsafe path first), and when the parent's copy is not an installed one (a
checkout) that copy's parent folder goes first on PYTHONPATH. Either way the child imports
exactly the files the parent imported.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the folder holding this copy of inference_engine/


def _is_installed(folder: Path) -> bool:
    """`folder` is a site-packages folder of this interpreter: a child finds the package there by itself."""
    paths = sysconfig.get_paths()
    return folder in {Path(p).resolve() for p in (paths["purelib"], paths["platlib"], *site.getsitepackages())}


def module_command(*args: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run `python -m inference_engine ARGS` with this very copy of the package.

    Returns:
        (argv starting with sys.executable and -P, a copy of os.environ with PYTHONPATH set where needed).
    """
    env = dict(os.environ)
    if not _is_installed(PACKAGE_ROOT):  # a checkout: name it (sys.path edits are not inherited)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-P", "-m", "inference_engine", *args], env
