#!/usr/bin/env python3
"""CPU the server process spends per maximal Tokenize, in-process vs through the tokenizer processes.

    .venv/bin/python scripts/tokenizer_process_cpu.py --calls 10 --out results/reliability/X.json

On a loaded 2-core machine a stream's worst gap mostly measures the machine (issue 28, defect 3:
the stream alone had worst gaps 8-17x its median at load 8-25), but what a large text costs the
process that holds the engine thread does not depend on the load: this is that cost, the CPU time
of every thread of this process (`time.process_time`) per `TextCodec.encode` of --max-text-chars
(65,536) CJK characters, with --text-process-chars 0 (all here) and 8192 (the default: a worker).
The `tokenize_response_*` arms add what a Tokenize does with the ids: the old servicer built
the response from the ids list (`list_then_message`); today's takes the tokens field serialized
by the worker (`serialized_in_the_worker`: servicer.Tokenize).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inference_engine.config import ServerConfig  # noqa: E402
from inference_engine.model.packaged import DEFAULT_MODEL, resolve_model_path  # noqa: E402
from inference_engine.text.codec import TextCodec  # noqa: E402
from inference_engine.v1 import runtime_pb2 as pb  # noqa: E402

CJK = "漢字かな交じり文"


def main(calls: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL, Path.home() / ".cache" / "inference_engine"))
    cfg = ServerConfig()
    text = (CJK * (cfg.max_text_chars // len(CJK) + 1))[:cfg.max_text_chars]
    local, pooled = TextCodec(tok, 0), TextCodec(tok, cfg.text_process_chars)
    pooled.encode(text)  # the worker's start is not a call's cost
    out: dict = {"chars": len(text), "calls": calls, "load_average_start": os.getloadavg()}
    try:
        def as_message() -> bytes:  # the old servicer.Tokenize: the ids list, then the message built from it
            return pb.TokenizeResponse(tokens=pooled.encode(text), text=text).SerializeToString()

        def as_serialized() -> bytes:  # today's servicer.Tokenize: the worker's serialized tokens field + the text
            return (pooled.encode_serialized(text, False, pb.TokenizeResponse, "tokens")
                    + pb.TokenizeResponse(text=text).SerializeToString())

        assert pb.TokenizeResponse.FromString(as_serialized()) == pb.TokenizeResponse.FromString(as_message())
        # Each arm's size: tokens for the encode arms, response bytes for the Tokenize ones.
        arms = {"in_process": lambda: len(local.encode(text)), "processes": lambda: len(pooled.encode(text)),
                "tokenize_response_list_then_message": lambda: len(as_message()),
                "tokenize_response_serialized_in_the_worker": lambda: len(as_serialized())}
        for name in [*arms, *(f"{a}_again" for a in arms)]:
            arm = arms[name.removesuffix("_again")]
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(calls):
                size = arm()
            out[name] = {"server_cpu_ms_per_call": round((time.process_time() - cpu) / calls * 1e3, 2),
                         "wall_ms_per_call": round((time.perf_counter() - wall) / calls * 1e3, 1), "size": size}
            print(name, out[name], flush=True)
    finally:
        pooled.close()
    out["load_average_end"] = os.getloadavg()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True, help="JSON path")
    args = parser.parse_args()
    data = main(args.calls)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
