#!/usr/bin/env python
"""Our server against llama.cpp on the same GGUF file: greedy token agreement, decode and prefill speed.

Same machine, one run, one engine at a time:
- ours: `serve --model MODEL` (default `packaged:gemma3-270m`, its Q4_K_M GGUF) over gRPC. The
  script measures whichever weight path `serve` takes for the file and records it (GetModelInfo's
  family, weight formats and attention kinds, and the server's loading lines).
- llama.cpp: llama-cpp-python on the same file, in a child process run by the interpreter
  `--llama-cpp-python` names (a virtualenv of its own: requirements-bench.txt). Without it the
  arm is recorded as skipped with the reason.

Per prompt, both decode `--new-tokens` greedy tokens (EOS ignored) from the same token ids (ours'
tokenization; whether llama.cpp tokenizes the text alike is recorded). Agreement is reported, not
asserted: llama.cpp multiplies int8-quantized activations, we compute exact fp32 products of the
dequantized weights, so the argmax may part where two logits are close.
- decode tok/s: tokens after the first over the time from the first to the last (median of prompts);
- prefill tok/s: a `--prefill-tokens` prompt into an empty cache (ours: one AppendTokens; llama.cpp:
  one `eval`), median of `--reps`.

Usage: scripts/compare_llama_cpp.py --llama-cpp-python PEER_VENV/bin/python [--model M] [--out FILE]
Writes results/llama-cpp/<date>-<host>-<model>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROMPTS = ("The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):\n", "The three primary colors are", "Water boils at a temperature of")
FILLER = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made, sold and read across Europe and beyond. ")

# Run by the peer's interpreter: a job (JSON on stdin) in, results (JSON on stdout) out.
LLAMA_JOB = r"""
import json, sys, time
import llama_cpp
job = json.load(sys.stdin)
llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_batch=512, n_threads=job["threads"],
                      n_threads_batch=job["threads"], seed=0, verbose=False)
out = {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode(),
       "tokenized": [llm.tokenize(t.encode(), add_bos=True, special=False) for t in job["texts"]],
       "greedy": [], "prefill_s": []}
for ids in job["prompts"]:
    llm.reset()
    start, times, tokens = time.perf_counter(), [], []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter() - start)
        tokens.append(int(token))
        if len(tokens) == job["new_tokens"]:
            break
    out["greedy"].append({"tokens": tokens, "times": times})
for _ in range(job["reps"]):
    llm.reset()
    start = time.perf_counter()
    llm.eval(job["prefill"])
    out["prefill_s"].append(time.perf_counter() - start)
