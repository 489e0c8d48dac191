"""How this package starts another Python process running itself (the BLAS re-exec, shard workers).

`python -m inference_engine` puts the current folder first on `sys.path`: started from a
checkout, or from any folder holding an `inference_engine/` directory, the child would run that
folder's code instead of the copy the parent runs. The child is therefore started with `-P`
(Python 3.11: no unsafe path first), and when the parent's copy is not on the path anyway (a
checkout run as `python -m` from its own folder) that copy's parent folder goes first on
PYTHONPATH. Either way the child imports exactly the files the parent imported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the folder holding this copy of inference_engine/


def _on_safe_path(folder: Path) -> bool:
    """`folder` is on this process's sys.path other than as the script's or current folder (sys.path[0])."""
    return any(entry and Path(entry).resolve() == folder for entry in sys.path[1:])


def module_command(*args: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run `python -m inference_engine ARGS` with this very copy of the package.

    Returns:
        (argv starting with sys.executable and -P, a copy of os.environ with PYTHONPATH set where needed).
    """
    env = dict(os.environ)
    if not _on_safe_path(PACKAGE_ROOT):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-P", "-m", "inference_engine", *args], env
