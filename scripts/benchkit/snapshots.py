"""Session snapshots measured on a real server process: what a snapshot costs, and a restart.

Every figure is taken through gRPC with a synchronous client, on one server process
(`serve --draft-model none`, the plan's window), against today's only other way back,
replaying the history (AppendTokens of the whole log into a fresh session):

- snapshot: SnapshotSession streamed back, and written under --snapshot-dir (fsync included);
  bytes of the file; RestoreSession from the bytes and from the file; ForkSession; and the
  replay, for a session whose history just passed sink + window (the whole K/V is in use).
  `restore_over_replay` = replay / restore (target >= 10 at window 1024). Every restored
  session's digest is checked against the original's (`identical`).
- restart: 8 sessions persisted with --persist-sessions (the measured one and 7 forks),
  written when the server stops (SIGTERM); then the time from launching a new server to its
  readiness line, against the first launch on an empty folder; the server's own
  "restored N session(s) ... in S s" figure; and replaying the 8 histories
  (8 AppendTokens at once, as clients coming back would), each checked against the digest.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchkit.core import ROOT, Plan, Prompts, summary
from inference_engine.readiness import wait_ready

RESTART_SESSIONS = 8


class _Server:
    """A `serve` subprocess with a sync stub; `seconds` is launch-to-readiness."""

    def __init__(self, window: int, *flags: str):
        import grpc

        from inference_engine.v1 import runtime_pb2 as pb
        from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

        self._log = tempfile.NamedTemporaryFile("w+", prefix="bench-snapshots-", suffix=".log")
        cmd = [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--draft-model", "none",
               "--default-window", str(window), "--max-sessions", str(2 * RESTART_SESSIONS + 4), *flags]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        address = wait_ready(self.proc)
        self.seconds = time.perf_counter() - started
        self.pb, self.channel = pb, grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
        self.stub = pb_grpc.RuntimeServiceStub(self.channel)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def session(self, tokens: list[int]) -> str:
        sid = self.stub.CreateSession(self.pb.CreateSessionRequest()).session_id
        self.stub.AppendTokens(self.pb.AppendTokensRequest(session_id=sid, tokens=tokens))
        return sid

    def digest(self, sid: str) -> str:
        return self.stub.GetSessionInfo(self.pb.GetSessionInfoRequest(session_id=sid)).state_digest

    def close_session(self, sid: str) -> None:
        self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=sid))

    def stop(self) -> None:
        """SIGTERM and wait (persisted sessions are written)."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=300)
        self.channel.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.channel.close()


