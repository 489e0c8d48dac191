"""The launcher's re-exec and the shard workers it spawns run this copy of the package, never the current folder's."""

import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from inference_engine import launch
from inference_engine.version import VERSION

REPO = Path(__file__).resolve().parents[1]
DECOY = "import sys; print('DECOY RAN'); sys.exit(3)\n"


def _decoy_folder(tmp_path: Path) -> Path:
    """A folder holding another `inference_engine/` (a checkout, a copy): `python -m` there would run it."""
    pkg = tmp_path / "inference_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(DECOY)
    return tmp_path


def test_module_command_runs_with_safe_path_and_names_this_copy(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    argv, env = launch.module_command("serve", "--port", "0")  # this copy is a checkout
    assert argv == [sys.executable, "-P", "-m", "inference_engine", "serve", "--port", "0"]
    assert env["PYTHONPATH"] == f"{REPO}{os.pathsep}/elsewhere"  # the checkout first, then what was there
    monkeypatch.setattr(launch, "PACKAGE_ROOT", Path(sysconfig.get_paths()["purelib"]).resolve())  # installed
    assert launch.module_command()[1]["PYTHONPATH"] == "/elsewhere"  # found there by the child itself


def test_the_launcher_reexec_runs_this_copy_from_a_folder_holding_another(tmp_path):
    cwd = _decoy_folder(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "INFERENCE_ENGINE_BLAS_REEXEC")}
    env["PYTHONPATH"] = str(REPO)  # this copy, found the way an installed one is (not as the current folder)
    decoy = subprocess.run([sys.executable, "-m", "inference_engine", "--version"], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=120)
    assert decoy.returncode == 3 and "DECOY RAN" in decoy.stdout  # what an unsafe re-exec would have run
    done = subprocess.run([sys.executable, "-P", "-m", "inference_engine", "prepare-model"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "DECOY" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.stdout.strip().endswith("smollm2-135m/q4")  # the re-executed process (OpenBLAS preloaded) ran


def test_version_everywhere_agrees_with_pyproject():
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == VERSION
    for command in ([], ["chat"], ["generate"], ["serve"], ["shard-worker"], ["models"], ["prepare-model"]):
        out = subprocess.run([sys.executable, "-m", "inference_engine", *command, "--version"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stdout) == (0, f"inference_engine {VERSION}\n"), (command, out.stderr)
