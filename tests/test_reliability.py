"""The reliability battery of issue 15 in its bounded form, against real servers, and its negative controls.

`scripts/reliability.py --quick` runs against a real `serve` process (a tiny random llama
with the packaged tokenizer, so text, chat and stop strings are exercised): bad input,
cancels, fuzz, traffic with the process's RSS, SIGTERM. The security section runs against
in-process servers with TLS, tokens and mTLS. The controls break the server on purpose and
check that the battery fails.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from inference_engine.runtime.job import Phase
from inference_engine.runtime.jobs import AppendJob
from inference_engine.runtime.session_transfer import SessionRestored, SessionTransfer
from inference_engine.security.settings import ServerSecurity
from inference_engine.server.validation import Validator
from tests.certs import TOKEN_A, TOKEN_B, token_file
from tests.ops_helpers import serving
from tests.tiny_text_model import write_tiny_text_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the battery's package

from reliabilitykit import bad_input, cancels, fuzz  # noqa: E402
from reliabilitykit.battery import guarded  # noqa: E402
from reliabilitykit.outcomes import Outcome, outcome_of, typing_problem  # noqa: E402
from reliabilitykit.report import SectionReport, battery_json  # noqa: E402
from reliabilitykit.security_checks import SecuredTargets, run_security  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Path:
    """An mlx-lm folder: a 2-layer random llama over the packaged model's tokenizer (its vocabulary)."""
    return write_tiny_text_model(tmp_path_factory.mktemp("tiny-text-model"), real_model_path)


def test_quick_battery_against_a_served_process(tiny_model_dir, tmp_path):
    out = tmp_path / "quick.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "reliability.py"), "--quick", "--model", str(tiny_model_dir),
         "--sections", "bad_input,cancels,fuzz,traffic,shutdown", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["passed"] and data["failed"] == 0 and "--quick" in data["command"]
    s = data["sections"]
    assert list(s) == ["bad_input", "cancels", "fuzz", "traffic", "shutdown"]
    assert all(section["passed"] and section["checks"] > 0 for section in s.values())
    assert s["bad_input"]["numbers"]["rows"] > 100
    assert s["cancels"]["numbers"]["trials"] == 24
    assert set(s["fuzz"]["numbers"]["examples"]) >= {"AppendTokens", "Generate", "raw bytes"}
    assert len(s["traffic"]["numbers"]["rss_mib"]["after_rounds"]) == 3
    assert not [code for code in s["traffic"]["numbers"]["codes"] if code.endswith(("UNKNOWN", "INTERNAL"))]
    assert s["shutdown"]["numbers"]["exit_status"] == 0 and data["server"]["exit_status"] == 0


async def test_security_section(tiny_engine, pki, tmp_path):
    tls = dict(tls_cert=pki.server.cert, tls_key=pki.server.key)
    tokens = ServerSecurity(**tls, auth_token_file=token_file(tmp_path, TOKEN_A, TOKEN_B))
    async with serving(tiny_engine, tokens) as with_tokens, serving(tiny_engine, ServerSecurity(
            **tls, tls_client_ca=pki.ca)) as with_certs:
        report = await run_security(SecuredTargets(
            with_tokens.target, with_certs.target, pki.ca, pki.other_ca, TOKEN_A, TOKEN_B,
            (pki.client_a.cert, pki.client_a.key), (pki.client_b.cert, pki.client_b.key)))
    assert report.passed, report.failures
    assert report.checks >= 40


# -- negative controls: a battery that cannot fail is a defect ----------------------------------------------


async def test_bad_input_catches_an_untyped_error(tiny_engine, monkeypatch):
    def broken(self, field, value):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(Validator, "real", broken)
    async with serving(tiny_engine) as served:
        report = await bad_input.run_bad_input(served.channel())
    assert not report.passed
    assert any("INTERNAL is never a valid answer" in f for f in report.failures), report.failures


async def test_cancels_catch_a_partial_append(tiny_engine, monkeypatch):
    def keep_what_was_fed(self, exc):  # the defect of issue 15: an abandoned append stays half-committed
        self.phase = Phase.DONE
        self._settle(None, exc or asyncio.CancelledError())
        self._loop.call_soon_threadsafe(lambda: self.finished.done() or self.finished.set_result(None))

    monkeypatch.setattr(AppendJob, "abort", keep_what_was_fed)
    async with serving(tiny_engine, max_sessions=16) as served:
        report = await cancels.run_cancels(served.channel(), cancels.CancelPlan(trials=24, clients=2, append_tokens=400,
                                                                                seed=3))
    assert not report.passed
    assert any("whole or absent" in f or "client's view" in f for f in report.failures), report.failures


