#!/usr/bin/env python
"""Benchmark: our runtime against mlx-lm and llama.cpp, and against the memory-bandwidth limit.

One run, one machine, one model (the packaged SmolLM2-135M), one BLAS (OpenBLAS is
preloaded by re-exec, as the server launcher does). All engines are loaded at once and
their repetitions run round-robin, so load from elsewhere hits them alike. Figures, each
a median over several repetitions with min and max:

- decode tok/s: greedy, `new_tokens` tokens after a short chat prompt, counted from the
  first generated token to the last ((N - 1) tokens over that time), so prefill is
  excluded. Engines: `server` (a real `python -m inference_engine serve` subprocess over
  gRPC, Generate with ignore_eos), `in_process` (the same Runtime driven directly, no
  gRPC), `mlx_lm` (`stream_generate` on the same fp32 folder, EOS disabled) and
  `llama_cpp` (llama-cpp-python on the Q4_1 GGUF the fp32 folder was converted from).
- prefill tok/s: a `prefill_tokens`-token prompt into an empty context, until the
  next-token logits exist (server: one AppendTokens RPC on a fresh session).
- TTFT ms: from sending the short prompt to receiving the first generated token.
- per-token ms and gRPC overhead: 1000 / decode tok/s; server minus in-process is what
  the gRPC stream costs per token.
- AppendTokens ms: 16 tokens appended at a short history and at a long one that has
  wrapped the sink-window; the cached key set has a fixed size, so these should match.
- server RSS MiB: VmRSS of the server process idle, with 1 and with 8 open sessions.
- the limit: streaming-read bandwidth (numpy sum over a buffer far larger than the
  caches, best of several, 1 and all threads) divided by the weight bytes one decoded
  token must read (every parameter once; the tied embedding is read whole by the LM
  head). Each decode figure is shown as a fraction of the limit of the weights it reads
  (fp32 for the MLX engines, the GGUF's Q4_1 tensors for llama.cpp).

Usage: scripts/bench.py [--quick] [--out FILE]. The full run writes
results/bench/<YYYY-MM-DD>-<host>.json; --quick is a seconds-long subset for CI.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inference_engine.blas import active_blas, reexec_with_openblas  # noqa: E402 (needs ROOT on sys.path)

CHAT_PROMPT = "Explain how a hash table works, and when you would use one instead of a sorted list."
# Real English prose for long prompts: docstrings of standard-library modules (~6k tokens).
CORPUS_MODULES = ("argparse", "csv", "json", "re", "heapq", "unittest", "pydoc", "doctest", "subprocess", "typing")


@dataclass(frozen=True)
class Plan:
    """Sizes of one bench run."""

    new_tokens: int  # decoded tokens per decode repetition
    prefill_tokens: int  # prompt length of the prefill figure
    reps: int  # repetitions per figure (after one warm-up)
    append_reps: int  # AppendTokens calls per history length
    short_history: int  # history before the short-history appends
    long_history: int  # history before the long-history appends (> window: wrapped)
    filled_history: int  # just past sink + window: attention reads every slot from here on
    window: int  # server default window (sink stays the server default)
    sessions: int  # sessions open for the second RSS figure (also the server's pool)
    bandwidth_bytes: int  # buffer size of the bandwidth probe
    append_tokens: int = 16  # tokens per timed AppendTokens


FULL = Plan(new_tokens=128, prefill_tokens=512, reps=5, append_reps=10, short_history=100, long_history=4000,
            filled_history=1100, window=1024, sessions=8, bandwidth_bytes=2 << 30)
QUICK = Plan(new_tokens=8, prefill_tokens=32, reps=1, append_reps=2, short_history=20, long_history=200,
             filled_history=80, window=64, sessions=8, bandwidth_bytes=256 << 20)


@dataclass
class Trace:
    """Timestamps of one decode repetition."""

    start: float  # perf_counter when the prompt was sent
    times: list[float] = field(default_factory=list)  # arrival time of each generated token
    tokens: list[int] = field(default_factory=list)  # the generated tokens

    @property
    def ttft_ms(self) -> float:
        """Prompt sent to first token received."""
        return (self.times[0] - self.start) * 1e3

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time since the first (prefill excluded)."""
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


