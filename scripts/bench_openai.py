#!/usr/bin/env python
"""Benchmark the OpenAI-compatible HTTP API through the official `openai` client, against peers.

Same machine, same run: our `serve --http-port` (its defaults: q4_1 weights, the exact tile)
and, where available, mlx-lm's `mlx_lm server` on the packaged fp32 folder (OpenBLAS preloaded,
as our server runs) and llama-cpp-python's server (`python -m llama_cpp.server`, run by the
interpreter `--llama-cpp-python` names: a virtualenv of its own, requirements-bench.txt) on the
packaged Q4_1 GGUF our q4_1 weights are. An arm that cannot run is recorded with the reason.
Per engine:

- chat TTFT: one 8-turn conversation, each request sending the whole history (stateless, as
  every OpenAI client does), streamed, greedy, `max_tokens` 32: time from sending a turn to its
  first content chunk, per turn (our prefix cache reuses the previous turn's session: only
  the new message is prefilled). Ours also reports cached_tokens per turn, how many
  replies re-tokenized differently in the rendered history (`reply_reuse`), and which kind of
  kept entry served each prompt (`prefix_cache_lookups`: a full session, a fallback fork, none).
- throughput: completion tok/s of 1 client, and the aggregate of 8 concurrent clients
  (each 64 tokens on its own prompt, seeded sampling; usage.completion_tokens over wall time).
- seeded copies: a seeded sampled request alone, then 8 concurrent copies beside 4 other
  requests; how many copies equal the solo completion.

Usage: scripts/bench_openai.py [--out FILE] [--no-peers] [--llama-cpp-python PEER_VENV/bin/python].
Writes results/openai/<date>-<host>.json, with each peer's ratios to ours under "ratios", the CPU and the
memory bandwidth at the start and the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
QUESTIONS = ("What is the capital of France?", "And of Italy?", "Which one is bigger?", "Name a famous dish from each.",
             "Which is easier to cook?", "Give me its ingredients.", "How long does it take?", "Thanks, summarize.")
BANDWIDTH_BYTES = 512 << 20  # the memory-bandwidth probe's buffer, read at the start and at the end
TOPICS = ("the sea", "a mountain", "the moon", "a forest", "the desert", "a city", "the rain", "a river")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not ready after {timeout_s} s")


def _env_with_openblas() -> dict[str, str]:
    lib = subprocess.run([sys.executable, "-m", "inference_engine.blas"], capture_output=True, text=True,
                         cwd=REPO).stdout.strip()
    env = dict(os.environ)
    if lib:
        env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    return env


def start_ours(log: Path, *extra: str) -> tuple[subprocess.Popen, str, int]:
    """Our server with the HTTP API and metrics (`extra`: more `serve` flags, e.g. --model)."""
    port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "inference_engine", "serve", "--port", str(port), "--http-port",
                             str(http_port), "--metrics-port", str(metrics_port), "--max-sessions", "16", *extra],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    _wait_http(f"http://127.0.0.1:{http_port}/health", proc)
    return proc, f"http://127.0.0.1:{http_port}/v1", metrics_port


def start_mlx_lm(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir), "--port", str(port)],
                            cwd=REPO, env=_env_with_openblas(), stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            start_new_session=True)
    _wait_http(f"http://127.0.0.1:{port}/health", proc)  # its /v1/models scans a Hugging Face cache
    return proc, f"http://127.0.0.1:{port}/v1"


def start_llama_cpp(python: Path, gguf: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """llama-cpp-python's OpenAI server on `gguf`, run by `python` (the peer's virtualenv), on every core."""
    port = _free_port()
    threads = str(os.cpu_count() or 1)  # its default is half the cores; ours and mlx-lm's use them all
    proc = subprocess.Popen([str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--n_threads", threads, "--n_threads_batch", threads,
                             "--n_ctx", "2048"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    _wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc, f"http://127.0.0.1:{port}/v1"


def llama_cpp_unavailable(python: Path | None) -> str:
    """Why the llama.cpp arm cannot run with this interpreter ("" when it can)."""
    if python is None:
        return ("unavailable: no --llama-cpp-python given (the interpreter of a virtualenv with "
                "llama-cpp-python[server]==0.3.36, requirements-bench.txt; it compiles llama.cpp from source)")
    if not python.is_file():
        return f"unavailable: --llama-cpp-python {python} does not exist"
    done = subprocess.run([str(python), "-c", "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return f"unavailable: {python} cannot import llama_cpp.server: {done.stderr.strip()[-300:]}"
    return ""


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def chat_ttft(client: openai.OpenAI, model: str, system: str | None = None) -> dict[str, Any]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    ttft, cached, prompt_tokens = [], [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        start = time.perf_counter()
        first = None
        reply, usage = [], None
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - start
                reply.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        ttft.append(round((first or 0.0) * 1e3, 1))
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        cached.append(getattr(details, "cached_tokens", None) if details else None)
        prompt_tokens.append(usage.prompt_tokens if usage else None)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return {"ttft_ms": ttft, "turn1_ms": ttft[0], "turn8_ms": ttft[-1], "turn8_over_turn1": round(ttft[-1] / ttft[0], 2),
            "prompt_tokens": prompt_tokens, "cached_tokens": cached}


def _one(client: openai.OpenAI, model: str, topic: str, seed: int, max_tokens: int) -> tuple[int, str]:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Write a story about {topic}."}],
                                       max_tokens=max_tokens, temperature=0.8, seed=seed)
    return r.usage.completion_tokens, r.choices[0].message.content


def throughput(client: openai.OpenAI, model: str) -> dict[str, Any]:
    start = time.perf_counter()
    n, _ = _one(client, model, TOPICS[0], 1, 64)
    single = n / (time.perf_counter() - start)
    with cf.ThreadPoolExecutor(8) as pool:
        start = time.perf_counter()
        results = list(pool.map(lambda i: _one(client, model, TOPICS[i], 100 + i, 64), range(8)))
        wall = time.perf_counter() - start
    return {"one_client_tok_s": round(single, 1), "eight_clients_tok_s": round(sum(n for n, _ in results) / wall, 1),
            "eight_clients_tokens": [n for n, _ in results]}


def seeded_copies(client: openai.OpenAI, model: str) -> dict[str, Any]:
    _, solo = _one(client, model, "a lighthouse", 42, 32)
    with cf.ThreadPoolExecutor(12) as pool:
        copies = [pool.submit(_one, client, model, "a lighthouse", 42, 32) for _ in range(8)]
        noise = [pool.submit(_one, client, model, TOPICS[i], 7 + i, 24 + 4 * i) for i in range(4)]
        texts = [f.result()[1] for f in copies]
        for f in noise:
            f.result()
    return {"equal_to_solo": sum(t == solo for t in texts), "copies": 8}


def _metric(metrics_port: int, name: str, label: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    for line in text.splitlines():
        if line.startswith(f'{name}{{outcome="{label}"}} '):
            return float(line.split()[-1])
    return 0.0


CACHE_COUNTERS = {  # what the prefix cache did: how replies re-tokenized, which entries served prompts
    "reply_reuse": ("inference_engine_chat_reply_reuse_total", ("reused", "retokenized")),
    "prefix_cache_lookups": ("inference_engine_prefix_cache_lookups_total", ("hit", "fork", "miss")),
    "fallback_forks": ("inference_engine_prefix_cache_forks_total", ("taken", "discarded")),
}


def cache_counters(metrics_port: int) -> dict[str, Any]:
    """The prefix cache's counters now (take the difference of two readings)."""
    return {key: {o: _metric(metrics_port, name, o) for o in outcomes} for key, (name, outcomes) in CACHE_COUNTERS.items()}


