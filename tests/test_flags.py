"""serve / shard-worker flags: help with a default for each, ranges named with the value, the packaged model list."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from inference_engine import config as config_mod
from inference_engine.flag_ranges import FlagRange, check_ranges
from inference_engine.model.packaged import DEFAULT_MODEL, PACKAGED_MODELS, resolve_model_path
from inference_engine.shard.worker.config import add_worker_flags, worker_config_from_args

REPO = Path(__file__).resolve().parents[1]


def test_a_flag_range_names_value_and_range():
    assert FlagRange("--a", 3, 1, 5).is_ok() and not FlagRange("--a", 0, 1).is_ok()
    assert FlagRange("--a", 0, 1).allowed() == "1 or more"
    assert FlagRange("--a", 7, 0, 5, "--max-a").allowed() == "0..5 (--max-a)"
    assert not FlagRange("--t", 0, 0, exclusive_low=True).is_ok() and FlagRange("--t", 0.5, 0, exclusive_low=True).is_ok()
    assert FlagRange("--t", 0, 0, exclusive_low=True).allowed() == "more than 0"
    assert FlagRange("--t", 9, 0, 8, exclusive_low=True).allowed() == "more than 0 and at most 8"
    assert FlagRange("--h", 9, None, 8).allowed() == "at most 8" and not FlagRange("--h", 9, None, 8).is_ok()
    check_ranges([FlagRange("--a", 1, 1)])  # in range: nothing raised
    with pytest.raises(ValueError) as err:
        check_ranges([FlagRange("--a", 0, 1), FlagRange("--b", 1, 1), FlagRange("--c", 2.5, 0, 2)])
    assert str(err.value) == "out-of-range flags: --a 0 (allowed: 1 or more); --c 2.5 (allowed: 0..2)"


def test_serve_and_worker_flags_report_value_and_range(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERENCE_ENGINE_CACHE", str(tmp_path))
    serve = argparse.ArgumentParser()
    config_mod.add_server_flags(serve)
    with pytest.raises(ValueError) as err:
        config_mod.config_from_args(serve.parse_args(["--max-sessions", "0", "--default-window", "9000",
                                                      "--session-ttl", "0"]))
    assert str(err.value) == ("out-of-range flags: --max-sessions 0 (allowed: 1 or more); --default-window 9000 "
                              "(allowed: 1..8192 (--max-window)); --session-ttl 0 (allowed: more than 0)")
    with pytest.raises(ValueError, match=r"malformed flags: --spawn-shards '0:x' \(START:END,...\)"):
        config_mod.config_from_args(serve.parse_args(["--spawn-shards", "0:x"]))
    worker = argparse.ArgumentParser()
    add_worker_flags(worker)
    with pytest.raises(ValueError, match=r"^out-of-range flags: --port 70000 \(allowed: 0..65535\)$"):
        worker_config_from_args(worker.parse_args(["--layers", "0:1", "--port", "70000"]))


@pytest.mark.parametrize("command", ["serve", "shard-worker"])
def test_every_flag_has_help_with_its_default(command):
    out = subprocess.run([sys.executable, "-m", "inference_engine", command, "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from inference_engine.__main__ import _server_parsers  # the parser the launcher builds

    parser = argparse.ArgumentParser()
    _server_parsers(parser.add_subparsers(dest="command"))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for action in sub._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        assert "(default: " in action.help % vars(action) or "%(default)" in action.help or \
            issubclass(sub.formatter_class, argparse.ArgumentDefaultsHelpFormatter), action.option_strings
    assert "--max-sessions MAX_SESSIONS" in out.stdout or command == "shard-worker"
    assert "(default: 8)" in out.stdout  # --max-sessions' default, in the text a user reads
    assert "(default: None)" not in out.stdout and "(default: False)" not in out.stdout  # no default, none shown


def test_models_lists_the_packaged_names(capsys):
    from inference_engine.__main__ import main

    assert main(["models"]) == 0  # no re-exec, no model loaded: a list
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == [m.name for m in PACKAGED_MODELS] and DEFAULT_MODEL in lines[0]
    assert "mlx-lm folder" in lines[-1]
    with pytest.raises(ValueError, match=f"unknown packaged model 'packaged:nope'; packaged models: {DEFAULT_MODEL}"):
        resolve_model_path("packaged:nope", Path("/nonexistent-cache"))


def test_exact_at_block_size_1_is_a_degraded_start(tiny, caplog):
    from inference_engine.server.server import build_engine

    engine = build_engine(config_mod.ServerConfig(max_tile=1, draft_model=None), loaded=tiny)
    try:
        assert engine.block == 1
    finally:
        engine.close()
    warning = next(r for r in caplog.records if r.levelname == "WARNING" and "DEGRADED" in r.getMessage())
    assert "exact at block size 1, one token per forward" in warning.getMessage()
    assert "apt-get install g++" in warning.getMessage()
