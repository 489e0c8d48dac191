"""Server configuration: one frozen dataclass built at start-up from CLI flags and env."""

from __future__ import annotations

import argparse
import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from inference_engine.address import default_address
from inference_engine.flag_ranges import FlagRange, check_ranges
from inference_engine.model.packaged import DEFAULT_MODEL, DRAFT_MODEL
from inference_engine.security.flags import (
    add_client_security_flags,
    add_server_security_flags,
    check_exposure,
    client_security_from_args,
    server_security_from_args,
)
from inference_engine.security.settings import ClientSecurity, ServerSecurity

ORIGIN = re.compile(r"\*|https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")  # a web origin
DEFAULT_MAX_TILE = 64  # largest block size the start-up probe tries (server and shard workers alike)


def default_cache_dir() -> Path:
    """Where converted models live: $INFERENCE_ENGINE_CACHE or ~/.cache/inference_engine."""
    env = os.environ.get("INFERENCE_ENGINE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "inference_engine"


@dataclass(frozen=True)
class ServerConfig:
    """Every knob of a server process."""

    host: str = "127.0.0.1"  # address to bind
    port: int = 50051  # 0 picks a free port
    model: str = DEFAULT_MODEL  # packaged model name or mlx-lm folder
    weights: str = "q4_1"  # q4_1: the GGUF's blocks through the exact q4 kernel; fp32: the converted folder (same bits)
    draft_model: str | None = DRAFT_MODEL  # draft model for SPECULATIVE_DRAFT; None = no draft model
    cache_dir: Path = field(default_factory=default_cache_dir)  # converted-model cache
    max_sessions: int = 8  # KV slabs in the pool
    max_kv_bytes: int = 0  # K/V bytes all sessions may hold, draft caches included (0 = bounded by max_sessions only)
    default_sink: int = 4  # sink tokens when a session asks for 0
    default_window: int = 1024  # window tokens when a session asks for 0
    max_sink: int = 64  # largest sink a session may ask for
    max_window: int = 8192  # largest window a session may ask for
    max_rollback: int = 8  # most trailing tokens commit_or_truncate may drop (largest draft block)
    max_tokens_per_request: int = 8192  # tokens in one AppendTokens
    max_text_chars: int = 65536  # characters of text in one request (text, or messages' contents together), before tokenizing
    text_process_chars: int = 8192  # texts of >= this many characters (token lists: tokens) use tokenizer processes
    max_new_tokens: int = 4096  # upper bound of GenerateRequest.max_new_tokens
    default_new_tokens: int = 512  # max_new_tokens of a request that says 0
    session_ttl_s: float = 900.0  # idle sessions expire after this
    exact: bool = True  # run on the probed bit-exact tile; False = plain large blocks
    max_tile: int = DEFAULT_MAX_TILE  # largest block size the probe tries
    plain_block: int = 64  # block size when exact is off
    max_batch_rows: int = 0  # most rows in one batched forward across sessions (0 = the probed block)
    append_rows: int = 0  # AppendTokens rows per forward while a Generate streams (0 = learnt: streams' gaps <= 2x)
    grace_s: float = 10.0  # drain time for in-flight RPCs at shutdown
    shards: tuple[str, ...] = ()  # host:port of running shard workers, head first (() = layers run here)
    spawn_shards: tuple[str, ...] = ()  # layer ranges START:END of workers this server spawns and restarts
    shard_recovery_timeout_s: float = 60.0  # how long a call waits for a silent shard route before UNAVAILABLE
    shard_step_timeout_s: float = 30.0  # a worker silent this long on a step has failed (at most the above)
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, mTLS, bearer tokens of the RuntimeService port
    shard_security: ClientSecurity = field(default_factory=ClientSecurity)  # what this server presents to --shards workers
    metrics_host: str = "127.0.0.1"  # address of the Prometheus endpoint
    metrics_port: int = 0  # Prometheus endpoint port; 0 = no endpoint
    # -- the OpenAI-compatible HTTP API (docs/openai.md)
    http_port: int = 0  # port of the HTTP API on `host` (same TLS and tokens as gRPC); 0 = no HTTP API
    http_allow_origins: tuple[str, ...] = ()  # web origins whose pages may call the HTTP API (CORS); () = none
    prefix_cache_bytes: int = 1 << 29  # K/V bytes of sessions the HTTP API keeps for prefix reuse (0 = none kept)
    prefix_cache_forks: bool = True  # also keep a fork at the end of a prompt whose reply may outgrow --max-rollback
    # -- session snapshots and persistence (docs/snapshots.md)
    snapshot_dir: Path | None = None  # where SnapshotSession(to_dir) writes and RestoreSession(file) reads
    max_snapshot_bytes: int = 1 << 30  # largest snapshot RestoreSession accepts (its header's size, checked first)
    max_transfers: int = 4  # SnapshotSession/RestoreSession calls running at once (each holds one snapshot)
    max_transfers_per_identity: int = 2  # of which one identity may run
    persist_dir: Path | None = None  # --persist-sessions: live sessions survive restarts here
    persist_every: int = 1  # write a session after every N-th completed AppendTokens/Generate
    persist_interval_s: float = 30.0  # and every S seconds if it has calls not yet written (0 = never)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Register the flags that build a ServerConfig."""
    d = ServerConfig()
    host, port = default_address()
    parser.add_argument("--host", default=host, help="address to bind (the default comes from $INFERENCE_ENGINE_ADDRESS "
                        "when set)")
    parser.add_argument("--port", type=int, default=port, help="port to bind, 0..65535; 0 = pick a free port")
    parser.add_argument("--model", default=d.model,
                        help="packaged model name (`python -m inference_engine models` lists them), an mlx-lm "
                        "folder or a .gguf file")
    add_weights_flag(parser, d.weights)
    parser.add_argument(
        "--draft-model", default=None,
        help="draft model for SPECULATIVE_DRAFT (packaged name or folder, 'none' to disable); "
        f"{DRAFT_MODEL} when serving the packaged model, else none",
    )
    parser.add_argument("--max-sessions", type=int, default=d.max_sessions, help="KV slabs in the pool: most sessions "
                        "open at once (1 or more)")
    parser.add_argument("--max-kv-bytes", type=int, default=d.max_kv_bytes,
                        help="K/V bytes all sessions may hold, draft caches included (0 = no bound beyond "
                        "--max-sessions)")
    parser.add_argument("--default-sink", type=int, default=d.default_sink,
                        help="first tokens a session keeps when it asks for 0 (0..--max-sink)")
    parser.add_argument("--default-window", type=int, default=d.default_window,
                        help="last tokens a session keeps when it asks for 0 (1..--max-window); a longer chat "
                        "loses its middle")
    parser.add_argument("--max-sink", type=int, default=d.max_sink, help="largest sink a session may ask for")
    parser.add_argument("--max-window", type=int, default=d.max_window, help="largest window a session may ask for")
    parser.add_argument("--max-rollback", type=int, default=d.max_rollback,
                        help="most trailing tokens a verification may drop: the largest draft block (1 or more)")
    parser.add_argument("--max-tokens-per-request", type=int, default=d.max_tokens_per_request,
                        help="most tokens one AppendTokens may append")
    parser.add_argument("--max-text-chars", type=int, default=d.max_text_chars,
                        help="characters of text one request may carry (text, or the messages' contents together), "
                        "checked before tokenizing")
    parser.add_argument("--text-process-chars", type=int, default=d.text_process_chars,
                        help="texts of at least this many characters (token lists of this many tokens) are "
                        "tokenized in separate low-priority processes, so they cannot slow other clients' "
                        "streams (0 = all in the server process)")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                        help="largest max_new_tokens a Generate may ask for")
    parser.add_argument("--default-new-tokens", type=int, default=d.default_new_tokens,
                        help="max_new_tokens of a Generate that says 0 (1..--max-new-tokens)")
    parser.add_argument("--session-ttl", type=float, default=d.session_ttl_s, help="idle seconds before expiry")
    parser.add_argument("--no-exact", action="store_true", help="plain large blocks (not chunking-invariant)")
    parser.add_argument("--max-tile", type=int, default=d.max_tile, help="largest block size the start-up probe tries")
    parser.add_argument("--max-batch-rows", type=int, default=d.max_batch_rows,
                        help="most rows of all sessions in one forward (0 = the probed block)")
    parser.add_argument("--append-rows", type=int, default=d.append_rows,
                        help="AppendTokens rows per forward while a Generate streams (0 = as many as keep the "
                             "streams' inter-token gap within 2x, learnt from the engine's own timings)")
    parser.add_argument("--grace", type=float, default=d.grace_s, help="seconds to drain RPCs on SIGTERM")
    shards = parser.add_mutually_exclusive_group()
    shards.add_argument("--shards", default="", metavar="HOST:PORT,...",
                        help="run the model's layers on these running shard workers (head first)")
    shards.add_argument("--spawn-shards", default="", metavar="A:B,B:C,...",
                        help="spawn and supervise one shard worker per layer range (restarted if it dies); the route and the "
                             "workers authenticate each other with mTLS under a CA of this server's own")
    parser.add_argument("--shard-recovery-timeout", type=float, default=d.shard_recovery_timeout_s,
                        help="seconds a call waits for a silent shard route before failing UNAVAILABLE (and start-up "
                        "waits for --shards workers still loading before it gives up)")
    parser.add_argument("--shard-step-timeout", type=float, default=d.shard_step_timeout_s,
                        help="seconds a shard worker may take to answer one step before it counts as failed and the "
                        "session is restored by replay (at most --shard-recovery-timeout)")
    add_server_security_flags(parser)
    add_client_security_flags(parser, "shard-", "the --shards workers")
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port,
                        help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0 = off)")
    parser.add_argument("--metrics-host", default=d.metrics_host, help="address of the metrics endpoint")
    parser.add_argument("--http-port", type=int, default=d.http_port,
                        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions) on --host "
                        "at this port, with the gRPC port's TLS and tokens (0 = off, the default)")
    parser.add_argument("--http-allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="let web pages of ORIGIN (scheme://host[:port], or * for any) call the HTTP API from a "
                        "browser (CORS; repeatable; tokens are still required when set; default: none)")
    parser.add_argument("--prefix-cache-bytes", type=int, default=d.prefix_cache_bytes,
                        help="K/V bytes of finished HTTP requests' sessions kept to reuse their prefix exactly "
                        "(counted in --max-kv-bytes, evicted least recently used before a live session is refused; "
                        "0 = keep none; default %(default)s)")
    parser.add_argument("--no-prefix-cache-forks", action="store_true",
                        help="keep no fork at the end of a prompt as the prefix cache's fallback (by default one is kept "
                        "when the reply may outgrow --max-rollback and the cache and pool have room: it serves a next "
                        "turn whose client re-tokenized or edited the reply, at the cost of a fork per such request)")
    # -- session snapshots and persistence
    parser.add_argument("--snapshot-dir", type=Path, default=None,
                        help="folder for SnapshotSession(to_dir) files and RestoreSession(file)")
    parser.add_argument("--max-snapshot-bytes", type=int, default=d.max_snapshot_bytes,
                        help="largest snapshot RestoreSession accepts (bytes or file; the size its header "
                        "declares is checked before the body is read)")
    parser.add_argument("--max-transfers", type=int, default=d.max_transfers,
                        help="SnapshotSession/RestoreSession calls running at once; more are RESOURCE_EXHAUSTED")
    parser.add_argument("--max-transfers-per-identity", type=int, default=d.max_transfers_per_identity,
                        help="of --max-transfers, how many one identity may run")
    parser.add_argument("--persist-sessions", type=Path, default=None, metavar="DIR",
                        help="write live sessions here (after calls, periodically, at shutdown) and restore them "
                        "with their ids at start-up")
    parser.add_argument("--persist-every", type=int, default=d.persist_every,
                        help="write a session after every N-th completed AppendTokens/Generate")
    parser.add_argument("--persist-interval", type=float, default=d.persist_interval_s,
                        help="seconds between writes of sessions with unwritten calls (0 = only after calls)")


def add_weights_flag(parser: argparse.ArgumentParser, default: str) -> None:
    """--weights fp32|q4_1 (server and shard worker alike)."""
    parser.add_argument("--weights", choices=("q4_1", "fp32"), default=default,
                        help="q4_1 (the first type it served; the name stays): stream the GGUF's own blocks, whatever "
                        "their types (the packaged SmolLM2's Q4_1/Q8_0, Gemma-3-270M's Q4_K/Q5_0/Q6_K/Q8_0, a .gguf "
                        "model's of any served type) through the exact block kernels (bitwise the fp32 logits; fp32 "
                        "is served, and logged, where the kernel is unavailable); fp32: the converted or dequantized "
                        "fp32 weights")


def prepare_private_folder(folder: Path) -> None:
    """Create `folder` if missing, 0700 (it holds sessions' token logs and K/V), and check a file can be made in it.

    Raises:
        OSError: it is not a folder, or cannot be created or written (e.g. read-only, immutable, another
            owner's); `strerror` names the folder and the cause.
    """
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A real write: permission bits say nothing for root, a read-only mount or `chattr +i`.
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        probe.unlink()
    except FileExistsError as exc:  # mkdir(exist_ok=True) on a regular file
        raise OSError(errno.ENOTDIR, f"{folder} exists and is not a folder") from exc
    except OSError as exc:
        raise OSError(exc.errno, f"{folder} is not a writable folder ({exc.strerror or exc})") from exc


def _draft_choice(flag: str | None, model: str) -> str | None:
    if flag is None:
        return DRAFT_MODEL if model == DEFAULT_MODEL else None
    return None if flag.lower() == "none" else flag


def _split(flag: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in flag.split(",") if part.strip())


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the ServerConfig from parsed flags (and the cache-dir environment variable).

    Raises:
        ValueError: a flag is out of range, security flags are incomplete, a non-loopback
            --host lacks TLS and authentication without --insecure-public, or --snapshot-dir /
            --persist-sessions is not a writable folder (each is created, 0700, if missing).
        OSError: the --shard-token-file cannot be read.
    """
    cfg = ServerConfig(
        host=args.host, port=args.port, model=args.model, weights=args.weights, cache_dir=default_cache_dir(),
        draft_model=_draft_choice(args.draft_model, args.model),
        max_sessions=args.max_sessions, max_kv_bytes=args.max_kv_bytes, default_sink=args.default_sink, default_window=args.default_window,
        max_sink=args.max_sink, max_window=args.max_window, max_rollback=args.max_rollback,
        max_tokens_per_request=args.max_tokens_per_request, max_text_chars=args.max_text_chars,
        text_process_chars=args.text_process_chars,
        max_new_tokens=args.max_new_tokens,
        default_new_tokens=args.default_new_tokens,
        session_ttl_s=args.session_ttl, exact=not args.no_exact, max_tile=args.max_tile, grace_s=args.grace,
        max_batch_rows=args.max_batch_rows, append_rows=args.append_rows,
        shards=_split(args.shards), spawn_shards=_split(args.spawn_shards),
        shard_recovery_timeout_s=args.shard_recovery_timeout, shard_step_timeout_s=args.shard_step_timeout,
        security=server_security_from_args(args), shard_security=client_security_from_args(args, "shard-"),
        metrics_host=args.metrics_host, metrics_port=args.metrics_port,
        http_port=args.http_port, http_allow_origins=tuple(args.http_allow_origin),
        prefix_cache_bytes=args.prefix_cache_bytes,
        prefix_cache_forks=not args.no_prefix_cache_forks,
        snapshot_dir=args.snapshot_dir, max_snapshot_bytes=args.max_snapshot_bytes, max_transfers=args.max_transfers,
        max_transfers_per_identity=args.max_transfers_per_identity, persist_dir=args.persist_sessions,
        persist_every=args.persist_every, persist_interval_s=args.persist_interval,
    )
    check_ranges([
        FlagRange("--max-sessions", cfg.max_sessions, 1),
        FlagRange("--max-kv-bytes", cfg.max_kv_bytes, 0),
        FlagRange("--max-sink", cfg.max_sink, 0),
        FlagRange("--max-window", cfg.max_window, 1),
        FlagRange("--default-sink", cfg.default_sink, 0, cfg.max_sink, "--max-sink"),
        FlagRange("--default-window", cfg.default_window, 1, cfg.max_window, "--max-window"),
        FlagRange("--max-rollback", cfg.max_rollback, 1),
        FlagRange("--max-tokens-per-request", cfg.max_tokens_per_request, 1),
        FlagRange("--max-new-tokens", cfg.max_new_tokens, 1),
        FlagRange("--default-new-tokens", cfg.default_new_tokens, 1, cfg.max_new_tokens, "--max-new-tokens"),
        FlagRange("--port", cfg.port, 0, 65535),
        FlagRange("--max-tile", cfg.max_tile, 1),
        FlagRange("--max-batch-rows", cfg.max_batch_rows, 0),
        FlagRange("--append-rows", cfg.append_rows, 0),
        FlagRange("--session-ttl", cfg.session_ttl_s, 0, exclusive_low=True),
        FlagRange("--grace", cfg.grace_s, 0),
        FlagRange("--shard-recovery-timeout", cfg.shard_recovery_timeout_s, 0, exclusive_low=True),
        FlagRange("--shard-step-timeout", cfg.shard_step_timeout_s, 0, exclusive_low=True),
        FlagRange("--metrics-port", cfg.metrics_port, 0, 65535),
        FlagRange("--http-port", cfg.http_port, 0, 65535),
        FlagRange("--prefix-cache-bytes", cfg.prefix_cache_bytes, 0),
        FlagRange("--max-snapshot-bytes", cfg.max_snapshot_bytes, 1),
        FlagRange("--max-transfers", cfg.max_transfers, 1),
        FlagRange("--max-transfers-per-identity", cfg.max_transfers_per_identity, 1, cfg.max_transfers,
                  "--max-transfers"),
        FlagRange("--max-text-chars", cfg.max_text_chars, 1),
        FlagRange("--text-process-chars", cfg.text_process_chars, 0),
        FlagRange("--persist-every", cfg.persist_every, 1),
        FlagRange("--persist-interval", cfg.persist_interval_s, 0),
    ])
    malformed = [f"{flag} {value!r} ({rule})" for flag, value, ok, rule in (
        ("--shards", ",".join(cfg.shards), all(a.rpartition(":")[0] and a.rpartition(":")[2].isdigit() for a in cfg.shards),
         "HOST:PORT,..."),
        ("--spawn-shards", ",".join(cfg.spawn_shards),
         all(r.count(":") == 1 and r.replace(":", "").isdigit() for r in cfg.spawn_shards), "START:END,..."),
    ) if not ok]
    malformed += [f"--http-allow-origin {o!r} (scheme://host[:port], or *)" for o in cfg.http_allow_origins
                  if not ORIGIN.fullmatch(o)]
    if malformed:
        raise ValueError(f"malformed flags: {'; '.join(malformed)}")
    if cfg.http_allow_origins and not cfg.http_port:
        raise ValueError("--http-allow-origin opens the HTTP API to web pages; without --http-port there is none")
    check_exposure(cfg.host, cfg.security)
    if cfg.http_port and cfg.security.is_mtls and not cfg.security.has_tokens:
        raise ValueError("--http-port with --tls-client-ca needs --auth-token-file: the HTTP API identifies callers "
                         "by bearer token (a client certificate only admits the connection there)")
    s = cfg.shard_security
    if not cfg.shards and (s.ca_file or s.cert_file or s.token):
        raise ValueError("--shard-tls-ca, --shard-tls-cert/--shard-tls-key and --shard-token-file secure the "
                         "connection to --shards workers; without --shards nothing would use them")
    for flag, folder in (("--snapshot-dir", cfg.snapshot_dir), ("--persist-sessions", cfg.persist_dir)):
        if folder is not None:  # found now, not by the first call or the first (silently failing) write
            try:
                prepare_private_folder(folder)
            except OSError as exc:
                raise ValueError(f"{flag}: {exc.strerror}") from exc
    return cfg