def counters_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the counters added between two readings."""
    return {key: {o: after[key][o] - before[key][o] for o in after[key]} for key in after}


def chats(client: openai.OpenAI, model: str, reps: int) -> dict[str, Any]:
    """`reps` conversations (each its own system prompt: no prefix shared), per-turn median TTFT."""
    runs = [chat_ttft(client, model, f"You are assistant number {i}.") for i in range(reps)]
    turns = list(zip(*(r["ttft_ms"] for r in runs)))
    median = [sorted(t)[len(t) // 2] for t in turns]
    return {"median_ttft_ms": median, "turn1_ms": median[0], "turn8_ms": median[-1],
            "turn8_over_turn1": round(median[-1] / median[0], 2), "runs": runs}


def measure(base_url: str, model: str | None = None, reps: int = 3, timeout_s: float = 600) -> dict[str, Any]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)
    model = model or client.models.list().data[0].id
    chat_ttft(client, model, "Warm up.")  # first-call costs; another conversation (no prefix to reuse)
    return {"model": model, "chat": chats(client, model, reps), "throughput": throughput(client, model),
            "seeded": seeded_copies(client, model)}


def measure_peer(start: Callable[[], tuple[subprocess.Popen, str]], model: str | None = None) -> dict[str, Any] | str:
    """Start a peer's server, measure it, stop it; why it is unavailable if it cannot run (not fatal)."""
    try:
        proc, url = start()
        try:
            return measure(url, model=model)
        except Exception as exc:
            if proc.poll() is not None and proc.returncode < 0:  # e.g. SIGILL: a build for another CPU
                raise RuntimeError(f"its server died of {signal.Signals(-proc.returncode).name} ({exc})") from exc
            raise
        finally:
            _stop(proc)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        return f"unavailable: {type(exc).__name__}: {exc}"


