#!/usr/bin/env python3
"""Constrained output's cost: tokens/s with a JSON-schema constraint vs without, same prompt, same run.

An in-process gRPC server over the packaged model (exact, the server's defaults). Arms, at 1 and 8
concurrent sessions, run alternately (their order rotates each rep, so a change in the machine's
load falls on every arm alike):
- `constrained`: greedy under the schema until the JSON completes; the masks after each planned
  block are computed while its forward runs (the engine's default, `step.prefetch_masks`);
- `inline`: the same with every mask computed on demand, when the step reads it (the engine before
  the prefetch: `jobs.prefetch_masks` patched to do nothing); its tokens must equal `constrained`'s;
- `free`: no constraint, exactly as many tokens (ignore_eos) on the same prompt.

Where a constrained token's time goes is measured around the engine's own calls (all on the engine
thread): llguidance's mask (compute_bitmask and its unpacking) beside the forward or on demand,
the matcher's consume/validate/rollback, the masked draw (`mask_logits` and `choose`, against the
free arm's plain draw) apart from the wait for the forward's logits, and the engine loop's iteration. The load average is recorded around
every arm. Writes JSON to results/constrained/<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inference_engine.blas import reexec_with_openblas  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "tags", "steps"], "properties": {
    "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "minItems": 4, "maxItems": 4, "items": {"type": "string", "maxLength": 16}},
    "steps": {"type": "array", "minItems": 6, "maxItems": 6, "items": {"type": "string", "maxLength": 48}}}}
PROMPT = "Write a recipe for pancakes as JSON with a title, four tags and six steps."
ARMS = ("constrained", "inline", "free")


class Timers:
    """Seconds spent in wrapped calls, by name, and the threads they ran on (the bench's instrument)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.threads: set[str] = set()
        self._stack = threading.local()

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)
        timers = self

        def timed(*a, **kw):
            stack = getattr(timers._stack, "labels", None) or []
            timers._stack.labels = stack + [label]
            t = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                timers._stack.labels = stack
                timers.s[label] += time.perf_counter() - t
                timers.n[label] += 1
                timers.threads.add(threading.current_thread().name)
                if label == "mask" and stack:  # a mask computed inside a prefetch is off the critical path
                    timers.s["mask_in_prefetch"] += time.perf_counter() - t
                    timers.n["mask_in_prefetch"] += 1

        setattr(owner, name, timed)

    def add(self, label: str, seconds: float) -> None:
        self.s[label] += seconds
        self.n[label] += 1

    def wrap_draw(self, module: object) -> None:
        """Time the step's draw apart from the wait for the forward's logits (the mask's `where` is lazy: it
        is evaluated with the draw's argmax, so the masked draw against the free one is the masking's cost)."""
        import mlx.core as mx

        mask_logits, choose = module.mask_logits, module.choose

        def evaluated(logits):
            t = time.perf_counter()
            mx.eval(logits)
            self.add("wait", time.perf_counter() - t)

        masked: list = [None]  # the last masked logits: their input was waited for (`where` runs in the draw)

        def timed_mask(logits, allowed):
            evaluated(logits)
            masked[0] = mask_logits(logits, allowed)
            return masked[0]

        def timed_choose(logits, *a):
            if logits is not masked[0]:
                evaluated(logits)
            t = time.perf_counter()
            try:
                return choose(logits, *a)
            finally:
                self.add("draw", time.perf_counter() - t)

        module.mask_logits, module.choose = timed_mask, timed_choose

    def reset(self) -> None:
        self.s.clear()
        self.n.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    reexec_with_openblas([str(Path(__file__).resolve()), *sys.argv[1:]])
    return asyncio.run(_bench(args))


