"""Hostile RestoreSession uploads (issue 28, defect 1): the server's memory is bounded by its flags and
given back after the calls fail.

Two kinds of upload, `uploads` of each at once, each `upload_bytes` long:
- zeros (the probe's repro): no snapshot header, so refused on the first message;
- a forged head: a real snapshot's header (this server's fingerprint, a window it allows) whose
  token section declares as many bytes as the upload carries, then zeros: it passes every check
  the head allows, so the server takes the whole body into its buffer before the checksum fails.
  This is the most a client can make a server hold: at most --max-transfers such buffers, and
  --max-transfers-per-identity for one identity (the rest are RESOURCE_EXHAUSTED at once).
After one small warm-up upload of each kind, the server's RSS is read before, while the uploads run (its peak) and `settle_s` after the last
failed; the after-reading must be within `rss_tolerance` of the before-reading.

A server that answers while the client is still streaming (refused on the head, or no slot)
sometimes reaches the client as INTERNAL "Internal error from Core" without details: grpc's
client core reports its own failed write instead of the status the server sent (the server's
log has the real code). Those are counted as CLIENT_WRITE_CUT, not as untyped answers.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections import Counter
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from reliabilitykit.outcomes import outcome_of, typing_problem
from reliabilitykit.report import SectionReport
from inference_engine.client.snapshots import CHUNK_BYTES, snapshot_bytes
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

Rss = Callable[[], int]  # the server's resident set size in bytes
MIB = 1 << 20
WARM_UP_BYTES = 4 * MIB  # one small upload of each kind before the before-reading
CORE_WRITE_FAILURE = "Internal error from Core"  # the client core's own status when its write was cut
CLIENT_WRITE_CUT = "CLIENT_WRITE_CUT"  # that outcome: the server answered while the upload ran


@dataclass(frozen=True)
class RestorePlan:
    """The size of the hostile uploads."""

    uploads: int = 4  # concurrent uploads of each kind
    upload_bytes: int = 1000 * MIB  # bytes each carries (the probe: 1,000 MB)
    rss_tolerance: float = 0.10  # most relative RSS growth from before to after
    settle_s: float = 3.0  # pause before the after-reading
    sample_s: float = 0.2  # RSS sampling period while the uploads run


def forged(snapshot: bytes, total_bytes: int) -> bytes:
    """The head of `snapshot` with its token section declaring enough bytes that the whole declares
    `total_bytes` (the body is not sent here; its checksum can never match)."""
    _, version, head_len = struct.unpack_from("<8sII", snapshot)
    header = json.loads(snapshot[16 : 16 + head_len])
    tokens = next(s for s in header["sections"] if s["name"] == "tokens")
    n, grow = tokens["shape"][0], 0
    for _ in range(3):  # the header's own length changes with the number written into it
        tokens["shape"] = [n + grow]
        head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        grow = max(0, total_bytes - (len(snapshot) - head_len + len(head))) // 4
        tokens["shape"] = [n + grow]
        head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        declared = len(snapshot) - head_len + len(head) + 4 * grow
    return struct.pack("<8sII", snapshot[:8], version, len(head)) + head


async def _upload(stub: pb_grpc.RuntimeServiceStub, first: bytes, total: int) -> str:
    """Send `first`, then zeros up to `total` bytes; the call's code (a typing problem is a failure)."""
    zeros = bytes(CHUNK_BYTES)

    async def requests() -> AsyncIterator[pb.RestoreSessionRequest]:
        sent = 0
        if first:
            yield pb.RestoreSessionRequest(data=first)
            sent = len(first)
        while sent < total:
            n = min(CHUNK_BYTES, total - sent)
            yield pb.RestoreSessionRequest(data=zeros if n == CHUNK_BYTES else zeros[:n])
            sent += n

    try:
        await stub.RestoreSession(requests())
        return "OK"
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.INTERNAL and err.details() == CORE_WRITE_FAILURE and \
                not err.trailing_metadata():
            return CLIENT_WRITE_CUT
        problem = typing_problem(outcome_of(err))
        return f"{err.code().name}" + (f" ({problem})" if problem else "")


async def run_hostile_restores(channel: grpc.aio.Channel, rss: Rss, plan: RestorePlan) -> SectionReport:
    """Zeros and forged-head uploads at once; every one refused with a typed code, the memory given back."""
    report = SectionReport("hostile_restores")
    stub = pb_grpc.RuntimeServiceStub(channel)
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=4, window_tokens=16))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[5, 17, 33, 2, 250, 9, 9, 120]))
    real = await snapshot_bytes(stub, sid)
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    head = forged(real, plan.upload_bytes)
    for first in (b"", forged(real, WARM_UP_BYTES)):  # first-use costs (threads, caches) are not retention
        await _upload(stub, first, WARM_UP_BYTES)
    await asyncio.sleep(plan.settle_s)
    before = rss()
    peak = before
    codes: list[str] = []
    for first in (b"", head):  # zeros, then forged heads: `uploads` of each at once
        running = asyncio.ensure_future(asyncio.gather(*[_upload(stub, first, plan.upload_bytes)
                                                         for _ in range(plan.uploads)]))
        while not running.done():
            peak = max(peak, rss())
            await asyncio.wait((running,), timeout=plan.sample_s)
        codes += running.result()
    await asyncio.sleep(plan.settle_s)
    after = rss()
    counts = Counter(codes)
    report.numbers.update(
        uploads=2 * plan.uploads, upload_mib=round(plan.upload_bytes / MIB), codes=dict(counts),
        rss_mib={"before": round(before / MIB, 1), "peak": round(peak / MIB, 1), "after": round(after / MIB, 1)},
        after_vs_before=round(after / before, 3))
    typed = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", CLIENT_WRITE_CUT}
    report.check(set(counts) <= typed, "every hostile upload is refused with INVALID_ARGUMENT or RESOURCE_EXHAUSTED",
                 str(dict(counts)))
    report.check(after <= before * (1 + plan.rss_tolerance),
                 f"RSS after the failed uploads within {plan.rss_tolerance:.0%} of before",
                 f"{before / MIB:.0f} -> {after / MIB:.0f} MiB (peak {peak / MIB:.0f})")
    return report.finish()
