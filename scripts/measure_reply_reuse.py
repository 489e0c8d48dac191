#!/usr/bin/env python
"""How often a chat reply re-tokenizes differently in the next turn's rendered history, per chat template,
and how often the prefix cache's fallback fork was the entry that served a prompt.

For each model, our server (its engine, runtime and HTTP API in this process, on 127.0.0.1:0, as
`serve --http-port` builds them) answers `--conversations` 8-turn chats of scripts/bench_openai.py
(each its own system prompt; greedy; `--max-tokens` per reply, above --max-rollback so every
request may keep a fork), each request re-sending the whole history through the official `openai`
client. Read from the metrics: `reply_reuse` (reused / retokenized), `prefix_cache_lookups` (hit: a
full session; fork: a fallback fork; miss) and `fallback_forks` (taken / discarded); per turn,
cached_tokens, prompt_tokens and completion_tokens; and each fork's wall time, whole (`fork_ms`) and
what the request waits for before its first token (`fork_wait_ms`: the state copy on the engine
thread). No peers: a short run beside other work.

A second chat template: the packaged Gemma-3-270M is the base model, whose tokenizer has none; it
is given Gemma 3's instruction-tuned template (GEMMA3_TEMPLATE below, string contents only), which
trims each message, so a reply with a trailing space or newline renders to other tokens.

Usage: scripts/measure_reply_reuse.py [--models packaged:smollm2-135m,packaged:gemma3-270m]
       [--conversations 2] [--max-tokens 32] [--out FILE]
Writes results/openai/reply-reuse-<date>-<host>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Awaitable, Callable

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_openai import CACHE_COUNTERS, QUESTIONS, REPO, counters_since  # noqa: E402

sys.path.insert(0, str(REPO))
from inference_engine import metrics  # noqa: E402
from inference_engine.config import add_server_flags, config_from_args  # noqa: E402
from inference_engine.runtime.runtime import Runtime  # noqa: E402
from inference_engine.security.authenticator import Authenticator  # noqa: E402
from inference_engine.server.openai_api.fallback_fork import FallbackFork  # noqa: E402
from inference_engine.server.openai_api.http_server import HttpFrontend  # noqa: E402
from inference_engine.server.server import build_engine  # noqa: E402

GEMMA3_TEMPLATE = (  # google/gemma-3-*-it's chat template, for string contents
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def counters() -> dict[str, dict[str, float]]:
    """The prefix cache's counters now (the names and outcomes scripts/bench_openai.py reads)."""
    return {key: {o: metrics.REGISTRY.get_sample_value(name, {"outcome": o}) or 0.0 for o in outcomes}
            for key, (name, outcomes) in CACHE_COUNTERS.items()}


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


async def converse(client: openai.AsyncOpenAI, model: str, system: str, max_tokens: int) -> dict[str, list]:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    cached, prompt_tokens, lengths = [], [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        r = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        details = r.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        prompt_tokens.append(r.usage.prompt_tokens)
        lengths.append(r.usage.completion_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    return {"cached_tokens": cached, "prompt_tokens": prompt_tokens, "completion_tokens": lengths}


async def measure_model(spec: str, conversations: int, max_tokens: int) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    cfg = config_from_args(parser.parse_args(["--model", spec, "--max-sessions", "16"]))
    engine = await asyncio.to_thread(build_engine, cfg)
    template = None
    tokenizer = engine.loaded.tokenizer
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None) and "gemma" in spec:
        tokenizer.chat_template = template = GEMMA3_TEMPLATE
    runtime = Runtime(engine, cfg)
    http = HttpFrontend(cfg, Authenticator())
    port = await http.start("127.0.0.1", 0)
    http.attach(runtime)
    runtime.start()
    fork_ms: list[float] = []  # each fork, start to built (the fallback's, beside the decoding; and n > 1's)
    wait_ms: list[float] = []  # each fallback fork's wait before the first token (its state copied)

    def timed(fn: Callable[..., Awaitable[Any]], into: list[float]) -> Callable[..., Awaitable[Any]]:
        async def run(*args: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return await fn(*args, **kw)
            finally:
                into.append(round((time.perf_counter() - start) * 1e3, 1))
        return run

    service = http.state.serving.service
    service.transfer.fork = timed(service.transfer.fork, fork_ms)
    start_fork = FallbackFork.start
    FallbackFork.start = timed(start_fork, wait_ms)  # this model's run only (restored below)
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                      timeout=1200) as client:
            model = (await client.models.list()).data[0].id
            before = counters()
            runs = [await converse(client, model, f"You are assistant number {i}.", max_tokens)
                    for i in range(conversations)]
        return {"model": model, "chat_template": "gemma3 (given; the base model has none)" if template else "its own",
                "max_rollback": cfg.max_rollback, **counters_since(before, counters()),
                "fork_ms_median": _median(fork_ms), "fork_wait_ms_median": _median(wait_ms), "fork_ms": fork_ms,
                "fork_wait_ms": wait_ms,
                "runs": runs}
    finally:
        FallbackFork.start = start_fork
        await http.stop(1.0)
        await runtime.stop()
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="packaged:smollm2-135m,packaged:gemma3-270m")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or REPO / "results" / "openai" / f"reply-reuse-{date.today()}-{platform.node()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": str(date.today()), "host": platform.node(), "cpus": os.cpu_count(),
                              "load_avg_start": os.getloadavg(), "conversations": args.conversations,
                              "turns": len(QUESTIONS), "max_tokens": args.max_tokens, "models": {}}
    for spec in args.models.split(","):
        try:
            report["models"][spec] = asyncio.run(measure_model(spec, args.conversations, args.max_tokens))
        except Exception as exc:  # noqa: BLE001 - a model that cannot serve chat is reported, not fatal
            report["models"][spec] = f"unavailable: {type(exc).__name__}: {exc}"
    report["load_avg_end"] = os.getloadavg()
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
