"""Figures, ratios and the printed table."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchkit.core import EngineResult, Plan, summary
from inference_engine.blas import active_blas

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
    for key in ("server_rss", "server_rss_fp32"):
        if key in report:
            m = report[key]
            rss = ", ".join(f"{k.removesuffix('_mib')} {v:.0f}" for k, v in m.items() if k.endswith("_mib"))
            print(f"{key.replace('_', ' ')} MiB: {rss}; KV per session {m['kv_bytes_per_session'] / 2**20:.1f} MiB")


def build_report(plan: Plan, quick: bool, model_dir: Path, gguf: Path, bandwidth: dict[str, float],
                 weights: dict[str, int], results: dict[str, EngineResult], append: dict[str, Any],
                 rss: dict[str, Any], llama_build_s: float | None) -> dict[str, Any]:
    """Assemble the JSON document (meta, limit, engines, ratios, latency, memory)."""
    import mlx.core as mx
    import mlx_lm

    limit = {"bandwidth_gb_s": bandwidth["gb_s"], **{f"weight_bytes_{k}": v for k, v in weights.items()},
             **{f"tok_s_{k}": bandwidth["gb_s"] * 1e9 / v for k, v in weights.items()}}
    reference = results["in_process"].decode[0].tokens

    def limit_of(name: str, r: EngineResult) -> float:  # the bytes the engine reads per token
        return limit["tok_s_gguf" if name == "llama_cpp" or r.extra.get("weights") == "q4_1" else "tok_s_fp32"]

    engines = {name: engine_figures(r, plan, limit_of(name, r), None if name == "llama_cpp" else reference)
               for name, r in results.items()}
    med = {k: e["decode_tok_s"]["median"] for k, e in engines.items() if e["available"]}
    pairs = [("server", "in_process"), ("in_process", "mlx_lm"), ("server", "mlx_lm"), ("in_process", "llama_cpp"),
             ("server", "llama_cpp"), ("server", "server_fp32")]
    ratios = {f"{a}/{b}": med[a] / med[b] for a, b in pairs if a in med and b in med}
    per_token = {k: e["per_token_ms"]["median"] for k, e in engines.items() if e["available"]}
    if llama_build_s is not None:
        engines["llama_cpp"]["build_from_source_s"] = llama_build_s
    return {
        "meta": {
            "date": datetime.date.today().isoformat(), "host": socket.gethostname(), "quick": quick,
            "plan": asdict(plan), "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
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


Q4_1_TARGETS = {  # issue 12: ratios from one run
    "decode_over_llama_cpp": ">= 0.8 (moonshot >= 1.0)",
    "aggregate_8_over_llama_cpp_single": ">= 2.0",
    "prefill_over_fp32_server": ">= 1.0",
    "idle_rss_over_fp32_server": "<= 0.4",
}


def q4_1_targets(report: dict[str, Any]) -> dict[str, Any]:
    """The q4_1 server against its targets: llama.cpp's decode, the fp32 server's prefill and memory."""
    eng, conc = report["engines"], report["concurrency"]["aggregate"]
    server, fp32, llama = eng["server"], eng["server_fp32"], eng.get("llama_cpp", {"available": False})
    ratios = {
        "prefill_over_fp32_server": server["prefill_tok_s"]["median"] / fp32["prefill_tok_s"]["median"],
        "idle_rss_over_fp32_server": report["server_rss"]["idle_mib"] / report["server_rss_fp32"]["idle_mib"],
    }
    if llama["available"]:
        ratios["decode_over_llama_cpp"] = server["decode_tok_s"]["median"] / llama["decode_tok_s"]["median"]
        alternated = report.get("aggregate_vs_llama_cpp")  # measured back to back: the figure to trust
        ratios["aggregate_8_over_llama_cpp_single"] = (alternated["median_ratio"] if alternated else
                                                       conc["many"]["tok_s"] / llama["decode_tok_s"]["median"])
    return {"weights": server.get("weights"), "ratios": ratios, "targets": Q4_1_TARGETS,
            "same_tokens_as_fp32": server["greedy_prefix_agreement"] == fp32["greedy_prefix_agreement"]
            == server["new_tokens"]}


BATCHING_TARGETS = {  # issue 11: ratios from one run
    "aggregate_8_over_1": ">= 4.0",
    "fp32_decode_over_row_gemv": ">= 0.95",
    "q4_1_decode_over_row_gemv": "(q4_1 is the default)",
    "fp32_prefill_over_mlx_lm": ">= 1.0",
    "q4_1_prefill_over_mlx_lm": ">= 1.0",
    "lookup_k4_over_greedy": ">= 2.0",
    "ttft_loaded_over_idle": "<= 2.0",
    "head_of_line_gap_over_idle": "<= 3.0",
    "fp32_aggregate_8_over_1": ">= 4.0",
    "fp32_lookup_k4_over_greedy": ">= 2.0",
    "fp32_ttft_loaded_over_idle": "<= 2.0",
    "fp32_head_of_line_gap_over_idle": "<= 3.0",
}


def batching_targets(report: dict[str, Any]) -> dict[str, Any]:
    """The exact batched path against issue 11's targets (the row-gemv arm only in a full run)."""
    eng, conc = report["engines"], report["concurrency"]
    med = {k: (e["decode_tok_s"]["median"], e["prefill_tok_s"]["median"]) for k, e in eng.items() if e["available"]}
    ratios = {"aggregate_8_over_1": conc["aggregate"]["many_over_one"]}
    if "server_row_gemv" in med:
        ratios["fp32_decode_over_row_gemv"] = med["server_fp32"][0] / med["server_row_gemv"][0]
        ratios["q4_1_decode_over_row_gemv"] = med["server"][0] / med["server_row_gemv"][0]
    if "mlx_lm" in med:
        ratios["fp32_prefill_over_mlx_lm"] = med["server_fp32"][1] / med["mlx_lm"][1]
        ratios["q4_1_prefill_over_mlx_lm"] = med["server"][1] / med["mlx_lm"][1]
    ratios.update(lookup_k4_over_greedy=conc["lookup"]["lookup_over_greedy"],
                  ttft_loaded_over_idle=conc["ttft"]["loaded_over_idle"],
                  head_of_line_gap_over_idle=conc["head_of_line"]["max_over_idle"])
    if "concurrency_fp32" in report:  # the same measures on the fp32 weights
        c32 = report["concurrency_fp32"]
        ratios.update(fp32_aggregate_8_over_1=c32["aggregate"]["many_over_one"],
                      fp32_lookup_k4_over_greedy=c32["lookup"]["lookup_over_greedy"],
                      fp32_ttft_loaded_over_idle=c32["ttft"]["loaded_over_idle"],
                      fp32_head_of_line_gap_over_idle=c32["head_of_line"]["max_over_idle"])
    return {"ratios": ratios, "targets": BATCHING_TARGETS, "head_of_line_append_tokens": conc["head_of_line"]["append_tokens"]}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine's architecture."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()