async def test_fuzz_catches_an_untyped_error(tiny_engine, monkeypatch):
    def broken(self, field, values):
        raise KeyError(field)

    monkeypatch.setattr(Validator, "strings", broken)
    async with serving(tiny_engine, max_sessions=8) as served:
        report = await asyncio.to_thread(fuzz.run_fuzz, served.target, fuzz.FuzzPlan(examples=10, shrink=False))
    assert not report.passed
    assert any(f.startswith("Generate: the property holds") and "INTERNAL" in f for f in report.failures), report.failures



async def test_fuzz_catches_a_fork_that_misreports(tiny_engine, monkeypatch):
    def lying(session, snap):  # the reply promises a state the new session does not hold
        return SessionRestored(session.session_id, snap.history_length + 1, snap.state_digest, session.sink,
                               session.window)

    monkeypatch.setattr(SessionTransfer, "_restored", staticmethod(lying))
    async with serving(tiny_engine, max_sessions=8) as served:
        report = await asyncio.to_thread(fuzz.run_fuzz, served.target, fuzz.FuzzPlan(examples=10, shrink=False))
    assert not report.passed
    assert any(f.startswith("SnapshotSession/ForkSession: the property holds") and "its reply said" in f
               for f in report.failures), report.failures

# -- units ------------------------------------------------------------------------------------------------------


def test_typing_problems():
    assert typing_problem(Outcome("OK")) == "" and typing_problem(Outcome("CANCELLED_BY_CLIENT")) == ""
    assert typing_problem(Outcome("DEADLINE_EXCEEDED", "Deadline Exceeded")) == ""  # the client's own deadline
    typed = dict(message="m", domain="inference_engine")
    assert typing_problem(Outcome("NOT_FOUND", reason="SESSION_NOT_FOUND", **typed)) == ""
    assert typing_problem(Outcome("ABORTED", reason="SESSION_BUSY", has_retry_info=True, **typed)) == ""
    problems = {
        "never": Outcome("UNKNOWN", "boom"),
        "internal": Outcome("INTERNAL", "boom", reason="INTERNAL", domain="inference_engine"),
        "untyped": Outcome("NOT_FOUND", "gone"),
        "domain": Outcome("NOT_FOUND", "m", reason="SESSION_NOT_FOUND", domain="elsewhere"),
        "reason": Outcome("NOT_FOUND", reason="SESSION_BUSY", **typed),
        "retry": Outcome("ABORTED", reason="SESSION_BUSY", **typed),
        "empty": Outcome("NOT_FOUND", "", "SESSION_NOT_FOUND", "inference_engine"),
    }
    found = {name: typing_problem(o) for name, o in problems.items()}
    assert all(found.values()), found
    assert "never a valid answer" in found["never"] and "RetryInfo" in found["retry"]
    with pytest.raises(TypeError):
        outcome_of(ValueError("not a call"))
    assert outcome_of(asyncio.CancelledError()).code == "CANCELLED_BY_CLIENT"
    err = grpc.RpcError()
    err.code, err.details, err.trailing_metadata = (lambda: grpc.StatusCode.UNAVAILABLE), (lambda: "down"), (lambda: ())
    assert outcome_of(err) == Outcome("UNAVAILABLE", "down")


async def test_reports_count_and_a_raising_section_fails():
    r = SectionReport("s")
    assert not r.passed  # no check made: nothing passed
    for i in range(50):
        r.check(i % 2 == 0, f"check {i}", "detail")
    r.count("x")
    r.count("x", 2)
    assert (r.checks, r.failed, len(r.failures), r.numbers["x"]) == (50, 25, 20, 3)

    async def boom() -> SectionReport:
        raise RuntimeError("lost the server")

    failed = await guarded("boom", boom())
    assert not failed.passed and "RuntimeError: lost the server" in failed.failures[0]
    data = battery_json([r.finish(), failed], {"plan": "x"})
    assert (data["passed"], data["checks"], data["failed"], list(data["sections"])) == (False, 51, 26, ["s", "boom"])
