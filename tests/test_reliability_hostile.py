"""The battery's issue-28 sections on the tiny text model, and their negative controls.

Timing and RSS verdicts are measurements (scripts/reliability.py writes them to
results/reliability/); here only what cannot depend on the machine's load is asserted: every
hostile upload gets a typed code, the text bound holds, no session comes back stale. The
controls break the server on purpose (a restore that keeps its buffers, a tokenizer holding
the GIL) and check that the section's own verdict fails, by a margin no load can close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from inference_engine.model.loader import load_model
from inference_engine.runtime import snapshot_intake
from inference_engine.runtime.engine import Engine
from inference_engine.session.snapshot_format import encode, read_head
from inference_engine.text.codec import TextCodec
from tests.ops_helpers import serving
from tests.test_reliability import tiny_model_dir  # noqa: F401 - a fixture
from tests.test_snapshot_format import _snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the battery's package

from reliabilitykit.full_disk import DiskPlan, run_full_disk  # noqa: E402
from reliabilitykit.hostile_restores import MIB, RestorePlan, forged, run_hostile_restores  # noqa: E402
from reliabilitykit.text_stall import StallPlan, run_text_stall  # noqa: E402


def _own_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def text_engine(tiny_model_dir):  # noqa: F811 - the fixture imported above
    e = Engine(load_model(tiny_model_dir), exact=True, max_tile=16, plain_block=64, max_rollback=8)
    yield e
    e.close()


def test_forged_heads_declare_what_is_sent():
    real = encode(_snapshot())
    for size in (MIB, 64 * MIB, 1000 * MIB):
        assert 0 <= size - read_head(forged(real, size)).total_bytes < 4


PLAN = RestorePlan(uploads=2, upload_bytes=48 * MIB, rss_tolerance=0.02, settle_s=0.5)


async def test_hostile_restores_are_typed(tiny_engine):
    async with serving(tiny_engine) as served:
        report = await run_hostile_restores(served.channel(), _own_rss, PLAN)
    codes = report.numbers["codes"]
    assert not [f for f in report.failures if "typed" in f or "refused with" in f], report.failures
    assert sum(codes.values()) == 4 and "INVALID_ARGUMENT" in codes, codes


async def test_hostile_restores_catch_kept_buffers(tiny_engine, monkeypatch):
    kept = []

    def keep(self):  # the defect: a failed restore's buffer stays referenced
        if self._buffer is not None:
            kept.append(self._buffer)

    monkeypatch.setattr(snapshot_intake.SnapshotIntake, "release", keep)
    async with serving(tiny_engine) as served:
        report = await run_hostile_restores(served.channel(), _own_rss, PLAN)
    assert kept and not report.passed
    assert any("RSS after the failed uploads" in f for f in report.failures), report.failures


async def test_text_stall_bound_and_its_control(text_engine, monkeypatch):
    plan = StallPlan(max_text_chars=4096, new_tokens=48)
    async with serving(text_engine, max_text_chars=plan.max_text_chars) as served:
        report = await run_text_stall(served.channel(), served.target, plan)
        assert report.numbers["tokenize_calls_beside"] >= 1 and report.numbers["largest_tokenize"]["tokens"] > 0
        assert not [f for f in report.failures if "--max-text-chars" in f or "tokenizer" in f], report.failures

        def holding_the_gil(self, text, add_special_tokens=False):  # the bindings' plain encode, slowed
            for _ in range(20):  # ~20 encodes per call: far longer than any gap the tiny model streams at
                ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
            return list(ids)

        monkeypatch.setattr(TextCodec, "encode", holding_the_gil)
        broken = await run_text_stall(served.channel(), served.target, dataclasses.replace(plan, max_ratio=3.0))
    assert not broken.passed and any("worst gap beside" in f for f in broken.failures), broken.failures


async def test_full_disk_section(tiny_model_dir, tmp_path):  # noqa: F811
    report = await run_full_disk(["--model", str(tiny_model_dir)], tmp_path, DiskPlan(sessions=3, appends=2,
                                                                                         disk_mib=4))
    if report.failures and "a tmpfs can be mounted" in report.failures[0]:
        pytest.skip(f"cannot mount a tmpfs here: {report.failures[0]}")
    n = report.numbers
    assert report.passed, (report.failures, json.dumps(n))
    assert n["restored_stale"] == 0 and n["restored_current"] + n["dropped"] == 3 and n["dropped"] == 3
    await asyncio.sleep(0)
