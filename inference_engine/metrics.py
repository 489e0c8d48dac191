"""Every Prometheus metric of the server, on one registry (served by `serve --metrics-port`).

The objects are module globals so any layer can observe them without plumbing: the
servicer and the RPC interceptor record; the engine's scheduler observes `BATCH_ROWS` (rows
per forward) and `QUEUE_WAIT_SECONDS` (a call's wait for its first block). RPC metrics follow go-grpc-prometheus's names.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)  # ours only: no process/platform collectors, no global state

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_STEP_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)

RPCS_HANDLED = Counter(
    "grpc_server_handled", "RPCs completed, by method and status code",
    ("grpc_service", "grpc_method", "grpc_code"), registry=REGISTRY,
)
RPC_SECONDS = Histogram(
    "grpc_server_handling_seconds", "Wall time of an RPC from its start to its status (streams included)",
    ("grpc_service", "grpc_method"), buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
SESSIONS_IN_USE = Gauge(
    "inference_engine_sessions_in_use", "KV slabs in use (open sessions and closed ones still finishing a call)",
    registry=REGISTRY,
)
SESSION_SLOTS = Gauge("inference_engine_session_slots", "KV slabs in the pool (--max-sessions)", registry=REGISTRY)
POOL_BYTES_IN_USE = Gauge(
    "inference_engine_kv_pool_bytes_in_use", "KV cache bytes held by open sessions", registry=REGISTRY,
)
TOKENS_APPENDED = Counter("inference_engine_tokens_appended", "Tokens accepted by AppendTokens", registry=REGISTRY)
TOKENS_GENERATED = Counter("inference_engine_tokens_generated", "Tokens streamed by Generate", registry=REGISTRY)
TIME_TO_FIRST_TOKEN = Histogram(
    "inference_engine_time_to_first_token_seconds", "Generate: from the call's start to its first token",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
DECODE_STEP_SECONDS = Histogram(
    "inference_engine_decode_step_seconds", "Generate: time between consecutive streamed steps (one forward each)",
    buckets=_STEP_BUCKETS, registry=REGISTRY,
)
BATCH_ROWS = Histogram(
    "inference_engine_batch_rows", "Rows in one engine forward (observed by the scheduler)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=REGISTRY,
)
QUEUE_WAIT_SECONDS = Histogram(
    "inference_engine_queue_wait_seconds", "Time a work item waits before the engine runs it (observed by the scheduler)",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)

HTTP_REQUESTS = Counter(
    "http_server_requests", "OpenAI-compatible HTTP API requests completed, by route and status",
    ("route", "status"), registry=REGISTRY,
)
HTTP_SECONDS = Histogram(
    "http_server_request_seconds", "Wall time of an HTTP API request (streams included)", ("route",),
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
PREFIX_CACHE_LOOKUPS = Counter(
    "inference_engine_prefix_cache_lookups", "HTTP API prompts looked up in the exact prefix cache, by outcome "
    "(hit: a full session; fork: a fallback fork of an earlier prompt; miss)",
    ("outcome",), registry=REGISTRY,
)
PREFIX_CACHE_TOKENS = Counter(
    "inference_engine_prefix_cache_reused_tokens", "Prompt tokens served from kept sessions (not prefilled again)",
    registry=REGISTRY,
)
PREFIX_CACHE_FORKS = Counter(
    "inference_engine_prefix_cache_forks", "Fallback forks of a prompt whose reply may outgrow --max-rollback: taken "
    "(built and kept in the cache), discarded (the reply stayed within a rollback); lookups{outcome=\"fork\"} counts those used",
    ("outcome",), registry=REGISTRY,
)
PREFIX_CACHE_EVICTIONS = Counter(
    "inference_engine_prefix_cache_evictions", "Kept sessions closed to make room (LRU)", registry=REGISTRY,
)
REPLY_REUSE = Counter(
    "inference_engine_chat_reply_reuse", "Chat replies whose session is a prefix of the next turn's rendered "
    "history (reused) or not (retokenized: the template renders the reply to other tokens)", ("outcome",),
    registry=REGISTRY,
)
TOKENIZER_PROCESS_CALLS = Counter(
    "inference_engine_tokenizer_process_calls", "Large texts encoded (or token lists decoded) in the tokenizer "
    "processes (--text-process-chars), by operation", ("op",), registry=REGISTRY,
)
PERSIST_FAILURES = Counter(
    "inference_engine_persist_failures", "--persist-sessions: session writes that failed (disk full, folder gone)",
    registry=REGISTRY,
)
PERSIST_UNWRITTEN = Gauge(
    "inference_engine_persist_unwritten_sessions",
    "--persist-sessions: live sessions whose latest state could not be written (their files set aside as stale)",
    registry=REGISTRY,
)


def track_pool(slabs_in_use: Callable[[], int], slots: int, bytes_in_use: Callable[[], int]) -> None:
    """Point the pool gauges at a live session store (read at scrape time).

    Args:
        slabs_in_use: current slabs in use.
        slots: slabs in the pool.
        bytes_in_use: current KV bytes held.
    """
    SESSIONS_IN_USE.set_function(slabs_in_use)
    SESSION_SLOTS.set(slots)
    POOL_BYTES_IN_USE.set_function(bytes_in_use)