json.dump(out, sys.stdout)
"""


def agreement(ours: list[int], theirs: list[int]) -> dict[str, Any]:
    """How two greedy continuations of one prompt agree: the common prefix, and position-wise matches."""
    prefix = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    same = sum(a == b for a, b in zip(ours, theirs))
    n = min(len(ours), len(theirs))
    return {"common_prefix": prefix, "positions_equal": same, "compared": n,
            "fraction_equal": round(same / n, 3) if n else None}


def decode_tok_s(times: list[float]) -> float | None:
    """Tokens after the first over the time from the first token to the last."""
    return round((len(times) - 1) / (times[-1] - times[0]), 2) if len(times) > 1 and times[-1] > times[0] else None


class Ours:
    """`python -m inference_engine serve --model MODEL --port 0` as a subprocess, with a sync gRPC stub."""

    def __init__(self, model: str, log: Path):
        import grpc

        from inference_engine.readiness import wait_ready
        from inference_engine.v1 import runtime_pb2 as pb
        from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

        self.log_path, self.pb = log, pb
        command = [sys.executable, "-m", "inference_engine", "serve", "--model", model, "--port", "0",
                   "--max-sessions", "4"]
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                                     start_new_session=True)
        self.channel = grpc.insecure_channel(wait_ready(self.proc, timeout_s=1800))
        self.stub = pb_grpc.RuntimeServiceStub(self.channel)

    def info(self) -> dict[str, Any]:
        """GetModelInfo, and the server's lines saying which weights and kernels it loaded."""
        m = self.stub.GetModelInfo(self.pb.GetModelInfoRequest())
        keys = ("loading", "DEGRADED", "weights", "mode:", "BLAS in use", "native")
        lines = [line for line in self.log_path.read_text().splitlines() if any(k in line for k in keys)]
        return {"model_name": m.model_name, "family": m.family, "weight_formats": list(m.weight_formats),
                "layer_attention": list(m.layer_attention), "exact": m.exact, "block_size": m.block_size,
                "kernels": m.kernels, "model_fingerprint": m.model_fingerprint, "log": lines[:20]}

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(self.pb.TokenizeRequest(text=text, add_special_tokens=True)).tokens)

    def detokenize(self, tokens: list[int]) -> str:
        return self.stub.Detokenize(self.pb.DetokenizeRequest(tokens=tokens)).text

    def _session(self) -> str:
        return self.stub.CreateSession(self.pb.CreateSessionRequest(client_label="compare")).session_id

    def greedy(self, ids: list[int], n: int) -> dict[str, Any]:
        """`n` greedy tokens after `ids` (EOS ignored), with each token's time from the request."""
        sid = self._session()
        start, times, tokens = time.perf_counter(), [], []
        self.stub.AppendTokens(self.pb.AppendTokensRequest(session_id=sid, tokens=ids))
        for msg in self.stub.Generate(self.pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True)):
            for token in msg.tokens:
                times.append(time.perf_counter() - start)
                tokens.append(int(token))
        self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=sid))
        return {"tokens": tokens, "times": times}

    def prefill_s(self, ids: list[int]) -> float:
        sid = self._session()
        start = time.perf_counter()
        self.stub.AppendTokens(self.pb.AppendTokensRequest(session_id=sid, tokens=ids))
        elapsed = time.perf_counter() - start
        self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=sid))
        return elapsed

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_llama_cpp(python: Path | None, job: dict[str, Any], timeout_s: float = 1800) -> dict[str, Any] | str:
    """The llama.cpp arm in a child process of the peer's interpreter; why it is unavailable if it cannot run."""
    if python is None:
        return ("skipped: no --llama-cpp-python given (the interpreter of a virtualenv with "
                "llama-cpp-python==0.3.36, requirements-bench.txt; it compiles llama.cpp from source)")
    if not python.is_file():
        return f"skipped: --llama-cpp-python {python} does not exist"
    try:
        done = subprocess.run([str(python), "-c", LLAMA_JOB], input=json.dumps(job), capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"unavailable: llama.cpp did not finish within {timeout_s:g} s"
    if done.returncode != 0:
        return f"unavailable: llama.cpp exited with status {done.returncode}: {done.stderr.strip()[-500:]}"
    return json.loads(done.stdout)


def compare(ours: dict[str, Any], peer: dict[str, Any] | str, texts: list[str], ours_ids: list[list[int]],
            prefill_tokens: int) -> dict[str, Any]:
    """Agreement per prompt and the speed ratios (ours over llama.cpp) from both arms' raw results."""
    if isinstance(peer, str):
        return {"llama_cpp": peer, "prompts": [{"prompt": t, "ours_text": g["text"], "ours_tokens": g["tokens"]}
                                               for t, g in zip(texts, ours["greedy"])]}
    prompts = []
    for text, ids, mine, theirs, tok in zip(texts, ours_ids, ours["greedy"], peer["greedy"], peer["tokenized"]):
        prompts.append({"prompt": text, "tokenization_equal": tok == ids, **agreement(mine["tokens"], theirs["tokens"]),
                        "ours_text": mine["text"], "ours_tokens": mine["tokens"], "llama_cpp_tokens": theirs["tokens"]})
    decode = statistics.median(d for d in (decode_tok_s(g["times"]) for g in peer["greedy"]) if d)
    prefill = prefill_tokens / statistics.median(peer["prefill_s"])
    return {
        "prompts": prompts,
        "tokens_equal": f"{sum(p['positions_equal'] for p in prompts)}/{sum(p['compared'] for p in prompts)}",
        "prompts_identical": f"{sum(p['common_prefix'] == p['compared'] for p in prompts)}/{len(prompts)}",
        "llama_cpp": {"version": peer["version"], "system_info": peer["system_info"], "decode_tok_s": round(decode, 2),
                      "prefill_tok_s": round(prefill, 1), "prefill_s": [round(s, 4) for s in peer["prefill_s"]]},
        "decode_ours_over_llama_cpp": round(ours["decode_tok_s"] / decode, 3),
        "prefill_ours_over_llama_cpp": round(ours["prefill_tok_s"] / prefill, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="packaged:gemma3-270m", help="packaged name or .gguf file (both arms)")
    parser.add_argument("--llama-cpp-python", type=Path, default=None,
                        help="python of a virtualenv with llama-cpp-python (requirements-bench.txt)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from inference_engine.config import default_cache_dir
    from inference_engine.model.packaged import resolve_model_path

    gguf = resolve_model_path(args.model, default_cache_dir()).resolve()
    stem = args.model.removeprefix("packaged:") if args.model.startswith("packaged:") else gguf.stem
    out = args.out or REPO / "results" / "llama-cpp" / f"{date.today()}-{platform.node()}-{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": str(date.today()), "host": platform.node(), "cpus": os.cpu_count(),
                              "model": args.model, "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
                              "new_tokens": args.new_tokens, "prefill_tokens": args.prefill_tokens,
                              "load_avg_start": os.getloadavg()}
    log = Path(tempfile.mkstemp(prefix="compare-llama-cpp-", suffix=".log")[1])
    start = time.perf_counter()
    server = Ours(args.model, log)
    try:
        report["ours_start_s"] = round(time.perf_counter() - start, 1)
        report["served"] = server.info()
        ids = [server.tokenize(t) for t in PROMPTS]
        prefill = server.tokenize(FILLER * 40)[: args.prefill_tokens]
        server.greedy(ids[0], 4)  # first-call costs
        greedy = [server.greedy(i, args.new_tokens) for i in ids]
        for g in greedy:
            g["text"] = server.detokenize(g["tokens"])
        prefill_s = [server.prefill_s(prefill) for _ in range(args.reps)]
    finally:
        server.close()
    decode = statistics.median(d for d in (decode_tok_s(g["times"]) for g in greedy) if d)
    ours = {"greedy": greedy, "decode_tok_s": round(decode, 2),
            "prefill_tok_s": round(args.prefill_tokens / statistics.median(prefill_s), 1),
            "prefill_s": [round(s, 4) for s in prefill_s]}
    report["ours"] = {k: v for k, v in ours.items() if k != "greedy"}
    job = {"gguf": str(gguf), "n_ctx": 1024, "threads": os.cpu_count(), "texts": list(PROMPTS), "prompts": ids,
           "new_tokens": args.new_tokens, "prefill": prefill, "reps": args.reps}
    report.update(compare(ours, run_llama_cpp(args.llama_cpp_python, job), list(PROMPTS), ids, args.prefill_tokens))
    report["load_avg_end"] = os.getloadavg()
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "prompts"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