@dataclass
class EngineResult:
    """The raw measurements of one engine."""

    available: bool  # False: the engine could not run; see reason
    reason: str = ""  # why it is unavailable
    decode: list[Trace] = field(default_factory=list)  # decode repetitions
    prefill_s: list[float] = field(default_factory=list)  # prefill wall times
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific facts


@dataclass
class Contender:
    """An engine ready to be measured."""

    decode: Callable[[int], Trace]  # greedy decode of n tokens after the chat prompt
    prefill: Callable[[], float]  # seconds to prefill the prefill prompt into an empty context
    extra: dict[str, Any] = field(default_factory=dict)  # engine facts for the JSON


def run_interleaved(contenders: dict[str, Contender], plan: Plan) -> dict[str, EngineResult]:
    """A short warm-up each, then every repetition round-robin over the engines.

    Interleaving spreads load from elsewhere on the machine over all engines alike, so
    the ratios stay fair even when absolute figures are noisy.
    """
    results = {name: EngineResult(True, extra=dict(c.extra)) for name, c in contenders.items()}
    for c in contenders.values():
        c.decode(min(plan.new_tokens, 16))
    for _ in range(plan.reps):
        for name, c in contenders.items():
            results[name].decode.append(c.decode(plan.new_tokens))
    for _ in range(plan.reps):
        for name, c in contenders.items():
            results[name].prefill_s.append(c.prefill())
    return results


def summary(values: list[float]) -> dict[str, float] | None:
    """Median, min, max and count of a list of measurements (None when empty)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ---------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompts:
    """Token ids of the real prompts, from the model's own tokenizer."""

    chat: list[int]  # chat-template prompt for decode and TTFT
    corpus: list[int]  # long prose; prefixes serve as prefill prompts and histories
    tokenizer: Any  # the transformers tokenizer (to show generated text)

    def text(self, n: int, start: int = 0) -> list[int]:
        """n corpus tokens from `start` (wrapping around if the corpus is short)."""
        return [self.corpus[(start + i) % len(self.corpus)] for i in range(n)]


def load_prompts(model_dir: Path) -> Prompts:
    """Tokenize the chat prompt and the prose corpus with transformers' AutoTokenizer."""
    import importlib

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    chat = [{"role": "user", "content": CHAT_PROMPT}]
    chat_text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    corpus_text = "\n\n".join(importlib.import_module(m).__doc__ or "" for m in CORPUS_MODULES)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return Prompts(encode(chat_text), encode(corpus_text), tok)


# ---------------------------------------------------------------------------- the limit


