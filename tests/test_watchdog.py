"""The hang watchdog (conftest.TEST_TIMEOUT_S): a hung test ends the run with its name and every
thread's stack on the run's stderr, its teardowns run, instead of holding CI until its own limit."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_hung_test_ends_the_run_naming_itself(tmp_path):
    mark = tmp_path / "teardown"
    env = {**os.environ, "INFERENCE_ENGINE_TEST_TIMEOUT_S": "2", "COVERAGE_PROCESS_START": "",
           "HANGING_TEARDOWN_MARK": str(mark)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:cov",
                          "tests/fixtures/hanging_module.py"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0, (run.stdout[-2000:], run.stderr[-2000:])
    assert "[watchdog] tests/fixtures/hanging_module.py::test_that_hangs still running after 2 s" in run.stderr
    assert "in test_that_hangs" in run.stderr  # the hung test's own frame is among the stacks
    assert mark.read_text() == "teardown ran"  # interrupted, not killed: the fixture's teardown ran
    assert "exiting" not in run.stderr  # the run stopped on the interrupt, within the grace
