"""The contenders: gRPC server, in-process runtime, shard pipeline, mlx-lm, llama.cpp."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from benchkit.core import ROOT, Contender, Plan, Prompts, Trace, load_prompts, summary
from inference_engine.readiness import wait_ready

# ---------------------------------------------------------------------------- server (gRPC)


class ServerProcess:
    """`python -m inference_engine serve --port 0` as a subprocess, with a sync stub."""

    def __init__(self, plan: Plan, weights: str = "q4_1", kernel: str | None = None, model: str | None = None):
        self._log = tempfile.NamedTemporaryFile("w+", prefix="bench-server-", suffix=".log")
        cmd = [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--weights", weights,
               "--default-window", str(plan.window), "--max-sessions", str(plan.sessions),
               *(["--model", model] if model else [])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        if kernel is not None:  # the launcher's cblas_sgemm in front of OpenBLAS (inference_engine/blas.py)
            env["INFERENCE_ENGINE_KERNEL"] = kernel
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        try:
            address = wait_ready(self.proc)
        except OSError as exc:
            self.close()
            raise RuntimeError(f"server did not start: {exc}\n{self.log()}") from None
        import grpc

        from inference_engine.v1 import runtime_pb2 as pb
        from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

        self.pb = pb
        self.channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = pb_grpc.RuntimeServiceStub(self.channel)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def rss_mib(self) -> float:
        """VmRSS of the server process in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc status")

    def session(self, tokens: list[int] | None = None) -> str:
        sid = self.stub.CreateSession(self.pb.CreateSessionRequest(client_label="bench")).session_id
        if tokens:
            self.append(sid, tokens)
        return sid

    def append(self, sid: str, tokens: list[int]) -> float:
        """AppendTokens; returns its wall time in seconds."""
        t = time.perf_counter()
        self.stub.AppendTokens(self.pb.AppendTokensRequest(session_id=sid, tokens=tokens))
        return time.perf_counter() - t

    def close_session(self, sid: str) -> None:
        self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=sid))

    def prefill(self, prompt: list[int]) -> float:
        """Seconds of one AppendTokens of `prompt` into a fresh session."""
        sid = self.session()
        dt = self.append(sid, prompt)
        self.close_session(sid)
        return dt

    def decode(self, prompt: list[int], n: int) -> Trace:
        sid = self.session()
        trace = Trace(time.perf_counter())
        self.append(sid, prompt)
        for msg in self.stub.Generate(self.pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True)):
            if msg.tokens:
                trace.times.append(time.perf_counter())
                trace.tokens.extend(msg.tokens)
        self.close_session(sid)
        return trace

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "channel"):
            self.channel.close()


def start_server(plan: Plan, prompts: Prompts, stack: ExitStack, weights: str = "q4_1",
                 kernel: str | None = None, model: str | None = None) -> tuple[ServerProcess, Contender]:
    """A real server process serving `model` (None: the default) from `weights` with `kernel` (None: the
    default; closed by `stack`)."""
    server = ServerProcess(plan, weights, kernel, model)
    stack.callback(server.close)
    log = server.log()  # start-up lines come before "listening on"
    blas, mode = re.search(r"BLAS in use: (.*)", log), re.search(r"(exact|plain) mode: block size (\d+)", log)
    extra = {"blas": blas[1] if blas else "unknown", "mode": f"{mode[1]}, block size {mode[2]}" if mode else "unknown",
             "weights": "q4_1" if "weights: the GGUF's blocks" in log else "fp32"}  # what it serves, as it logged
    return server, Contender(lambda n: server.decode(prompts.chat, n),
                             lambda: server.prefill(prompts.text(plan.prefill_tokens)), extra)