def memory_bandwidth(nbytes: int, reps: int) -> dict[str, float]:
    """Streaming-read bandwidth in GB/s: best time of a numpy sum over `nbytes`, 1 and all threads."""
    buf = np.ones(nbytes // 8, dtype=np.float64)  # written once so every page is resident
    threads = os.cpu_count() or 1
    out: dict[str, float] = {"buffer_bytes": float(buf.nbytes)}
    for n in sorted({1, threads}):
        parts = np.array_split(buf, n)
        with ThreadPoolExecutor(n) as pool:  # numpy reductions release the GIL
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                list(pool.map(np.sum, parts))
                best = min(best, time.perf_counter() - t)
        out[f"gb_s_{n}_threads"] = buf.nbytes / best / 1e9
    out["gb_s"] = max(v for k, v in out.items() if k.startswith("gb_s_"))
    return out


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the tensors stored in a GGUF (what llama.cpp reads per token)."""
    from gguf import GGUFReader

    return int(sum(t.n_bytes for t in GGUFReader(str(path)).tensors))


def mlx_weight_bytes(model: Any) -> int:
    """Bytes of every parameter of an MLX model (tied embeddings counted once)."""
    from mlx.utils import tree_flatten

    return int(sum(p.nbytes for _, p in tree_flatten(model.parameters())))


# ---------------------------------------------------------------------------- server (gRPC)


class ServerProcess:
    """`python -m inference_engine serve --port 0` as a subprocess, with a sync stub."""

    def __init__(self, plan: Plan):
        self._log = tempfile.NamedTemporaryFile("w+", prefix="bench-server-", suffix=".log")
        cmd = [sys.executable, "-m", "inference_engine", "serve", "--port", "0",
               "--default-window", str(plan.window), "--max-sessions", str(plan.sessions)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on "):
            self.close()
            raise RuntimeError(f"server did not start: {line!r}\n{self.log()}")
        import grpc

        from inference_engine.v1 import runtime_pb2 as pb
        from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

        self.pb = pb
        self.channel = grpc.insecure_channel(line.split()[-1])
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


def start_server(plan: Plan, prompts: Prompts, stack: ExitStack) -> tuple[ServerProcess, Contender]:
    """A real server process (closed by `stack`) and its gRPC decode/prefill."""
    server = ServerProcess(plan)
    stack.callback(server.close)
    log = server.log()  # start-up lines come before "listening on"
    blas, mode = re.search(r"BLAS in use: (.*)", log), re.search(r"(exact|plain) mode: block size (\d+)", log)
    extra = {"blas": blas[1] if blas else "unknown", "mode": f"{mode[1]}, block size {mode[2]}" if mode else "unknown"}
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


def start_in_process(plan: Plan, prompts: Prompts, model_dir: Path, stack: ExitStack) -> tuple[Contender, int]:
    """The server's Runtime and engine in this process, driven directly (no gRPC).

    Returns:
        (the contender, fp32 weight bytes of the model).
    """
    from inference_engine.config import ServerConfig
    from inference_engine.model.loader import load_model
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.runtime.types import AppendParams, CreateSessionParams, GenerateChunk, GenerateParams
    from inference_engine.server.server import build_engine

    cfg = ServerConfig(port=0, default_window=plan.window, max_sessions=plan.sessions)
    loaded = load_model(model_dir)
    engine = build_engine(cfg, loaded)
    runtime = Runtime(engine, cfg)

    async def session() -> str:
        return (await runtime.create_session(CreateSessionParams((), "bench", 0, 0))).session_id

    async def decode(n: int) -> Trace:
        sid = await session()
        trace = Trace(time.perf_counter())

        async def emit(chunk: GenerateChunk) -> None:
            if chunk.tokens:
                trace.times.append(time.perf_counter())
                trace.tokens.extend(chunk.tokens)

        await runtime.append_tokens(AppendParams(sid, tuple(prompts.chat)))
        await runtime.generate(GenerateParams(sid, n, ignore_eos=True), emit)
        await runtime.close_session(sid)
        return trace

    async def prefill() -> float:
        sid = await session()
        t = time.perf_counter()
        await runtime.append_tokens(AppendParams(sid, tuple(prompts.text(plan.prefill_tokens))))
        dt = time.perf_counter() - t
        await runtime.close_session(sid)
        return dt

    loop = asyncio.new_event_loop()  # the engine hands results back through this loop, as in the server
    stack.callback(loop.close)
    stack.callback(engine.close)
    mode = f"{'exact' if engine.is_exact else 'plain'}, block size {engine.block}"
    contender = Contender(lambda n: loop.run_until_complete(decode(n)), lambda: loop.run_until_complete(prefill()),
                          {"mode": mode})
    return contender, mlx_weight_bytes(loaded.model)


# ---------------------------------------------------------------------------- shard pipeline (--pipeline)

PIPELINE_RANGES = ("0:10", "10:20", "20:30")  # head / middle / tail of the 30-block SmolLM2-135M


def measure_pipeline(plan: Plan, prompts: Prompts, model_dir: Path) -> dict[str, Any]:
    """Greedy decode tok/s over a 3-worker shard route vs the same Runtime in one process.

    Three `shard-worker` subprocesses (PIPELINE_RANGES, started at the single process's
    probed block) serve the route; both runtimes run in this process over one event loop
    and are measured round-robin. Per-hop latency is `ShardPipeline.hop_stats` over the
    route's timed repetitions: from sending a hop its frame to its checked answer (hops run
    one after another, head first, so a step costs the sum of its hops).
    """
    from inference_engine.config import ServerConfig
    from inference_engine.model.loader import load_model
    from inference_engine.runtime.runtime import Runtime
    from inference_engine.runtime.types import AppendParams, CreateSessionParams, GenerateChunk, GenerateParams
    from inference_engine.server.server import build_engine
    from inference_engine.shard.pipeline import ShardPipeline
    from inference_engine.shard.remote_executor import ShardRoute

    cfg = ServerConfig(port=0, default_window=plan.window, max_sessions=2, draft_model=None)
    loaded = load_model(model_dir)
    engines = {"single_process": build_engine(cfg, loaded), "pipeline": build_engine(cfg, loaded)}
    block = engines["single_process"].block
    workers = [subprocess.Popen([sys.executable, "-m", "inference_engine", "shard-worker", "--layers", r,
                                 "--port", "0", "--block", str(block), "--max-rollback", str(cfg.max_rollback + 1)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
               for r in PIPELINE_RANGES]
    loop = asyncio.new_event_loop()
    try:
        addresses = []
        for w in workers:
            line = w.stdout.readline()
            if not line.startswith("listening on "):
                raise RuntimeError(f"shard worker did not start: {line!r}")
            addresses.append(line.split()[-1])
        pipeline = ShardPipeline(addresses)
        loop.run_until_complete(pipeline.connect())
        engines["pipeline"].use_route(ShardRoute(pipeline, loop))
        runtimes = {name: Runtime(e, cfg) for name, e in engines.items()}

        async def decode(runtime: Runtime, n: int) -> Trace:
            sid = (await runtime.create_session(CreateSessionParams((), "bench", 0, 0))).session_id
            trace = Trace(time.perf_counter())

            async def emit(chunk: GenerateChunk) -> None:
                if chunk.tokens:
                    trace.times.append(time.perf_counter())
                    trace.tokens.extend(chunk.tokens)

            await runtime.append_tokens(AppendParams(sid, tuple(prompts.chat)))
            await runtime.generate(GenerateParams(sid, n, ignore_eos=True), emit)
            await runtime.close_session(sid)
            return trace

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
        loop.run_until_complete(asyncio.sleep(0.2))  # closed sessions' releases reach the workers
        loop.run_until_complete(pipeline.close())
        loop.run_until_complete(asyncio.sleep(0.1))  # the route's streams wind down before the loop closes
    finally:
        for e in engines.values():
            e.close()
        loop.close()
        for w in workers:
            w.terminate()
            w.wait(timeout=30)
    # Hop calls include each repetition's prompt forward as well as its decode steps.
    out: dict[str, Any] = {"ranges": list(PIPELINE_RANGES), "block": block, "new_tokens": plan.new_tokens,
                           "hops": hops}
    for name, ts in traces.items():
        out[name] = {"decode_tok_s": summary([t.decode_tok_s for t in ts])}
    out["pipeline_over_single"] = (out["pipeline"]["decode_tok_s"]["median"]
                                   / out["single_process"]["decode_tok_s"]["median"])
    out["tokens_identical"] = all(a.tokens == b.tokens for a, b in zip(traces["pipeline"], traces["single_process"]))
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


def start_llama_cpp(plan: Plan, prompts: Prompts, gguf: Path, stack: ExitStack) -> Contender | str:
    """llama-cpp-python on the GGUF the model was converted from (optional dependency).

    Returns:
        The contender, or why llama.cpp is unavailable.
    """
    try:
        import llama_cpp
    except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
        return f"llama-cpp-python not importable ({type(exc).__name__}: {exc}); pip install -r requirements-bench.txt"
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


# ---------------------------------------------------------------------------- report


def engine_figures(r: EngineResult, plan: Plan, limit_tok_s: float, reference: list[int] | None) -> dict[str, Any]:
    """JSON figures of one engine: summaries, fraction of its limit, agreement with in-process."""
    if not r.available:
        return {"available": False, "reason": r.reason}
    decode = [t.decode_tok_s for t in r.decode]
    out: dict[str, Any] = {
        "available": True,
        "new_tokens": len(r.decode[0].tokens),
        "decode_tok_s": summary(decode),
        "per_token_ms": summary([1e3 / d for d in decode]),
        "ttft_ms": summary([t.ttft_ms for t in r.decode]),
        "prefill_tok_s": summary([plan.prefill_tokens / s for s in r.prefill_s]),
        "limit_tok_s": limit_tok_s,
        "fraction_of_limit": statistics.median(decode) / limit_tok_s,
        **r.extra,
    }
    if reference is not None:
        tokens = r.decode[0].tokens
        out["greedy_prefix_agreement"] = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                                              min(len(tokens), len(reference)))
    return out


def fmt(s: dict[str, float] | None, digits: int = 1) -> str:
    """'median [min–max]' of a summary."""
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def print_table(report: dict[str, Any]) -> None:
    """The figures and ratios as a plain-text table."""
    meta, eng = report["meta"], report["engines"]
    print(f"\n{meta['date']} {meta['host']} · {meta['cpu']} · {meta['cores']} cores · BLAS {meta['blas']}")
    plan = meta["plan"]
    print(f"model {meta['model']} · {plan['new_tokens']} new tokens, prefill {plan['prefill_tokens']}, "
          f"{plan['reps']} reps: median [min–max]\n")
    cols = ("decode tok/s", "of limit", "prefill tok/s", "TTFT ms", "ms/token")
    head = f"{'engine':<11}" + "".join(f"{c:>24}" if c != "of limit" else f"{c:>10}" for c in cols)
    print(head)
    print("-" * len(head))
    for name, e in eng.items():
        if not e["available"]:
            print(f"{name:<11}  unavailable: {e['reason']}")
            continue
        print(f"{name:<11}{fmt(e['decode_tok_s']):>24}{e['fraction_of_limit']:>10.0%}{fmt(e['prefill_tok_s']):>24}"
              f"{fmt(e['ttft_ms']):>24}{fmt(e['per_token_ms'], 2):>24}")
    print("\nratios (decode, medians): " + ", ".join(f"{k} {v:.2f}x" for k, v in report["ratios"].items()))
    lim, bw = report["limit"], report["bandwidth"]
    print(f"limit: {bw['gb_s']:.1f} GB/s streaming read / {lim['weight_bytes_fp32'] / 1e6:.0f} MB fp32 weights "
          f"= {lim['tok_s_fp32']:.1f} tok/s; / {lim['weight_bytes_gguf'] / 1e6:.0f} MB GGUF (Q4_1) weights "
          f"= {lim['tok_s_gguf']:.1f} tok/s")
    print(f"gRPC stream overhead: {report['grpc_overhead_ms_per_token']:+.2f} ms/token (server − in-process)")
    a = report["append_latency"]
    print(f"AppendTokens({a['tokens']}) ms: " + ", ".join(
        f"history {a[k]['history']}: {fmt(a[k]['ms'], 2)}" for k in ("short", "filled", "long"))
        + f"; long/filled {a['long_over_filled']:.2f}, long/short {a['long_over_short']:.2f}")
    m = report["server_rss"]
    rss = ", ".join(f"{k.removesuffix('_mib')} {v:.0f}" for k, v in m.items() if k.endswith("_mib"))
    print(f"server RSS MiB: {rss}; KV per session {m['kv_bytes_per_session'] / 2**20:.1f} MiB")


def build_report(plan: Plan, quick: bool, model_dir: Path, gguf: Path, bandwidth: dict[str, float],
                 weights: dict[str, int], results: dict[str, EngineResult], append: dict[str, Any],
                 rss: dict[str, Any], llama_build_s: float | None) -> dict[str, Any]:
    """Assemble the JSON document (meta, limit, engines, ratios, latency, memory)."""
    import mlx.core as mx
    import mlx_lm

    limit = {"bandwidth_gb_s": bandwidth["gb_s"], **{f"weight_bytes_{k}": v for k, v in weights.items()},
             **{f"tok_s_{k}": bandwidth["gb_s"] * 1e9 / v for k, v in weights.items()}}
    reference = results["in_process"].decode[0].tokens
    engines = {name: engine_figures(r, plan, limit["tok_s_gguf" if name == "llama_cpp" else "tok_s_fp32"],
                                    None if name == "llama_cpp" else reference)
               for name, r in results.items()}
    med = {k: e["decode_tok_s"]["median"] for k, e in engines.items() if e["available"]}
    pairs = [("server", "in_process"), ("in_process", "mlx_lm"), ("server", "mlx_lm"), ("in_process", "llama_cpp")]
    ratios = {f"{a}/{b}": med[a] / med[b] for a, b in pairs if a in med and b in med}
    per_token = {k: e["per_token_ms"]["median"] for k, e in engines.items() if e["available"]}
    if llama_build_s is not None:
        engines["llama_cpp"]["build_from_source_s"] = llama_build_s
    return {
        "meta": {
            "date": datetime.date.today().isoformat(), "host": socket.gethostname(), "quick": quick,
            "plan": asdict(plan), "cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "blas": active_blas(),
            "model": str(model_dir), "gguf": str(gguf), "load_average_at_end": os.getloadavg(),
        },
        "bandwidth": bandwidth,
        "limit": limit,
        "engines": engines,
        "ratios": ratios,
        "grpc_overhead_ms_per_token": per_token["server"] - per_token["in_process"],
        "append_latency": append,
        "server_rss": rss,
    }


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    """Run the bench; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    reexec_with_openblas([str(Path(__file__).resolve()), *argv])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seconds-long subset (CI)")
    parser.add_argument("--out", type=Path, help="JSON path (default results/bench/<date>-<host>.json)")
    parser.add_argument("--llama-cpp-build-s", type=float, help="record how long building llama-cpp-python took")
    parser.add_argument("--pipeline", action="store_true",
                        help="also measure decode over a 3-worker shard route vs one process, and per-hop latency")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL

    from inference_engine.config import default_cache_dir
    from inference_engine.model.packaged import ensure_packaged_model, packaged_gguf_path

    model_dir, gguf = ensure_packaged_model(default_cache_dir()), packaged_gguf_path()
    prompts = load_prompts(model_dir)
    t0, load_at_start = time.perf_counter(), os.getloadavg()  # other work on the machine skews every figure

    def phase(name: str) -> None:
        print(f"[bench {time.perf_counter() - t0:6.1f}s] {name}", file=sys.stderr, flush=True)

    phase("memory bandwidth")
    bandwidth = memory_bandwidth(plan.bandwidth_bytes, reps=2 if args.quick else 5)
    with ExitStack() as stack:
        phase("server: start, RSS, AppendTokens latency")
        contenders: dict[str, Contender] = {}
        server, contenders["server"] = start_server(plan, prompts, stack)
        rss = measure_rss(server, plan, prompts)
        append = measure_append_latency(server, plan, prompts)
        phase("load in-process runtime, mlx_lm, llama.cpp")
        contenders["in_process"], fp32_bytes = start_in_process(plan, prompts, model_dir, stack)
        contenders["mlx_lm"] = start_mlx_lm(plan, prompts, model_dir)
        llama = start_llama_cpp(plan, prompts, gguf, stack)
        if isinstance(llama, Contender):
            contenders["llama_cpp"] = llama
        phase(f"decode and prefill, {plan.reps} repetitions interleaved over {', '.join(contenders)}")
        results = run_interleaved(contenders, plan)
    if isinstance(llama, str):
        results["llama_cpp"] = EngineResult(False, llama)
    results["in_process"].extra["sample_text"] = prompts.tokenizer.decode(results["in_process"].decode[0].tokens)[:200]
    weights = {"fp32": fp32_bytes, "gguf": gguf_weight_bytes(gguf)}
    report = build_report(plan, args.quick, model_dir, gguf, bandwidth, weights, results, append, rss,
                          args.llama_cpp_build_s)
    if args.pipeline:
        phase("shard pipeline: 3 workers vs single process")
        report["pipeline"] = measure_pipeline(plan, prompts, model_dir)
    report["meta"].update(bench_wall_s=time.perf_counter() - t0, load_average_at_start=load_at_start)

    out = args.out or ROOT / "results" / "bench" / f"{report['meta']['date']}-{report['meta']['host']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    if "pipeline" in report:
        p = report["pipeline"]
        print(f"pipeline {'/'.join(p['ranges'])}: decode {fmt(p['pipeline']['decode_tok_s'])} tok/s vs single "
              f"process {fmt(p['single_process']['decode_tok_s'])} ({p['pipeline_over_single']:.2f}x); per hop ms "
              + ", ".join(f"{h['layers']} {h['mean_ms']:.2f}" for h in p["hops"]))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
