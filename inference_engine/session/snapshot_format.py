"""The session snapshot file (format version 3): a session's complete state as bytes.

Layout (integers little-endian):

    offset   size  field
    0        8     magic b"\\x89IESNAP\\n" (binary: a text-mode copy breaks it, as PNG's does)
    8        4     format version, uint32 (3; versions 1 and 2 are still read)
    12       4     header length H, uint32 (at most MAX_HEADER_BYTES)
    16       H     header: UTF-8 JSON object, keys sorted, no spaces (below)
    16+H     ...   sections, back to back in header order, each prod(shape) x itemsize bytes, C order
    end-32   32    SHA-256 of every byte before it

Every version keeps the magic, the version word and the trailing SHA-256, so a damaged file is
told apart from a newer one: the checksum is checked before the version (damaged:
SnapshotCorrupt, INVALID_ARGUMENT; sound but another version: SnapshotIncompatible,
FAILED_PRECONDITION).

Header, version 3:
  fingerprint  model, tokenizer, kernels, block_size, exact, sink, window (see `Fingerprint`)
  session      eos_token_ids, client_label
  state        history_length N, state_digest (GetSessionInfo's, of the state in this file)
  sections     [{name, dtype, shape}]: tokens <u4 (N,); logits <f4 or <f2 (V,), absent when N = 0;
               keys and values <f4 or <f2 (layers, n_kv, n, head_dim), n = the positions the next
               query sees besides itself (the sinks, then the window, in position order);
               chat |u1 (B,): the session's chat log as UTF-8 JSON {reply_from, turns} (below);
               constraint |u1 (C,): the constraint run, UTF-8 JSON {kind, source, start} (below), absent
               when the session has none
  persisted    optional {session_id, owner, created_ns}: only in files a server writes for
               itself (--persist-sessions, SnapshotSession to_dir); never in streamed bytes

The chat log is what renders the next chat turn (text/chat.py): every message a client sent
({role, content}) and every generated reply as its history span ({start, end}), in order, and
`reply_from` (null, or where an open reply starts). Without it a copy would render the next
turn differently (no closing "\\n" after an EOS, no `<|im_end|>` after a cut reply). It is a
section, not a header field: a long conversation's messages can outgrow the header's cap.
Decoding checks it against N: spans in order, 0 <= start <= end <= N, reply_from in
[last end, N].

The constraint section is the `ConstraintRun` of the session's last constrained Generate: the
constraint (kind: json_schema, json_object, regex or grammar; source: its text) and `start`, the
history length where its output began. The matcher itself is not saved: the next constrained call
re-derives it from tokens[start:] (ConstraintCompiler.resume), as it does on the original, so a
copy continues a constrained output cut by max_new_tokens exactly. Decoding checks the kind and
0 <= start <= N; whether the source compiles is checked on restore, against the tokenizer.

Versions: a field that changes what a restored session does bumps the version, so an older
server refuses the file (SnapshotIncompatible) instead of restoring a copy that diverges.
Version 2 added the chat section, version 3 the constraint section. A version 1 file (never any
chat section) is still read, as a session with an empty chat log, and a version 1 or 2 file as a
session without a constraint: exactly what it records, and what its writer restored.

K/V are canonical (the retained positions in order, what the digest hashes), not ring slots:
a snapshot does not depend on the ring's slack (block size, rollback room) nor on where the
layers ran, so equal sessions give equal files, on one process or a shard route. Not saved:
the draft model's cache (it follows the log by position and is rebuilt on first use) and
the scheduler's work (a snapshot is taken between calls or between a stream's steps).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from inference_engine.errors import SnapshotCorrupt, SnapshotIncompatible
from inference_engine.text.chat import ChatLog, ReplySpan
from inference_engine.text.codec import ChatMessage
from inference_engine.text.constraint import CONSTRAINT_KINDS, Constraint, ConstraintRun
from inference_engine.execution.kv_cache import CanonicalKV

MAGIC = b"\x89IESNAP\n"
FORMAT_VERSION = 3  # what encode writes
READ_VERSIONS = (1, 2, 3)  # what decode reads (1: no chat section, an empty chat log; 1, 2: no constraint)
MAX_HEADER_BYTES = 1 << 20
_PREAMBLE = struct.Struct("<8sII")  # magic, version, header length
_DIGEST_BYTES = 32
_FLOAT_DTYPES = ("<f4", "<f2")


@dataclass(frozen=True)
class Fingerprint:
    """What must match for a snapshot to restore bit for bit (sink/window: must fit the server's limits)."""

    model: str  # hex SHA-256 of the model's shapes and leading embedding rows (loader.model_fingerprint)
    tokenizer: str  # hex SHA-256 of the vocabulary ("none" for a model without a tokenizer)
    kernels: str  # what computed the numbers (serving_path.kernels_in_use(): the exact kernels, or MLX ops)
    block_size: int  # rows per forward chunk (the probed tile, or the plain block)
    is_exact: bool  # computed on the probed bit-exact path
    sink: int  # the session's attention-sink tokens
    window: int  # the session's window tokens

    def differences(self, here: "Fingerprint") -> list[str]:
        """What differs from `here` among the fields that must be equal (not sink/window), for messages."""
        out = []
        for name, short in (("model", True), ("tokenizer", True), ("kernels", False), ("block_size", False),
                            ("is_exact", False)):
            mine, theirs = getattr(self, name), getattr(here, name)
            if mine != theirs:
                show = (lambda v: f"{v[:12]}…") if short else repr
                out.append(f"{name} {show(mine)} (this server: {show(theirs)})")
        return out


@dataclass(frozen=True)
class PersistedIdentity:
    """Who a server-written snapshot belongs to (never in bytes streamed to a client)."""

    session_id: str  # the session's id, kept by --persist-sessions across a restart
    owner: str  # the identity that owns it
    created_ns: int  # wall clock at its creation


@dataclass(frozen=True, eq=False)
class SessionSnapshot:
    """A session's complete state, in memory (numpy arrays: safe on any thread)."""

    fingerprint: Fingerprint  # where it may be restored
    eos_token_ids: tuple[int, ...]  # tokens that end its generations
    client_label: str  # its label
    tokens: np.ndarray  # (N,) uint32: the token log
    logits: np.ndarray | None  # (V,) next-token logits (the model's dtype); None when N = 0
    kv: CanonicalKV  # retained K/V of every layer, position N
    state_digest: str  # hex SHA-256 of this state (GetSessionInfo.state_digest)
    identity: PersistedIdentity | None = None  # set in server-written files only
    chat: ChatLog = ChatLog()  # messages and reply spans: how the next chat turn is rendered
    constraint: ConstraintRun | None = None  # the constraint its last constrained Generate ran under, and where

    @property
    def history_length(self) -> int:
        """Tokens in the log."""
        return int(self.tokens.shape[0])


def retained_count(position: int, sink: int, window: int) -> int:
    """Positions a cache at `position` keeps for the next query (sinks, then the window).

    `len(CacheGeometry.visible_positions(position)) - 1`, by arithmetic: the numbers come from an
    unchecked header, so nothing proportional to them may be built.
    """
    return min(sink, position) + min(window, max(0, position - sink))


@dataclass(frozen=True)
class SnapshotHead:
    """What a snapshot's first bytes declare, read before its body arrives (not yet checked by the SHA-256:
    `decode` checks the whole, and a forged head only decides what is refused or reserved)."""

    fingerprint: Fingerprint  # where it may be restored (sink/window: the slab to reserve)
    history_length: int  # tokens its log declares
    total_bytes: int  # the whole snapshot's size as declared: preamble, header, sections and SHA-256
    identity: PersistedIdentity | None  # set in server-written files only


def read_head(prefix: bytes | bytearray | memoryview) -> SnapshotHead | None:
    """The head of a snapshot from its first bytes, or None while they do not hold the whole header yet.

    Nothing proportional to the declared numbers is built. The version is read here, before the
    checksum can be: a damaged version word reads as another version (SnapshotIncompatible).

    Raises:
        SnapshotCorrupt: not a snapshot, a header over MAX_HEADER_BYTES, or a malformed header.
        SnapshotIncompatible: another format version.
    """
    view = memoryview(prefix)
    if bytes(view[: len(MAGIC)]) != MAGIC[: len(view)]:
        raise SnapshotCorrupt("not an inference_engine session snapshot (no snapshot header): a foreign or "
                              "truncated file", "data")
    if len(view) < _PREAMBLE.size:
        return None
    _, version, head_len = _PREAMBLE.unpack_from(view)
    if version not in READ_VERSIONS:
        raise SnapshotIncompatible(f"the snapshot has format version {version}; this server reads versions "
                                   f"{', '.join(map(str, READ_VERSIONS))}")
    if head_len > MAX_HEADER_BYTES:
        raise SnapshotCorrupt(f"the snapshot's header length {head_len} is over {MAX_HEADER_BYTES} bytes", "data")
    if len(view) < _PREAMBLE.size + head_len:
        return None
    try:
        header = json.loads(bytes(view[_PREAMBLE.size : _PREAMBLE.size + head_len]))
        fp = header["fingerprint"]
        fingerprint = Fingerprint(_str(fp["model"]), _str(fp["tokenizer"]), _str(fp["kernels"]),
                                  _int(fp["block_size"]), _bool(fp["exact"]), _int(fp["sink"]), _int(fp["window"]))
        body = sum(math.prod(_int(n) for n in s["shape"]) * np.dtype(_str(s["dtype"])).itemsize
                   for s in header["sections"])
        p = header.get("persisted")
        identity = None if p is None else PersistedIdentity(_str(p["session_id"]), _str(p["owner"]),
                                                            _int(p["created_ns"]))
        n = _int(header["state"]["history_length"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:  # json, fields, types
        raise SnapshotCorrupt(f"the snapshot's header is malformed ({type(exc).__name__}: {exc})", "data") from None
    return SnapshotHead(fingerprint, n, _PREAMBLE.size + head_len + body + _DIGEST_BYTES, identity)


def encode(snapshot: SessionSnapshot) -> bytes:
    """The snapshot's bytes (deterministic: equal states give equal bytes)."""
    f, kv = snapshot.fingerprint, snapshot.kv
    arrays = [("tokens", np.ascontiguousarray(snapshot.tokens, dtype="<u4"))]
    if snapshot.logits is not None:
        arrays.append(("logits", _little(snapshot.logits)))
    arrays += [("keys", _little(kv.keys)), ("values", _little(kv.values))]
    arrays.append(("chat", np.frombuffer(_chat_bytes(snapshot.chat), dtype="|u1")))
    if snapshot.constraint is not None:  # absent otherwise: a session without one gives the version 2 layout
        arrays.append(("constraint", np.frombuffer(_constraint_bytes(snapshot.constraint), dtype="|u1")))
    header: dict[str, Any] = {
        "fingerprint": {"model": f.model, "tokenizer": f.tokenizer, "kernels": f.kernels, "block_size": f.block_size,
                        "exact": f.is_exact, "sink": f.sink, "window": f.window},
        "session": {"eos_token_ids": [int(t) for t in snapshot.eos_token_ids], "client_label": snapshot.client_label},
        "state": {"history_length": snapshot.history_length, "state_digest": snapshot.state_digest},
        "sections": [{"name": name, "dtype": a.dtype.str, "shape": list(a.shape)} for name, a in arrays],
    }
    if snapshot.identity is not None:
        i = snapshot.identity
        header["persisted"] = {"session_id": i.session_id, "owner": i.owner, "created_ns": i.created_ns}
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    parts = [_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(head)), head] + [a.tobytes() for _, a in arrays]
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return b"".join(parts + [h.digest()])


def decode(data: bytes | bytearray | memoryview) -> SessionSnapshot:
    """Check and parse a snapshot (structure only; `check_fits` checks it against a server).

    Raises:
        SnapshotCorrupt: truncated, damaged (checksum), not a snapshot, or inconsistent.
        SnapshotIncompatible: a sound snapshot of another format version.
    """
    view = memoryview(data)
    if len(view) < _PREAMBLE.size + _DIGEST_BYTES or bytes(view[:8]) != MAGIC:
        raise SnapshotCorrupt("not an inference_engine session snapshot (no snapshot header): a foreign or "
                              "truncated file", "data")
    if hashlib.sha256(view[:-_DIGEST_BYTES]).digest() != bytes(view[-_DIGEST_BYTES:]):
        raise SnapshotCorrupt(f"the snapshot's SHA-256 does not match its {len(view)} bytes: it is truncated or "
                              "corrupted; nothing was restored", "data")
    _, version, head_len = _PREAMBLE.unpack_from(view)
    if version not in READ_VERSIONS:
        raise SnapshotIncompatible(f"the snapshot has format version {version}; this server reads versions "
                                   f"{', '.join(map(str, READ_VERSIONS))}")
    body_end = len(view) - _DIGEST_BYTES
    if head_len > MAX_HEADER_BYTES or _PREAMBLE.size + head_len > body_end:
        raise SnapshotCorrupt(f"the snapshot's header length {head_len} does not fit its {len(view)} bytes", "data")
    try:
        header = json.loads(bytes(view[_PREAMBLE.size : _PREAMBLE.size + head_len]))
        return _parse(header, view[_PREAMBLE.size + head_len : body_end], version)
    except SnapshotCorrupt:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:  # json, fields, types
        raise SnapshotCorrupt(f"the snapshot's header is malformed ({type(exc).__name__}: {exc})", "data") from None


def _parse(header: dict[str, Any], body: memoryview, version: int) -> SessionSnapshot:
    fp, sess, state = header["fingerprint"], header["session"], header["state"]
    fingerprint = Fingerprint(_str(fp["model"]), _str(fp["tokenizer"]), _str(fp["kernels"]), _int(fp["block_size"]),
                              _bool(fp["exact"]), _int(fp["sink"]), _int(fp["window"]))
    arrays, offset = {}, 0
    for section in header["sections"]:
        name, dtype = _str(section["name"]), np.dtype(_str(section["dtype"]))
        shape = [_int(n) for n in section["shape"]]
        allowed = ("<u4",) if name == "tokens" else _FLOAT_DTYPES if name in ("logits", "keys", "values") else (
            ("|u1",) if (name == "chat" and version >= 2) or (name == "constraint" and version >= 3) else ())
        if dtype.str not in allowed or name in arrays:
            raise SnapshotCorrupt(f"unexpected snapshot section {name!r} of dtype {dtype.str}", "data")
        size = math.prod(shape) * dtype.itemsize
        if offset + size > len(body):
            raise SnapshotCorrupt(f"section {name!r} runs past the snapshot's end", "data")
        arrays[name] = np.frombuffer(body[offset : offset + size], dtype=dtype).reshape(shape)
        offset += size
    if offset != len(body):
        raise SnapshotCorrupt(f"{len(body) - offset} bytes after the snapshot's last section", "data")
    n, digest = _int(state["history_length"]), _str(state["state_digest"])
    tokens, keys, values, logits = arrays["tokens"], arrays["keys"], arrays["values"], arrays.get("logits")
    retained = retained_count(n, fingerprint.sink, fingerprint.window)
    consistent = (tokens.shape == (n,) and (logits is None) == (n == 0) and (logits is None or logits.ndim == 1)
                  and keys.ndim == 4 and keys.shape == values.shape and keys.dtype == values.dtype
                  and keys.shape[2] == retained and len(digest) == 64)
    if not consistent:
        raise SnapshotCorrupt(f"the snapshot's sections do not describe a session of {n} tokens (tokens "
                              f"{list(tokens.shape)}, keys {list(keys.shape)}, values {list(values.shape)}, "
                              f"logits {None if logits is None else list(logits.shape)})", "data")
    chat = _chat_log(arrays["chat"], n) if version >= 2 else ChatLog()
    constraint = _constraint_run(arrays["constraint"], n) if "constraint" in arrays else None
    identity = None
    if "persisted" in header:
        p = header["persisted"]
        identity = PersistedIdentity(_str(p["session_id"]), _str(p["owner"]), _int(p["created_ns"]))
    return SessionSnapshot(fingerprint, tuple(_int(t) for t in sess["eos_token_ids"]), _str(sess["client_label"]),
                           tokens, logits, CanonicalKV(n, keys, values), digest, identity, chat, constraint)


def _chat_bytes(chat: ChatLog) -> bytes:
    """The chat section: the log as UTF-8 JSON, keys sorted (equal logs give equal bytes)."""
    turns = [{"start": t.start, "end": t.end} if isinstance(t, ReplySpan) else {"role": t.role, "content": t.content}
             for t in chat.turns]
    return json.dumps({"reply_from": chat.reply_from, "turns": turns}, sort_keys=True, separators=(",", ":")).encode()


def _chat_log(section: np.ndarray, n: int) -> ChatLog:
    """The chat section's log, checked against a history of `n` tokens (spans in order, inside it).

    Raises:
        SnapshotCorrupt: spans or reply_from outside the history or out of order.
        ValueError, KeyError, TypeError: not the JSON `_chat_bytes` writes (decode reports them as corrupt).
    """
    if section.ndim != 1:
        raise TypeError(f"the chat section has shape {list(section.shape)}, expected one dimension")
    doc = json.loads(section.tobytes().decode("utf-8"))
    if not isinstance(doc, dict) or set(doc) != {"reply_from", "turns"} or not isinstance(doc["turns"], list):
        raise TypeError("the chat section is not an object {reply_from, turns}")
    turns: list[ChatMessage | ReplySpan] = []
    end = 0  # where the last reply span ended: later spans and reply_from start at or after it
    for t in doc["turns"]:
        if not isinstance(t, dict) or set(t) not in ({"start", "end"}, {"role", "content"}):
            raise TypeError(f"a chat turn is neither {{start, end}} nor {{role, content}}: {str(t)[:80]}")
        if "start" in t:
            span = ReplySpan(_int(t["start"]), _int(t["end"]))
            if not end <= span.start <= span.end <= n:
                raise SnapshotCorrupt(f"the snapshot's chat log has a reply span [{span.start}, {span.end}) outside "
                                      f"[{end}, {n}] (a history of {n} tokens, spans in order)", "data")
            turns.append(span)
            end = span.end
        else:
            turns.append(ChatMessage(_str(t["role"]), _str(t["content"])))
    reply_from = doc["reply_from"]
    if reply_from is not None and not end <= _int(reply_from) <= n:
        raise SnapshotCorrupt(f"the snapshot's chat log has reply_from {reply_from} outside [{end}, {n}]", "data")
    return ChatLog(tuple(turns), reply_from)


def _constraint_bytes(run: ConstraintRun) -> bytes:
    """The constraint section: the run as UTF-8 JSON, keys sorted (equal runs give equal bytes)."""
    doc = {"kind": run.constraint.kind, "source": run.constraint.source, "start": run.start}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _constraint_run(section: np.ndarray, n: int) -> ConstraintRun:
    """The constraint section's run, checked against a history of `n` tokens (its source is not compiled here).

    Raises:
        SnapshotCorrupt: an unknown kind, or a start outside the history.
        ValueError, KeyError, TypeError: not the JSON `_constraint_bytes` writes (decode reports them as corrupt).
    """
    if section.ndim != 1:
        raise TypeError(f"the constraint section has shape {list(section.shape)}, expected one dimension")
    doc = json.loads(section.tobytes().decode("utf-8"))
    if not isinstance(doc, dict) or set(doc) != {"kind", "source", "start"}:
        raise TypeError("the constraint section is not an object {kind, source, start}")
    kind, source, start = _str(doc["kind"]), _str(doc["source"]), _int(doc["start"])
    if kind not in CONSTRAINT_KINDS:
        raise SnapshotCorrupt(f"the snapshot's constraint has kind {kind[:40]!r}; the kinds are "
                              f"{', '.join(CONSTRAINT_KINDS)}", "data")
    if start > n:
        raise SnapshotCorrupt(f"the snapshot's constraint starts at {start}, past its history of {n} tokens", "data")
    return ConstraintRun(Constraint(kind, source), start)  # type: ignore[arg-type]  # kind checked above


def check_compatible(snapshot: SessionSnapshot | SnapshotHead, here: Fingerprint) -> None:
    """Refuse a snapshot (or, before its body arrives, its head) this server would not restore bit for bit.

    Raises:
        SnapshotIncompatible: naming every field that differs.
    """
    diffs = snapshot.fingerprint.differences(here)
    if diffs:
        raise SnapshotIncompatible("the snapshot cannot be restored exactly on this server: " + "; ".join(diffs)
                                   + "; a snapshot restores only where model, tokenizer, kernels, block size and "
                                   "mode are the same")


def _little(a: np.ndarray) -> np.ndarray:
    """`a` as C-ordered little-endian bytes of its own dtype (the same values, the same bits)."""
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TypeError(f"expected a non-negative integer, got {v!r}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected a boolean, got {type(v).__name__}")
    return v
