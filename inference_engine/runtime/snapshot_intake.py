"""A snapshot's bytes as they arrive (RestoreSession's stream or file), in memory bounded by configuration.

The head (preamble and header, at most MAX_HEADER_BYTES) comes first and is handed to the
caller, who checks it (fingerprint, limits, owner) and reserves the session's slab before
any more is taken. The body then goes into one buffer of the declared size, allocated once
the head is accepted and never over `--max-snapshot-bytes`: no list of chunks, no join, and
a stream that runs past its declared size is refused at the first byte too many. A buffer
that large is its own mapping, so a failed call gives its memory back to the system.
"""

from __future__ import annotations

from inference_engine.errors import InvalidRequest, SnapshotCorrupt
from inference_engine.session.snapshot_format import SnapshotHead, read_head


class SnapshotIntake:
    """Collects one snapshot: `feed` its chunks in order, then `finish`."""

    def __init__(self, limit: int):
        """
        Args:
            limit: the largest snapshot accepted, in bytes (--max-snapshot-bytes).
        """
        self.limit = limit
        self.head: SnapshotHead | None = None  # known once the whole header arrived
        self._prefix = bytearray()  # bytes before the head is known (at most the preamble and header, + a chunk)
        self._buffer: bytearray | None = None  # the whole snapshot, allocated at the first byte after the head
        self._filled = 0  # bytes written into _buffer
        self.received = 0  # bytes fed so far

    def feed(self, chunk: bytes) -> SnapshotHead | None:
        """Take the next bytes.

        Returns:
            The head, on the call that completes it (check it before feeding more); None otherwise.
        Raises:
            SnapshotCorrupt: not a snapshot, a malformed header, or more bytes than the header declares.
            SnapshotIncompatible: another format version.
            InvalidRequest: the declared size is over the limit (named, with its flag).
        """
        self.received += len(chunk)
        if self.head is not None:
            self._write(chunk)
            return None
        self._prefix += chunk
        head = read_head(self._prefix)
        if head is None:
            return None
        if head.total_bytes > self.limit:
            raise InvalidRequest(f"the snapshot declares {head.total_bytes} bytes; allowed up to {self.limit} "
                                 "(--max-snapshot-bytes)", "data")
        self.head = head
        return head

    def finish(self) -> memoryview:
        """The whole snapshot, once every byte arrived (`decode` checks it).

        Raises:
            InvalidRequest: no bytes at all.
            SnapshotCorrupt: fewer bytes than the header declares (or not even a whole header).
        """
        if not self.received:
            raise InvalidRequest("RestoreSession needs the snapshot: its bytes in RestoreSessionRequest.data, "
                                 "or one message with RestoreSessionRequest.file", "data")
        if self.head is None or self._filled + len(self._prefix) < self.head.total_bytes:
            declared = "" if self.head is None else f" of the {self.head.total_bytes} its header declares"
            raise SnapshotCorrupt(f"the snapshot ends after {self.received} bytes{declared}: it is truncated; "
                                  "nothing was restored", "data")
        self._write(b"")
        assert self._buffer is not None
        return memoryview(self._buffer)

    def release(self) -> None:
        """Drop the buffer (what `finish` returned keeps it while referenced)."""
        self._buffer, self._prefix = None, bytearray()

    def _write(self, chunk: bytes) -> None:
        head = self.head
        assert head is not None
        if self._buffer is None:  # the head was accepted: now the body's memory
            self._buffer = bytearray(head.total_bytes)
            pending, self._prefix = self._prefix, bytearray()
            self._copy(pending)
        self._copy(chunk)

    def _copy(self, data: bytes | bytearray) -> None:
        assert self._buffer is not None
        end = self._filled + len(data)
        if end > len(self._buffer):
            raise SnapshotCorrupt(f"the snapshot runs past the {len(self._buffer)} bytes its header declares", "data")
        self._buffer[self._filled : end] = data
        self._filled = end