def measure_rss(server: ServerProcess, plan: Plan, prompts: Prompts) -> dict[str, Any]:
    """Server VmRSS idle, with 1 and with `plan.sessions` sessions holding 64 tokens each."""
    out: dict[str, Any] = {"idle_mib": server.rss_mib()}
    sids = [server.session(prompts.text(64))]
    out["sessions_1_mib"] = server.rss_mib()
    sids += [server.session(prompts.text(64, start=64 * i)) for i in range(1, plan.sessions)]
    out[f"sessions_{plan.sessions}_mib"] = server.rss_mib()
    info = server.stub.GetSessionInfo(server.pb.GetSessionInfoRequest(session_id=sids[0]))
    out["kv_bytes_per_session"] = info.kv_bytes
    for sid in sids:
        server.close_session(sid)
    return out


def measure_append_latency(server: ServerProcess, plan: Plan, prompts: Prompts) -> dict[str, Any]:
    """AppendTokens of `append_tokens` tokens at a short history, just past the window, and far past it.

    Until the window fills, attention reads only the filled part of the ring (cheaper);
    from then on the cost is flat however long the session: long/filled should be ~1.
    """
    out: dict[str, Any] = {"tokens": plan.append_tokens, "window": plan.window}
    for name, history in (("short", plan.short_history), ("filled", plan.filled_history), ("long", plan.long_history)):
        sid = server.session(prompts.text(history))
        times = [server.append(sid, prompts.text(plan.append_tokens, history + i * plan.append_tokens)) * 1e3
                 for i in range(plan.append_reps)]
        info = server.stub.GetSessionInfo(server.pb.GetSessionInfoRequest(session_id=sid))
        out[name] = {"history": history, "cached_tokens": info.cached_tokens, "ms": summary(times)}
        server.close_session(sid)
    out["long_over_short"] = out["long"]["ms"]["median"] / out["short"]["ms"]["median"]
    out["long_over_filled"] = out["long"]["ms"]["median"] / out["filled"]["ms"]["median"]
    return out


# ---------------------------------------------------------------------------- in-process runtime


async def runtime_decode(runtime: Any, prompts: Prompts, n: int, counters: Callable[[], Any] | None = None) -> Trace:
    """One greedy decode repetition on a Runtime driven directly: fresh session, chat prompt, n tokens.

    Args:
        counters: read just before and after the Generate alone (the prompt excluded), into `Trace.counters`.
    """
    from inference_engine.runtime.types import AppendParams, CreateSessionParams, GenerateChunk, GenerateParams

    sid = (await runtime.create_session(CreateSessionParams((), "bench", 0, 0))).session_id
    trace = Trace(time.perf_counter())

    async def emit(chunk: GenerateChunk) -> None:
        if chunk.tokens:
            trace.times.append(time.perf_counter())
            trace.tokens.extend(chunk.tokens)

    await runtime.append_tokens(AppendParams(sid, tuple(prompts.chat)))
    before = counters() if counters else None
    await runtime.generate(GenerateParams(sid, n, ignore_eos=True), emit)
    if counters:
        trace.counters = (before, counters())
    await runtime.close_session(sid)
    return trace


async def runtime_sessions_at_once(runtime: Any, prompts: Prompts, sessions: int, n: int) -> dict[str, Any]:
    """`sessions` sessions of a Runtime (chat prompt each, prefilled first) generate n tokens at once."""
    from inference_engine.runtime.types import AppendParams, CreateSessionParams, GenerateChunk, GenerateParams

    sids = [(await runtime.create_session(CreateSessionParams((), "bench", 0, 0))).session_id for _ in range(sessions)]
    for sid in sids:
        await runtime.append_tokens(AppendParams(sid, tuple(prompts.chat)))
    traces = [Trace(time.perf_counter()) for _ in sids]

    async def one(sid: str, trace: Trace) -> None:
        async def emit(chunk: GenerateChunk) -> None:
            if chunk.tokens:
                trace.times.append(time.perf_counter())
                trace.tokens.extend(chunk.tokens)

        await runtime.generate(GenerateParams(sid, n, ignore_eos=True), emit)
        await runtime.close_session(sid)

    start = time.perf_counter()
    await asyncio.gather(*(one(sid, t) for sid, t in zip(sids, traces)))
    total = sum(len(t.tokens) for t in traces)
    return {"sessions": sessions, "tokens": total, "tok_s": total / (max(t.times[-1] for t in traces) - start),
            "first_stream": traces[0].tokens}