def ratios_and_goals(engines: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bool]]:
    """Ours over each measured peer (TTFT: ours / theirs, lower is better; tok/s: ours / theirs), and the goals."""
    ours = engines["ours"]
    goals = {"turn8_le_1.5x_turn1": ours["chat"]["turn8_ms"] <= 1.5 * ours["chat"]["turn1_ms"],
             "seeded_8_of_8": ours["seeded"]["equal_to_solo"] == 8}
    ratios: dict[str, Any] = {}
    peers = {name: e for name, e in engines.items() if name != "ours" and isinstance(e, dict)}
    for name, peer in peers.items():
        ratios[name] = {
            "ttft_turn1_ours_over_peer": round(ours["chat"]["turn1_ms"] / peer["chat"]["turn1_ms"], 2),
            "ttft_turn8_ours_over_peer": round(ours["chat"]["turn8_ms"] / peer["chat"]["turn8_ms"], 2),
            "one_client_ours_over_peer": round(ours["throughput"]["one_client_tok_s"]
                                               / peer["throughput"]["one_client_tok_s"], 2),
            "eight_clients_ours_over_peer": round(ours["throughput"]["eight_clients_tok_s"]
                                                  / peer["throughput"]["eight_clients_tok_s"], 2),
        }
    if "mlx_lm" in ratios:
        goals["turn8_le_0.5x_mlx_lm"] = ratios["mlx_lm"]["ttft_turn8_ours_over_peer"] <= 0.5
    if "llama_cpp" in ratios:
        goals["turn8_le_1.0x_llama_cpp"] = ratios["llama_cpp"]["ttft_turn8_ours_over_peer"] <= 1.0
    if peers:
        best = max(peers, key=lambda n: peers[n]["throughput"]["eight_clients_tok_s"])
        goals[f"eight_clients_ge_2.5x_best_peer_{best}"] = ratios[best]["eight_clients_ours_over_peer"] >= 2.5
    return ratios, goals


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--llama-cpp-python", type=Path, default=None,
                        help="python of a virtualenv with llama-cpp-python[server] (requirements-bench.txt)")
    args = parser.parse_args()
    out = args.out or REPO / "results" / "openai" / f"{date.today()}-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / "logs"
    logs.mkdir(exist_ok=True)
    from benchkit.core import memory_bandwidth
    from benchkit.report import cpu_name

    report: dict[str, Any] = {"date": str(date.today()), "host": platform.node(), "cpu": cpu_name(),
                              "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
                              "bandwidth_start": memory_bandwidth(BANDWIDTH_BYTES, 5), "engines": {}}
    proc, url, metrics_port = start_ours(logs / "ours.log")
    try:
        before = cache_counters(metrics_port)
        report["engines"]["ours"] = measure(url)
        report["engines"]["ours"].update(counters_since(before, cache_counters(metrics_port)))
    finally:
        _stop(proc)
    if args.no_peers:
        report["engines"]["mlx_lm"] = report["engines"]["llama_cpp"] = "unavailable: --no-peers"
    else:
        from inference_engine.config import default_cache_dir
        from inference_engine.model.packaged import ensure_packaged_model, packaged_gguf_path

        report["engines"]["mlx_lm"] = measure_peer(
            lambda: start_mlx_lm(ensure_packaged_model(default_cache_dir()), logs / "mlx_lm.log"), "default_model")
        why_not = llama_cpp_unavailable(args.llama_cpp_python)
        report["engines"]["llama_cpp"] = why_not or measure_peer(
            lambda: start_llama_cpp(args.llama_cpp_python, packaged_gguf_path(), logs / "llama_cpp.log"))
    report["load_avg_end"] = os.getloadavg()
    report["bandwidth_end"] = memory_bandwidth(BANDWIDTH_BYTES, 5)  # this VM's drifts: a ratio across it means less
    report["ratios"], report["goals"] = ratios_and_goals(report["engines"])
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
