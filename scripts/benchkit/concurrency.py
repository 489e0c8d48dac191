"""Many sessions at once through a real server: aggregate throughput, TTFT under load,
head-of-line gaps, and prompt lookup against greedy.

Every figure is a ratio of two measurements taken in the same run on the same server, so
the VM's drifting bandwidth cancels out. Clients are threads with the synchronous gRPC stub
(its calls release the GIL while they wait).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from benchkit.core import COPY_BACK, Plan, Prompts



def _stream(server: Any, sid: str, n: int, mode: int = 0, k: int = 0, times: list[float] | None = None,
            started: threading.Event | None = None, stop: threading.Event | None = None) -> list[int]:
    """Generate n tokens (ignore EOS), or fewer: the call is cancelled at the first token after
    `stop` is set. Appends each token's arrival time to `times`."""
    pb, tokens = server.pb, []
    req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode, num_draft_tokens=k)
    call = server.stub.Generate(req)
    for msg in call:
        now = time.perf_counter()
        tokens.extend(msg.tokens)
        if times is not None:
            times.extend([now] * len(msg.tokens))
        if started is not None and len(tokens) >= 2:
            started.set()
        if stop is not None and stop.is_set():
            call.cancel()
            break
    return tokens


def _sessions(server: Any, prompts: Prompts, n: int, length: int) -> list[str]:
    """n sessions, each prefilled with its own stretch of the corpus."""
    return [server.session(prompts.text(length, start=997 * i)) for i in range(n)]