def start_in_process(plan: Plan, prompts: Prompts, stack: ExitStack) -> Contender:
    """The server's Runtime and engine (its default weights) in this process, driven directly (no gRPC)."""
    from inference_engine.config import ServerConfig
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.runtime.types import AppendParams, CreateSessionParams
    from inference_engine.server.server import build_engine, engine_weights

    cfg = ServerConfig(port=0, default_window=plan.window, max_sessions=plan.sessions)
    engine = build_engine(cfg)
    runtime = Runtime(engine, cfg)

    async def decode(n: int) -> Trace:
        return await runtime_decode(runtime, prompts, n)

    async def prefill() -> float:
        sid = (await runtime.create_session(CreateSessionParams((), "bench", 0, 0))).session_id
        t = time.perf_counter()
        await runtime.append_tokens(AppendParams(sid, tuple(prompts.text(plan.prefill_tokens))))
        dt = time.perf_counter() - t
        await runtime.close_session(sid)
        return dt

    loop = asyncio.new_event_loop()  # the engine hands results back through this loop, as in the server
    stack.callback(loop.close)
    stack.callback(engine.close)
    mode = f"{'exact' if engine.is_exact else 'plain'}, block size {engine.block}"
    return Contender(lambda n: loop.run_until_complete(decode(n)), lambda: loop.run_until_complete(prefill()),
                     {"mode": mode, "weights": engine_weights(engine)})


# ---------------------------------------------------------------------------- shard pipeline (--pipeline)

PIPELINE_RANGES = ("0:10", "10:20", "20:30")  # head / middle / tail of the 30-block SmolLM2-135M


