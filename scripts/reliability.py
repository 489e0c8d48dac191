#!/usr/bin/env python3
"""The reliability battery of issue 15 against real `serve` processes; writes JSON under results/reliability/.

    .venv/bin/python scripts/reliability.py            # full: 100 interrupted calls, 8 clients x 3 rounds, ...
    .venv/bin/python scripts/reliability.py --quick    # the bounded form the tests run

Sections (scripts/reliabilitykit/): the bad-input table (every field, raw
corrupt bytes, oversize messages -> typed codes), random client cancels and deadlines
reconciled with a replay, mixed traffic from N clients with the server's RSS between rounds,
SIGTERM mid-stream, TLS/tokens/mTLS/ownership, a hypothesis fuzz of every request, and a rogue
listener on a dead spawned shard worker's port (with a plaintext `--shards` control).
Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the package is used from the checkout

from reliabilitykit.battery import FULL, QUICK, SECTIONS, PkiFiles, run_battery  # noqa: E402
from reliabilitykit.report import write_json  # noqa: E402


def _pki(folder: Path) -> PkiFiles:
    from reliabilitykit.pki import make_pki  # a throwaway CA (cryptography, a dev dependency)

    p = make_pki(folder)
    return PkiFiles(p.ca, p.other_ca, (p.server.cert, p.server.key), (p.client_a.cert, p.client_a.key),
                    (p.client_b.cert, p.client_b.key))


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the bounded form (what CI runs)")
    parser.add_argument("--model", default=None, help="serve --model (default: the packaged model)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice (cancels, traffic, fuzz)")
    parser.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                        help="extra `serve` flag (repeatable; use --serve-flag=--x for a value starting with -)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default results/reliability/<date>-<host>[-quick].json)")
    parser.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                        help="keep the servers' logs here (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    plan = QUICK if args.quick else FULL
    plan = dataclasses.replace(plan, cancels=dataclasses.replace(plan.cancels, seed=args.seed),
                               traffic=dataclasses.replace(plan.traffic, seed=args.seed),
                               fuzz=dataclasses.replace(plan.fuzz, seed=args.seed))
    started = datetime.now(timezone.utc)
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        workdir = args.keep_logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        pki = _pki(workdir) if "security" in sections else None
        data = asyncio.run(run_battery(plan, args.model, workdir, sections, args.serve_flag, pki))
    data = {"date": started.isoformat(timespec="seconds"), "commit": _commit(),
            "command": " ".join(["scripts/reliability.py", *(sys.argv[1:] if argv is None else argv)]), **data}
    out = args.out or REPO / "results" / "reliability" / \
        f"{started:%Y-%m-%d}-{data['host']}{'-quick' if args.quick else ''}.json"
    write_json(out, data)
    for name, s in data["sections"].items():
        print(f"{name:10s} {'PASS' if s['passed'] else 'FAIL'}  {s['checks']} checks, {s['failed']} failed, {s['seconds']} s")
        for failure in s["failures"]:
            print(f"    {failure}")
    print(f"{'PASS' if data['passed'] else 'FAIL'}: {data['checks']} checks, {data['failed']} failed -> {out}")
    return 0 if data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