def aggregate(server: Any, prompts: Prompts, n_sessions: int, new_tokens: int) -> dict[str, Any]:
    """n sessions generate at once; tokens per second over all of them (prefill excluded)."""
    sids = _sessions(server, prompts, n_sessions, 64)
    times: list[list[float]] = [[] for _ in sids]
    streams: list[list[int]] = [[] for _ in sids]
    barrier = threading.Barrier(n_sessions)

    def run(i: int) -> None:
        barrier.wait()
        streams[i] = _stream(server, sids[i], new_tokens, times=times[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_sessions)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = max(t[-1] for t in times)
    for sid in sids:
        server.close_session(sid)
    total = sum(len(t) for t in times)
    return {"sessions": n_sessions, "tokens": total, "seconds": end - start, "tok_s": total / (end - start),
            "first_stream": streams[0]}


def ttft_under_load(server: Any, prompts: Prompts, busy: int, new_tokens: int) -> dict[str, Any]:
    """Time to first token of a new session (chat prompt): idle, then while `busy` sessions stream."""

    def one_ttft() -> float:
        t = time.perf_counter()
        sid = server.session(prompts.chat)
        times: list[float] = []
        _stream(server, sid, 1, times=times)
        server.close_session(sid)
        return times[0] - t

    idle = statistics.median(one_ttft() for _ in range(3))
    sids = _sessions(server, prompts, busy, 64)
    ready = [threading.Event() for _ in sids]
    threads = [threading.Thread(target=_stream, args=(server, sid, new_tokens), kwargs={"started": ev})
               for sid, ev in zip(sids, ready)]
    for t in threads:
        t.start()
    for ev in ready:
        ev.wait(timeout=120)
    loaded = statistics.median(one_ttft() for _ in range(3))
    for t in threads:
        t.join()
    for sid in sids:
        server.close_session(sid)
    return {"busy_sessions": busy, "idle_ms": idle * 1e3, "loaded_ms": loaded * 1e3, "loaded_over_idle": loaded / idle}


def head_of_line(server: Any, prompts: Prompts, append_tokens: int, max_tokens: int = 4096) -> dict[str, Any]:
    """A streaming session's inter-token gaps while another session appends `append_tokens`
    tokens. The stream runs until the append has returned (at most `max_tokens`, the server's
    default cap): a fixed length ran out before a long append did once decoding got faster."""
    sid = server.session(prompts.chat)
    times: list[float] = []
    started, appended = threading.Event(), threading.Event()
    streamer = threading.Thread(target=_stream, args=(server, sid, max_tokens),
                                kwargs={"times": times, "started": started, "stop": appended})
    streamer.start()
    started.wait(timeout=120)
    time.sleep(1.0)  # idle gaps first
    other = server.session()
    t0 = time.perf_counter()
    server.append(other, prompts.text(append_tokens, start=3000))
    t1 = time.perf_counter()
    appended.set()
    streamer.join()
    server.close_session(sid)
    server.close_session(other)
    gaps = [(b - a, b) for a, b in zip(times, times[1:])]
    idle = [g for g, at in gaps if at < t0]
    during = [g for g, at in gaps if t0 <= at <= t1 + 0.001] or [0.0]
    idle_ms = statistics.median(idle) * 1e3 if idle else float("nan")
    ranked = sorted(during)
    p50, p99 = ranked[len(ranked) // 2] * 1e3, ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))] * 1e3
    return {"append_tokens": append_tokens, "append_s": t1 - t0, "idle_gap_ms": idle_ms,
            "max_gap_during_append_ms": max(during) * 1e3, "max_over_idle": max(during) * 1e3 / idle_ms,
            "p50_gap_during_append_ms": p50, "p99_gap_during_append_ms": p99, "p99_over_idle": p99 / idle_ms,
            "gaps_during_append": len(during)}


def lookup_vs_greedy(server: Any, prompts: Prompts, new_tokens: int, k: int, reps: int) -> dict[str, Any]:
    """Prompt lookup (K drafts) against greedy on a prompt whose answer copies it back."""
    tok = prompts.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Copy the following Python code exactly, without "
                                                                  "any change or comment:\n\n" + COPY_BACK}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    rates: dict[str, list[float]] = {"greedy": [], "lookup": []}
    streams: dict[str, list[int]] = {}
    for _ in range(reps):
        for name, mode in (("greedy", 0), ("lookup", 2)):
            sid = server.session(prompt)
            times: list[float] = []
            streams[name] = _stream(server, sid, new_tokens, mode=mode, k=k, times=times)
            server.close_session(sid)
            rates[name].append((len(times) - 1) / (times[-1] - times[0]))
    g, lk = statistics.median(rates["greedy"]), statistics.median(rates["lookup"])
    return {"k": k, "greedy_tok_s": g, "lookup_tok_s": lk, "lookup_over_greedy": lk / g,
            "identical": streams["greedy"] == streams["lookup"]}


def measure_concurrency(server: Any, prompts: Prompts, plan: Plan) -> dict[str, Any]:
    """The batching figures of one run (see the module docstring)."""
    n = plan.sessions
    one = aggregate(server, prompts, 1, plan.new_tokens)
    many = aggregate(server, prompts, n, plan.new_tokens)
    out: dict[str, Any] = {
        "aggregate": {"one": {k: v for k, v in one.items() if k != "first_stream"},
                      "many": {k: v for k, v in many.items() if k != "first_stream"},
                      "many_over_one": many["tok_s"] / one["tok_s"],
                      "first_stream_identical": one["first_stream"] == many["first_stream"]},
        "ttft": ttft_under_load(server, prompts, n - 1, 4 * plan.new_tokens),
        "head_of_line": head_of_line(server, prompts, plan.hol_append_tokens),
        "lookup": lookup_vs_greedy(server, prompts, plan.new_tokens, 4, plan.reps),
    }
    return out


def aggregate_vs_single(server: Any, prompts: Prompts, single: Any, sessions: int, new_tokens: int,
                        reps: int) -> dict[str, Any]:
    """`sessions` sessions at once on the server against another engine's single stream, alternated.

    `single` is a bench Contender (llama.cpp). Each repetition measures both back to back, so
    a drift of this VM's speed (it moves 10-50 % between runs) touches both sides alike.
    """
    many, one = [], []
    for _ in range(reps):
        one.append(single.decode(new_tokens).decode_tok_s)
        many.append(aggregate(server, prompts, sessions, new_tokens)["tok_s"])
    ratios = sorted(m / o for m, o in zip(many, one))
    return {"sessions": sessions, "reps": reps, "aggregate_tok_s": many, "single_tok_s": one,
            "ratios": ratios, "median_ratio": ratios[len(ratios) // 2]}
