"""The snapshot batteries' comparison, and the one-bit forgery its negative control restores.

`restore_differences` is what "a restored session is the original" means in the batteries:
the same state digest at restore, then the same next tokens with bitwise the same
log-probabilities (the next-token logits' log-softmax) and the same digest after them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from inference_engine.client.snapshots import restore_bytes
from inference_engine.session import snapshot_format as fmt
from inference_engine.session.snapshot import seal
from inference_engine.v1 import runtime_pb2 as pb


async def digest(stub, sid: str) -> str:
    """The session's state digest (GetSessionInfo)."""
    return (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest


async def greedy_with_logprobs(stub, sid: str, n: int) -> tuple[list[int], list[float]]:
    """`n` greedy tokens and each one's log-probability."""
    tokens, logprobs = [], []
    req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, logprobs=True)
    async for msg in stub.Generate(req):
        tokens += list(msg.tokens)
        logprobs += [lp.logprob for lp in msg.logprobs]
    return tokens, logprobs


async def restore_differences(stub, sid: str, data: bytes, n: int = 6) -> list[str]:
    """Restore `data` as a new session and continue it and `sid` alike for `n` greedy tokens.

    Returns:
        What differs between the copy and `sid` ([] for a faithful restore): "digest at restore",
        "next tokens", "next logprobs", "digest after". The copy is closed again.
    """
    restored = await restore_bytes(stub, data)
    differ = ["digest at restore"] if restored.state_digest != await digest(stub, sid) else []
    copy = await greedy_with_logprobs(stub, restored.session_id, n)
    original = await greedy_with_logprobs(stub, sid, n)
    differ += [name for name, a, b in (("next tokens", copy[0], original[0]), ("next logprobs", copy[1], original[1]))
               if a != b]
    if await digest(stub, restored.session_id) != await digest(stub, sid):
        differ.append("digest after")
    await stub.CloseSession(pb.CloseSessionRequest(session_id=restored.session_id))
    return differ


def flip_kv_bit(data: bytes, section: str = "keys", reseal: bool = True) -> bytes:
    """TEST FIXTURE: `data` with the lowest bit of one K/V value flipped and a valid SHA-256 recomputed.

    The value is layer 0, KV head 0, the last retained position, dimension 0. With `reseal` the
    recorded state digest is recomputed too (a self-consistent forgery the restore accepts);
    without, the file's checksum is valid but the digest is the original's.
    """
    snap = fmt.decode(data)
    flipped = np.array(getattr(snap.kv, section), copy=True)  # (layers, n_kv, n, head_dim)
    flipped[0, 0, -1, :1].view(np.uint32 if flipped.dtype.itemsize == 4 else np.uint16)[...] ^= 1
    forged = dataclasses.replace(snap, kv=dataclasses.replace(snap.kv, **{section: flipped}))
    return fmt.encode(seal(forged) if reseal else forged)
