#!/usr/bin/env python3
"""Profile of issue 28's hostile restores: what stays resident in the server after they fail.

    .venv/bin/python scripts/profile_restore_rss.py --out results/reliability/profile-restore-rss.json
    MALLOC_ARENA_MAX=2 .venv/bin/python scripts/profile_restore_rss.py ...   # an allocator setting, for comparison

Runs the battery's hostile_restores section (4 + 4 concurrent ~1 GB uploads) against a real
`serve` process and reads its /proc/PID/smaps before and after: resident bytes by mapping
([heap], anonymous mappings: glibc's thread arenas are the 64 MiB-aligned ones, libraries),
the anonymous mappings that grew most, and, with --gdb, glibc's per-arena statistics and the RSS
after a `malloc_trim(0)` called inside the server (what the allocator could still give back).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inference_engine.security.credentials import open_channel  # noqa: E402
from reliabilitykit.hostile_restores import RestorePlan, run_hostile_restores  # noqa: E402
from reliabilitykit.server_process import ServerProcess  # noqa: E402

MIB = 1 << 20
ARENA_ALIGN = 64 * MIB  # glibc's non-main heaps are aligned to their 64 MiB maximum size


def smaps(pid: int) -> tuple[dict[str, int], dict[int, tuple[int, int]]]:
    """Resident bytes by mapping kind, and every anonymous mapping's (resident, size) by start address."""
    kinds: collections.Counter = collections.Counter()
    anon: dict[int, tuple[int, int]] = {}
    start = size = 0
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            start, size, name = lo, hi - lo, parts[5] if len(parts) > 5 else ""
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
            if not name:
                kinds["anonymous: arena (64 MiB aligned)" if start % ARENA_ALIGN == 0 else "anonymous: other"] += rss
                anon[start] = (rss, size)
            else:
                kinds[name if name.startswith("[") else "files and libraries"] += rss
    return dict(kinds), anon


def _mib(n: float) -> float:
    return round(n / MIB, 1)


async def main(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = await ServerProcess.start(["--max-sessions", "16", "--grace", "3"], Path(tmp) / "server.log")
        readings = []

        def rss() -> int:
            readings.append(smaps(server.pid))
            return server.rss()

        channel = open_channel(server.target)
        try:
            report = await run_hostile_restores(channel, rss, RestorePlan())
        finally:
            await channel.close()
        (k0, a0), (k1, a1) = readings[0], readings[-1]
        out = {"hostile_restores": report.numbers, "failures": report.failures,
               "env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
               "load_average": [round(x, 2) for x in os.getloadavg()],
               "resident_mib_by_kind": {k: {"before": _mib(k0.get(k, 0)), "after": _mib(k1.get(k, 0))}
                                        for k in sorted(set(k0) | set(k1))},
               "anonymous_grown_most": [
                   {"address": hex(a), "arena": a % ARENA_ALIGN == 0, "resident_mib_before": _mib(a0.get(a, (0, 0))[0]),
                    "resident_mib_after": _mib(r), "size_mib": _mib(s)}
                   for a, (r, s) in sorted(a1.items(), key=lambda kv: a0.get(kv[0], (0, 0))[0] - kv[1][0])[:6]]}
        if args.gdb:
            before = server.rss()
            subprocess.run(["gdb", "-p", str(server.pid), "-batch", "-ex", "call (void)malloc_stats()",
                            "-ex", "call (int)malloc_trim(0)"], capture_output=True, text=True, check=False)
            log = (Path(tmp) / "server.log").read_text(errors="replace")
            arenas = re.findall(r"Arena (\d+):\nsystem bytes\s+=\s+(\d+)\nin use bytes\s+=\s+(\d+)", log)
            out["glibc_arenas"] = [{"arena": int(a), "system_mib": _mib(int(s)), "in_use_mib": _mib(int(u))}
                                   for a, s, u in arenas]
            out["rss_mib_around_gdb_malloc_trim"] = {"before": _mib(before), "after": _mib(server.rss())}
        await server.stop()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON path")
    parser.add_argument("--gdb", action="store_true", help="attach gdb: glibc's arena statistics, malloc_trim inside")
    args = parser.parse_args()
    data = asyncio.run(main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data["hostile_restores"]["rss_mib"]), data["hostile_restores"]["after_vs_before"])