def _timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def measure_snapshots(plan: Plan, prompts: Prompts) -> dict[str, Any]:
    """The `snapshots` section of the bench JSON (see the module docstring).

    Two server launches: the first on an empty --persist-sessions folder (it writes nothing
    until its shutdown: --persist-every is out of reach and there is no tick, so background
    writes do not disturb the timings), the second on the 8 sessions the first wrote.
    """
    from inference_engine.client.snapshots import restore_bytes_sync, snapshot_bytes_sync

    history = prompts.text(plan.filled_history)
    with tempfile.TemporaryDirectory(prefix="bench-snapshots-") as tmp:
        snap_dir, persist_dir = Path(tmp) / "snapshots", Path(tmp) / "sessions"
        snap_dir.mkdir()
        server = _Server(plan.window, "--snapshot-dir", str(snap_dir), "--persist-sessions", str(persist_dir),
                         "--persist-every", str(1 << 30), "--persist-interval", "0")
        try:
            pb, stub = server.pb, server.stub
            server.close_session(server.session(history[: plan.window // 2]))  # warm-up: compile the forward
            sid = server.session(history)
            want = server.digest(sid)
            times: dict[str, list[float]] = {k: [] for k in ("snapshot", "snapshot_to_dir", "restore",
                                                             "restore_file", "fork", "replay")}
            identical = True
            for _ in range(max(1, plan.reps)):
                dt, data = _timed(lambda: snapshot_bytes_sync(stub, sid))
                times["snapshot"].append(dt)
                dt, msg = _timed(lambda: next(stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid,
                                                                                             to_dir=True))))
                times["snapshot_to_dir"].append(dt)
                for name, call in (("restore", lambda: restore_bytes_sync(stub, data)),
                                   ("restore_file", lambda: stub.RestoreSession(
                                       iter([pb.RestoreSessionRequest(file=msg.file)]))),
                                   ("fork", lambda: stub.ForkSession(pb.ForkSessionRequest(session_id=sid)))):
                    dt, made = _timed(call)
                    times[name].append(dt)
                    identical &= made.state_digest == want and server.digest(made.session_id) == want
                    server.close_session(made.session_id)
                dt, replayed = _timed(lambda: server.session(history))
                times["replay"].append(dt)
                identical &= server.digest(replayed) == want
                server.close_session(replayed)
            # The restart's 8 sessions: this one and 7 forks, written at the shutdown.
            for _ in range(RESTART_SESSIONS - 1):
                stub.ForkSession(pb.ForkSessionRequest(session_id=sid))
            server.stop()
        finally:
            server.kill()
        out: dict[str, Any] = {"window": plan.window, "history": len(history), "bytes": len(data),
                               "identical": identical}
        out.update({f"{k}_ms": summary([t * 1e3 for t in v]) for k, v in times.items()})
        out["restore_over_replay"] = out["replay_ms"]["median"] / out["restore_ms"]["median"]
        out["restart"] = _restart(plan, history, want, persist_dir, server.seconds)
    return out


def _restart(plan: Plan, history: list[int], want: str, folder: Path, empty_start_s: float) -> dict[str, Any]:
    """Launch-to-readiness with the 8 persisted sessions, against an empty start plus replaying the 8 histories."""
    files = len(list(folder.glob("session-*.iesnap")))
    server = _Server(plan.window, "--persist-sessions", str(folder), "--persist-every", str(1 << 30),
                     "--persist-interval", "0")
    try:
        found = re.search(r"restored (\d+) session\(s\) from .* in ([0-9.]+) s", server.log())
        results: list[str] = [""] * RESTART_SESSIONS

        def replay(i: int) -> None:
            results[i] = server.session(history)

        threads = [threading.Thread(target=replay, args=(i,)) for i in range(RESTART_SESSIONS)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        replay_all = time.perf_counter() - started
        identical = all(server.digest(sid) == want for sid in results)
    finally:
        server.kill()
    restore_all = float(found[2]) if found else float("nan")
    return {
        "sessions": RESTART_SESSIONS, "files": files, "history": len(history), "identical": identical,
        "start_with_sessions_s": server.seconds, "start_empty_s": empty_start_s,
        "restored_sessions": int(found[1]) if found else 0, "restore_all_s": restore_all,
        "replay_all_s": replay_all, "restore_all_over_replay_all": replay_all / restore_all,
        "restart_over_replay": (empty_start_s + replay_all) / server.seconds,
    }


def snapshots_report(plan: Plan, quick: bool, snapshots: dict[str, Any], t0: float,
                     load_at_start: tuple[float, float, float]) -> dict[str, Any]:
    """The JSON document of `bench.py --snapshots-only`."""
    import datetime
    import socket
    from dataclasses import asdict

    from inference_engine.blas import active_blas

    meta = {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "quick": quick,
            "plan": asdict(plan), "cores": os.cpu_count(), "blas": active_blas(),
            "bench_wall_s": time.perf_counter() - t0, "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg()}
    return {"meta": meta, "snapshots": snapshots}


def print_snapshots(s: dict[str, Any]) -> None:
    """One paragraph of the snapshot figures."""
    r = s["restart"]
    print(f"snapshots at window {s['window']}, history {s['history']}: {s['bytes'] / 2**20:.1f} MiB; snapshot "
          f"{s['snapshot_ms']['median']:.0f} ms (to dir {s['snapshot_to_dir_ms']['median']:.0f}), restore "
          f"{s['restore_ms']['median']:.0f} ms (file {s['restore_file_ms']['median']:.0f}), fork "
          f"{s['fork_ms']['median']:.0f} ms, replay {s['replay_ms']['median']:.0f} ms: restore "
          f"{s['restore_over_replay']:.1f}x faster (identical: {s['identical']}); restart with {r['sessions']} "
          f"sessions {r['start_with_sessions_s']:.1f} s (restoring them {r['restore_all_s']:.2f} s) vs empty start "
          f"{r['start_empty_s']:.1f} s + replaying them {r['replay_all_s']:.1f} s: {r['restart_over_replay']:.1f}x")
