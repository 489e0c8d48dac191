"""Large texts are tokenized in other processes, so they cannot take the engine's GIL or CPU time.

The tokenizers bindings release the GIL while their Rust code runs (codec.py), but the text
thread still spends ~120 ms of this process's CPU per 65,536-character text (~120 K tokens)
and holds the GIL to build its ids list; on a small machine it competes with the engine thread:
a stream's worst gap beside back-to-back maximal Tokenize calls was 3.5x its median on a quiet
2-core machine (issue 28, defect 3). Texts of at least `min_chars` characters, and token lists
of at least `min_chars` tokens, go to a small pool of worker processes instead (~4 ms of this
process's CPU per maximal text: scripts/tokenizer_process_cpu.py):
- started on the first large text (spawn: a fresh interpreter importing this module and
  `tokenizers`), at nice WORKER_NICE, so the engine thread gets a core first;
- loading the very tokenizer the server holds (its JSON, handed over at start: no files, no hub),
  so the ids are the ones the in-process codec would give;
- at most MAX_LARGE_TEXTS texts in them at once (more wait their turn on the calling text thread):
  memory stays MAX_LARGE_TEXTS x (a text's bytes + its ids' 4 bytes each) beyond the processes'
  own ~85 MiB each (RSS after a maximal text);
- answering with ids packed as int32 bytes (one copy to unpickle, not one object per token; the
  list is built on the calling text thread, ~1 ms for a maximal text), or, for a caller that only
  sends them on (Tokenize), as a message already serialized (`encode_serialized`): this process
  then never holds the ids at all (no list, no message built from it: ~4 ms of its GIL and CPU
  less per maximal text).
A worker that dies (or answers nothing in CALL_TIMEOUT_S) fails its calls with TokenizerUnavailable
(UNAVAILABLE: retry) and the pool is replaced on the next call; `close()` lets running calls
finish and joins the workers; a worker whose server died without closing it exits within
PARENT_POLL_S.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import threading
from array import array
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence, TypeVar

from inference_engine import metrics
from inference_engine.errors import TokenizerUnavailable

log = logging.getLogger(__name__)
WORKER_PROCESSES = 2  # most tokenizer processes (started one by one, as large texts arrive at once)
MAX_LARGE_TEXTS = 2  # large texts (or token lists) in the processes at once: bounds their memory
WORKER_NICE = 19  # niceness of the tokenizer processes (CFS weight 15 against the engine thread's 1024)
CALL_TIMEOUT_S = 120.0  # a worker silent this long (a maximal text takes ~0.5 s, a start ~2 s) is killed as hung
PARENT_POLL_S = 1.0  # how often a worker checks that the server that started it is alive
R = TypeVar("R")
_IDS = "i"  # array typecode of the packed ids (int32: every vocabulary fits)

_tokenizer = None  # the worker's tokenizers.Tokenizer (set by _start_worker, in the worker only)


def _start_worker(tokenizer_json: str, parent: int) -> None:
    """In a new worker: lower its priority, load the tokenizer, and leave when the server is gone."""
    global _tokenizer
    from tokenizers import Tokenizer

    try:
        os.nice(WORKER_NICE - os.nice(0))
    except OSError:  # pragma: no cover - a sandbox without the right: the worker runs at normal priority
        pass
    _tokenizer = Tokenizer.from_str(tokenizer_json)
    threading.Thread(target=_exit_with, args=(parent,), name="parent-watch", daemon=True).start()


def _exit_with(parent: int) -> None:  # pragma: no cover - runs in the worker process (covered by its exit)
    """Exit the worker when the process that started it is gone (killed: nothing shut the pool down)."""
    while os.getppid() == parent:
        threading.Event().wait(PARENT_POLL_S)
    os._exit(0)


def _ids(text: str, add_special_tokens: bool) -> list[int]:  # pragma: no cover - runs in the worker process
    """In a worker: the ids of `text`."""
    (encoding,) = _tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
    return encoding.ids


def _encode(text: str, add_special_tokens: bool) -> bytes:  # pragma: no cover - runs in the worker process
    """In a worker: the ids of `text`, packed."""
    return array(_IDS, _ids(text, add_special_tokens)).tobytes()


def _encode_serialized(text: str, add_special_tokens: bool, message: type, field: str) -> bytes:  # pragma: no cover
    """In a worker: `message(field=the ids of text)`, serialized (runs in the worker process)."""
    return message(**{field: _ids(text, add_special_tokens)}).SerializeToString()


def _decode(packed: bytes, skip_special_tokens: bool) -> str:  # pragma: no cover - runs in the worker process
    """In a worker: the text of packed ids."""
    (text,) = _tokenizer.decode_batch([array(_IDS, packed).tolist()], skip_special_tokens=skip_special_tokens)
    return text


class TokenizerProcesses:
    """The tokenizer processes of one server (thread-safe; call from text threads, never the event loop)."""

    def __init__(self, backend: Any, min_chars: int, processes: int = WORKER_PROCESSES,
                 max_in_flight: int = MAX_LARGE_TEXTS):
        """
        Args:
            backend: the server's `tokenizers.Tokenizer` (serialized when the first worker starts, ~0.1 s).
            min_chars: texts of at least this many characters (token lists of at least this many
                tokens) are handled here (the codec decides with `is_large`).
            processes: most worker processes.
            max_in_flight: most texts in the workers at once.
        """
        self.min_chars = min_chars
        self._backend = backend
        self._json: str | None = None
        self._processes = processes
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._is_closed = False

    def is_large(self, size: int) -> bool:
        """Whether a text of `size` characters (or a list of `size` tokens) is handled here."""
        return size >= self.min_chars

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, from a worker (blocks the calling thread, not the GIL).

        Raises:
            TokenizerUnavailable: the worker died, or the pool is closed.
        """
        packed = self._call("encode", _encode, text, add_special_tokens)
        return array(_IDS, packed).tolist()

    def encode_serialized(self, text: str, add_special_tokens: bool, message: type, field: str) -> bytes:
        """`message(field=the ids of text)` serialized, built in a worker (`message`: a protobuf class,
        pickled by reference, whose `field` is a repeated integer).

        Raises:
            TokenizerUnavailable: the worker died, or the pool is closed.
        """
        return self._call("encode", _encode_serialized, text, add_special_tokens, message, field)

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool) -> str:
        """Text of `tokens`, from a worker.

        Raises:
            TokenizerUnavailable: the worker died, or the pool is closed.
        """
        return self._call("decode", _decode, array(_IDS, tokens).tobytes(), skip_special_tokens)

    def _call(self, op: str, fn: Callable[..., R], *args: object) -> R:
        """`fn(*args)` in a worker (`op` names it in the metric)."""
        with self._slots:
            pool = self._executor()
            try:
                future = pool.submit(fn, *args)
            except BrokenProcessPool as exc:  # a worker died while idle, and the pool saw it first
                self._discard(pool)  # (kept, every later call would be refused by it: replace it)
                raise self._pool_gone() from exc
            except RuntimeError as exc:  # submit refused: the pool was shut down under this call
                raise self._pool_gone() from exc  # (the server's close, or replaced as broken by another call)
            try:
                result = future.result(CALL_TIMEOUT_S)  # a RuntimeError from here is the worker's own
            except (BrokenProcessPool, concurrent.futures.TimeoutError) as exc:
                self._discard(pool)
                why = "ended" if isinstance(exc, BrokenProcessPool) else f"answered nothing in {CALL_TIMEOUT_S:.0f} s"
                raise self._pool_gone(why) from exc
            except concurrent.futures.CancelledError as exc:  # queued when the pool was shut down (`_discard`, close)
                raise self._pool_gone() from exc
        metrics.TOKENIZER_PROCESS_CALLS.labels(op).inc()
        return result

    def _pool_gone(self, why: str = "ended") -> TokenizerUnavailable:
        """The error for a call whose pool died, hung (`why`) or was shut down under it."""
        if self._is_closed:
            return TokenizerUnavailable("the server is shutting down; retry against a live server")
        return TokenizerUnavailable(f"the tokenizer process {why} during the call; retry: a new one starts with the "
                                    "next call")

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._is_closed:
                raise TokenizerUnavailable("the server is shutting down; retry against a live server")
            if self._pool is None:
                if self._json is None:
                    self._json = self._backend.to_str()
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    self._processes, multiprocessing.get_context("spawn"), initializer=_start_worker,
                    initargs=(self._json, os.getpid()))
            return self._pool

    def _discard(self, broken: concurrent.futures.ProcessPoolExecutor) -> None:
        """Drop the broken pool a call failed on (unless another failed call already replaced it)."""
        with self._lock:
            if self._pool is not broken:
                return
            self._pool = None
        log.warning("a tokenizer process died or hung; the next large text starts a new one")
        for process in list((getattr(broken, "_processes", None) or {}).values()):  # a hung one ends too
            process.kill()
        broken.shutdown(wait=False, cancel_futures=True)

    @property
    def pids(self) -> tuple[int, ...]:
        """The running workers' process ids (none before the first large text and after close)."""
        with self._lock:
            procs = getattr(self._pool, "_processes", None) or {}
            return tuple(sorted(procs))

    def close(self) -> None:
        """Let running calls finish, cancel waiting ones, and join the workers (idempotent)."""
        with self._lock:
            pool, self._pool, self._is_closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
