"""The llama.cpp arms of scripts/bench_openai.py and scripts/compare_llama_cpp.py: an arm that cannot run is
recorded with the reason (never ends the run), and the ratios and agreement are computed from what was measured."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_openai  # noqa: E402
import compare_llama_cpp  # noqa: E402


@pytest.fixture
def broken_python(tmp_path: Path) -> Path:
    """TEST FIXTURE: an 'interpreter' of a virtualenv without llama-cpp-python (it fails as python would)."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'llama_cpp'\" >&2\nexit 1\n")
    path.chmod(0o755)
    return path


def test_a_missing_peer_interpreter_is_a_skipped_arm_with_the_reason(tmp_path, broken_python):
    assert "no --llama-cpp-python given" in bench_openai.llama_cpp_unavailable(None)
    assert bench_openai.llama_cpp_unavailable(tmp_path / "nope") == f"unavailable: --llama-cpp-python {tmp_path}/nope" \
                                                                     " does not exist"
    why = bench_openai.llama_cpp_unavailable(broken_python)
    assert why.startswith(f"unavailable: {broken_python} cannot import llama_cpp.server") and "llama_cpp'" in why
    assert compare_llama_cpp.run_llama_cpp(None, {}).startswith("skipped: no --llama-cpp-python given")
    assert compare_llama_cpp.run_llama_cpp(tmp_path / "nope", {}) == f"skipped: --llama-cpp-python {tmp_path}/nope " \
                                                                      "does not exist"
    failed = compare_llama_cpp.run_llama_cpp(broken_python, {"gguf": "m.gguf"})
    assert failed.startswith("unavailable: llama.cpp exited with status 1") and "No module named" in failed


def _engine(turn1: float, turn8: float, one: float, eight: float, seeded: int = 8) -> dict:
    return {"chat": {"turn1_ms": turn1, "turn8_ms": turn8}, "seeded": {"equal_to_solo": seeded},
            "throughput": {"one_client_tok_s": one, "eight_clients_tok_s": eight}}


def test_ratios_and_goals_cover_the_measured_peers_only():
    engines = {"ours": _engine(300, 150, 12, 60), "mlx_lm": _engine(400, 400, 13, 20),
               "llama_cpp": _engine(250, 100, 60, 30)}
    ratios, goals = bench_openai.ratios_and_goals(engines)
    assert ratios["llama_cpp"] == {"ttft_turn1_ours_over_peer": 1.2, "ttft_turn8_ours_over_peer": 1.5,
                                   "one_client_ours_over_peer": 0.2, "eight_clients_ours_over_peer": 2.0}
    assert ratios["mlx_lm"]["ttft_turn8_ours_over_peer"] == 0.38
    assert goals == {"turn8_le_1.5x_turn1": True, "seeded_8_of_8": True, "turn8_le_0.5x_mlx_lm": True,
                     "turn8_le_1.0x_llama_cpp": False, "eight_clients_ge_2.5x_best_peer_llama_cpp": False}
    engines["llama_cpp"] = "unavailable: no --llama-cpp-python given"
    ratios, goals = bench_openai.ratios_and_goals(engines)
    assert list(ratios) == ["mlx_lm"] and goals["eight_clients_ge_2.5x_best_peer_mlx_lm"] is True
    assert "turn8_le_1.0x_llama_cpp" not in goals


def test_agreement_and_decode_speed():
    assert compare_llama_cpp.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == {
        "common_prefix": 2, "positions_equal": 3, "compared": 4, "fraction_equal": 0.75}
    assert compare_llama_cpp.agreement([1, 2], [1, 2, 3])["common_prefix"] == 2
    assert compare_llama_cpp.decode_tok_s([1.0, 1.5, 2.0]) == 2.0 and compare_llama_cpp.decode_tok_s([1.0]) is None
    ours = {"greedy": [{"tokens": [5, 6, 7], "text": "abc", "times": [0.1, 0.2, 0.3]}],
            "decode_tok_s": 10.0, "prefill_tok_s": 100.0}
    peer = {"version": "0.3.36", "system_info": "AVX2 = 1", "tokenized": [[2, 9]], "prefill_s": [0.5, 1.0, 2.0],
            "greedy": [{"tokens": [5, 6, 8], "times": [0.1, 0.15, 0.2]}]}
    got = compare_llama_cpp.compare(ours, peer, ["p"], [[2, 9]], 50)
    assert got["prompts"][0]["tokenization_equal"] and got["prompts"][0]["common_prefix"] == 2
    assert (got["tokens_equal"], got["prompts_identical"]) == ("2/3", "0/1")
    assert got["llama_cpp"]["decode_tok_s"] == 20.0 and got["llama_cpp"]["prefill_tok_s"] == 50.0
    assert (got["decode_ours_over_llama_cpp"], got["prefill_ours_over_llama_cpp"]) == (0.5, 2.0)
    skipped = compare_llama_cpp.compare(ours, "skipped: why", ["p"], [[2, 9]], 50)
    assert skipped == {"llama_cpp": "skipped: why", "prompts": [{"prompt": "p", "ours_text": "abc",
                                                                 "ours_tokens": [5, 6, 7]}]}