def route_bench_parser(doc: str, reps: int, tokens: int) -> argparse.ArgumentParser:
    """A route bench's command line: --reps, --tokens and --out (the caller adds its own)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--out", type=Path)
    return parser


@dataclass(frozen=True)
class RouteBench:
    """What a route bench starts from (`start_route_bench`)."""

    prompts: Prompts  # the packaged model's prompts
    cfg: Any  # the ServerConfig every engine and runtime is built from
    engines: dict[str, Any]  # one Engine per contender, by name
    block: int  # the single process's probed block: the workers start at it
    load_at_start: tuple[float, float, float]  # os.getloadavg() before any engine was built


def start_route_bench(names: tuple[str, ...], max_sessions: int) -> RouteBench:
    """The packaged model's prompts and one engine per name (window 1024, no draft model); the first
    name is the single process whose block the workers use."""
    from inference_engine.config import ServerConfig, default_cache_dir
    from inference_engine.model.packaged import ensure_packaged_model
    from inference_engine.server.server import build_engine

    prompts = load_prompts(ensure_packaged_model(default_cache_dir()))
    load_at_start = os.getloadavg()
    cfg = ServerConfig(port=0, default_window=1024, max_sessions=max_sessions, draft_model=None)
    engines = {name: build_engine(cfg) for name in names}
    return RouteBench(prompts, cfg, engines, engines[names[0]].block, load_at_start)


def start_route_workers(block: int, max_sessions: int, tree: Path = ROOT) -> list[subprocess.Popen]:
    """The three `shard-worker`s of PIPELINE_RANGES at `block`, running the code of `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return [subprocess.Popen([sys.executable, "-m", "inference_engine", "shard-worker", "--layers", r, "--port", "0",
                              "--block", str(block), "--max-sessions", str(max_sessions)],
                             cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for r in PIPELINE_RANGES]


def tear_down(loop: asyncio.AbstractEventLoop, engines: dict[str, Any], workers: list[subprocess.Popen]) -> None:
    """A route bench's `finally`: close its engines and event loop, then stop its shard workers."""
    for e in engines.values():
        e.close()
    loop.close()
    for w in workers:
        w.terminate()
        w.wait(timeout=30)


def measure_pipeline(plan: Plan, prompts: Prompts) -> dict[str, Any]:
    """Greedy decode tok/s over a 3-worker shard route vs the same Runtime in one process.

    Three `shard-worker` subprocesses (PIPELINE_RANGES, started at the single process's
    probed block) serve the route; both runtimes run in this process over one event loop
    and are measured round-robin. Per-hop latency is `ShardPipeline.hop_stats` over the
    route's timed repetitions: from sending a hop its frame to its checked answer (hops run
    one after another, head first, so a step costs the sum of its hops).
    """
    from inference_engine.config import ServerConfig
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.server.server import build_engine, connect_shards

    cfg = ServerConfig(port=0, default_window=plan.window, max_sessions=plan.sessions, draft_model=None)
    engines = {"single_process": build_engine(cfg), "pipeline": build_engine(cfg)}  # default weights, as the workers
    block = engines["single_process"].block
    workers = start_route_workers(block, 2 * plan.sessions)
    loop = asyncio.new_event_loop()
    try:
        addresses = [wait_ready(w) for w in workers]
        route, _ = loop.run_until_complete(connect_shards(replace(cfg, shards=tuple(addresses)), engines["pipeline"]))
        pipeline = route.pipeline
        runtimes = {name: Runtime(e, cfg) for name, e in engines.items()}

        def decode(runtime: Runtime, n: int):  # noqa: ANN202 - a coroutine for loop.run_until_complete
            return runtime_decode(runtime, prompts, n)

        for runtime in runtimes.values():  # warm-up
            loop.run_until_complete(decode(runtime, min(plan.new_tokens, 8)))
        before = pipeline.hop_stats()
        traces: dict[str, list[Trace]] = {name: [] for name in runtimes}
        for _ in range(plan.reps):
            for name, runtime in runtimes.items():
                traces[name].append(loop.run_until_complete(decode(runtime, plan.new_tokens)))
        hops = [{"address": a.address, "layers": str(a.layers), "calls": a.calls - b.calls,
                 "mean_ms": 1e3 * (a.seconds - b.seconds) / max(1, a.calls - b.calls)}
                for a, b in zip(pipeline.hop_stats(), before)]
        at_once = {name: {n: loop.run_until_complete(runtime_sessions_at_once(runtime, prompts, n, plan.new_tokens))
                          for n in (1, plan.sessions)} for name, runtime in runtimes.items()}
        loop.run_until_complete(asyncio.sleep(0.2))  # closed sessions' releases reach the workers
        loop.run_until_complete(route.stop())
    finally:
        tear_down(loop, engines, workers)
    # Hop calls include each repetition's prompt forward as well as its decode steps.
    out: dict[str, Any] = {"ranges": list(PIPELINE_RANGES), "block": block, "new_tokens": plan.new_tokens,
                           "hops": hops}
    for name, ts in traces.items():
        out[name] = {"decode_tok_s": summary([t.decode_tok_s for t in ts])}
    out["pipeline_over_single"] = (out["pipeline"]["decode_tok_s"]["median"]
                                   / out["single_process"]["decode_tok_s"]["median"])
    out["tokens_identical"] = all(a.tokens == b.tokens for a, b in zip(traces["pipeline"], traces["single_process"]))
    # Many sessions at once: the workers compute the blocks of sessions waiting together in one forward.
    for name, runs in at_once.items():
        one, many = runs[1], runs[plan.sessions]
        out[name]["sessions_at_once"] = {"sessions": plan.sessions, "one_tok_s": one["tok_s"], "many_tok_s": many["tok_s"],
                                         "many_over_one": many["tok_s"] / one["tok_s"]}
    out["sessions_at_once_identical"] = (at_once["pipeline"][plan.sessions]["first_stream"]
                                         == at_once["single_process"][plan.sessions]["first_stream"]
                                         == at_once["pipeline"][1]["first_stream"])
    return out


# ---------------------------------------------------------------------------- mlx-lm


def start_mlx_lm(plan: Plan, prompts: Prompts, model_dir: Path) -> Contender:
    """mlx-lm's own `stream_generate` on the same fp32 folder."""
    import mlx_lm
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm.load(str(model_dir))
    tokenizer._eos_token_ids = set()  # decode a fixed token count, like ignore_eos

    def decode(n: int) -> Trace:
        trace = Trace(time.perf_counter())
        for response in stream_generate(model, tokenizer, prompts.chat, max_tokens=n):
            trace.times.append(time.perf_counter())
            trace.tokens.append(response.token)
        return trace

    def prefill() -> float:
        t = time.perf_counter()
        next(iter(stream_generate(model, tokenizer, prompts.text(plan.prefill_tokens), max_tokens=1)))
        return time.perf_counter() - t

    return Contender(decode, prefill)


# ---------------------------------------------------------------------------- llama.cpp


# A llama-cpp-python built with -march=native crashed (SIGSEGV in llama_decode) on Xeon CPUs with AMX in
# these VMs; built with GGML_NATIVE=OFF and explicit x86 flags it runs (requirements-bench.txt, docs/performance.md).
PORTABLE_BUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                  '-DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX_VNNI=ON" '
                  'pip install --no-binary llama-cpp-python -r requirements-bench.txt')
# Loads the GGUF, prefills and decodes a few tokens: what the bench then does in its own process.
LLAMA_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_batch=64, seed=0, verbose=False)
tokens = llm.tokenize(b"The capital of France is")
for i, _ in enumerate(llm.generate(tokens, temp=0.0, top_k=1)):
    if i == 3:
        break
"""


def probe_llama_cpp(gguf: Path, code: str = LLAMA_PROBE, timeout_s: float = 300) -> str:
    """Run llama.cpp once in a child process: "" when it decodes, else why it is unavailable (a crash
    there, such as a SIGSEGV in llama_decode, would otherwise end the bench itself)."""
    import signal

    try:
        done = subprocess.run([sys.executable, "-c", code, str(gguf)], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not decode 4 tokens within {timeout_s:g} s in a probe process"
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return (f"llama.cpp crashed ({name}) decoding in a probe process; a build for this CPU may help: "
                f"{PORTABLE_BUILD}")
    if done.returncode != 0:
        return f"llama.cpp failed in a probe process (exit {done.returncode}): {done.stderr.strip()[-500:]}"
    return ""


def start_llama_cpp(plan: Plan, prompts: Prompts, gguf: Path, stack: ExitStack) -> Contender | str:
    """llama-cpp-python on the GGUF the model was converted from (optional dependency).

    Returns:
        The contender, or why llama.cpp is unavailable (not installed, or it fails or crashes in a probe
        process first: the bench never crashes with it).
    """
    try:
        import llama_cpp
    except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
        return f"llama-cpp-python not importable ({type(exc).__name__}: {exc}); pip install -r requirements-bench.txt"
    crashed = probe_llama_cpp(gguf)
    if crashed:
        return crashed
    try:
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_batch=512, n_threads=os.cpu_count(),
                              seed=0, verbose=False)
    except Exception as exc:  # noqa: BLE001
        return f"llama.cpp could not load {gguf.name}: {type(exc).__name__}: {exc}"
    stack.callback(llm.close)

    def decode(n: int) -> Trace:
        llm.reset()  # no prefix reuse between repetitions
        trace = Trace(time.perf_counter())
        for token in llm.generate(prompts.chat, temp=0.0, top_k=1, reset=True):
            trace.times.append(time.perf_counter())
            trace.tokens.append(int(token))
            if len(trace.tokens) == n:
                break
        return trace

    def prefill() -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompts.text(plan.prefill_tokens))
        return time.perf_counter() - t

    return Contender(decode, prefill, {"version": llama_cpp.__version__, "n_threads": os.cpu_count()})