async def _bench(args: argparse.Namespace) -> int:
    import dataclasses

    import grpc

    from inference_engine.blas import active_blas
    from inference_engine.config import ServerConfig, default_cache_dir
    from inference_engine.decoding import step as step_module
    from inference_engine.model.loader import load_model
    from inference_engine.model.packaged import ensure_packaged_model
    from inference_engine.runtime.engine import Engine
    from inference_engine.runtime import jobs as jobs_module
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.server.server import start_server
    from inference_engine.text.constraint import TokenMatcher
    from inference_engine.v1 import runtime_pb2 as pb
    from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

    timers = Timers()
    timers.wrap(TokenMatcher, "_compute", "mask")  # llguidance's compute_bitmask + unpacking to (V,) bool
    timers.wrap(TokenMatcher, "prefetch", "prefetch")  # the masks ahead, beside the forward
    for name in ("consume", "valid_prefix", "rollback"):
        timers.wrap(TokenMatcher, name, "matcher")
    timers.wrap_draw(step_module)  # waiting for the logits; masking them (where); the draw (argmax)
    prefetch_masks = jobs_module.prefetch_masks

    cfg = dataclasses.replace(ServerConfig(port=0), max_sessions=max(args.sessions) + 1, default_window=1024)
    loaded = load_model(ensure_packaged_model(default_cache_dir()))
    engine = Engine(loaded, cfg.exact, cfg.max_tile, cfg.plain_block, cfg.max_rollback)
    iterations: list[float] = []
    engine.scheduler.observers.append(lambda rows, sessions, seconds: iterations.append(seconds))
    runtime = Runtime(engine, cfg)
    server, port = await start_server(runtime, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.RuntimeServiceStub(channel)
    constraint = pb.Constraint(json_schema=json.dumps(SCHEMA))

    async def session() -> str:
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=[pb.ChatMessage(
            role="user", content=PROMPT)], add_generation_prompt=True))
        return sid

    async def generate(sid: str, n: int, constrained: bool) -> tuple[list[int], bool]:
        req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=not constrained)
        if constrained:
            req.constraint.CopyFrom(constraint)
        msgs = [m async for m in stub.Generate(req)]
        is_valid = True
        if constrained:
            try:
                json.loads("".join(m.text for m in msgs))
            except ValueError:
                is_valid = False
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        return [t for m in msgs for t in m.tokens], is_valid

    async def run_arm(arm: str, n_sessions: int, n_tokens: int) -> dict:
        jobs_module.prefetch_masks = prefetch_masks if arm == "constrained" else (lambda *a, **kw: None)
        sids = [await session() for _ in range(n_sessions)]
        load = os.getloadavg()[0]
        timers.reset()
        iterations.clear()
        t = time.perf_counter()
        got = await asyncio.gather(*(generate(s, n_tokens, arm != "free") for s in sids))
        seconds = time.perf_counter() - t
        tokens = sum(len(toks) for toks, _ in got)
        per_token = {k: v / tokens * 1e6 for k, v in timers.s.items()}
        return {"tokens_per_s": tokens / seconds, "tokens": [toks for toks, _ in got],
                "is_valid": all(ok for _, ok in got), "load_before": load, "load_after": os.getloadavg()[0],
                "us_per_token": per_token, "iteration_ms": statistics.median(iterations) * 1e3 if iterations else 0.0}

    arms: dict = {}
    loads = [os.getloadavg()]
    try:
        ref, _ = await generate(await session(), args.max_tokens, True)  # warm, and the output's length
        n_tokens = len(ref)
        for n_sessions in args.sessions:
            runs: dict[str, list[dict]] = {a: [] for a in ARMS}
            for rep in range(args.reps):
                order = ARMS[rep % 3:] + ARMS[: rep % 3]
                for arm in order:
                    runs[arm].append(await run_arm(arm, n_sessions, n_tokens))
            rate = {a: statistics.median(r["tokens_per_s"] for r in runs[a]) for a in ARMS}
            us = {a: {k: statistics.median(r["us_per_token"].get(k, 0.0) for r in runs[a])
                      for k in ("mask", "mask_in_prefetch", "prefetch", "matcher", "draw", "wait")} for a in ARMS}
            same = all(toks == ref for a in ("constrained", "inline") for r in runs[a] for toks in r["tokens"])
            arms[f"sessions={n_sessions}"] = {
                "tokens_per_s": {a: rate[a] for a in ARMS},
                "overhead": {"constrained": 1 - rate["constrained"] / rate["free"],
                             "inline": 1 - rate["inline"] / rate["free"]},
                "us_per_token": us,
                "mask_us_per_token": us["constrained"]["mask"],
                # The engine thread's constrained work outside the prefetch (which runs beside the forward);
                # an on-demand mask may itself overlap the previous forward (its logits are read after it).
                "engine_thread_us_per_token": {
                    a: us[a]["mask"] - us[a]["mask_in_prefetch"] + us[a]["matcher"] + us[a]["draw"] - us["free"]["draw"] for a in ("constrained", "inline")},
                "iteration_ms": {a: statistics.median(r["iteration_ms"] for r in runs[a]) for a in ARMS},
                "all": {a: [{k: v for k, v in r.items() if k != "tokens"} for r in runs[a]] for a in ARMS},
                "tokens_per_session": n_tokens, "all_json_valid": all(r["is_valid"] for r in runs["constrained"]),
                "constrained_equals_inline": same,
            }
            a = arms[f"sessions={n_sessions}"]
            print(f"{n_sessions} sessions: constrained {rate['constrained']:7.2f} tok/s, inline {rate['inline']:7.2f}, "
                  f"free {rate['free']:7.2f}; overhead {a['overhead']['constrained']:6.1%} "
                  f"(inline {a['overhead']['inline']:6.1%}); mask {a['mask_us_per_token']:6.1f} us/token, on the "
                  f"engine thread outside the prefetch {a['engine_thread_us_per_token']['constrained']:6.1f} "
                  f"(inline {a['engine_thread_us_per_token']['inline']:6.1f}); same bits: {same}", flush=True)
            loads.append(os.getloadavg())
    finally:
        jobs_module.prefetch_masks = prefetch_masks
        await channel.close()
        await server.stop(0.5)
        await runtime.stop()
        engine.close()
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": socket.gethostname(),
              "cpus": os.cpu_count(), "load_average": loads, "blas": active_blas(), "model": loaded.spec.name,
              "schema": SCHEMA, "prompt": PROMPT, "reps": args.reps, "threads": sorted(timers.threads), "arms": arms}
    out = args.out or Path("results/constrained") / f"{datetime.now():%Y-%m-%d}-{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"-> {out}")
    return 0 if all(a["all_json_valid"] and a["constrained_equals_inline"] for a in arms.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
