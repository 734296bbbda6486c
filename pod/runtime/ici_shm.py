"""Chunk payloads through shared memory between chip actors of one machine (``IciPort``).

Over loopback TCP a chunk is copied twice by the kernel (into the socket, out of
it into a receive buffer) and then added to the gradient buffer. Through shared
memory the sender copies it once into a segment the receiver has mapped, and the
receiver adds it to its buffer straight from there: 0.20 ms of CPU to write a
2 MiB chunk and 0.18 ms to add it, against 0.73 ms to move it over loopback TCP
and 0.19 ms to add it (this machine, one process, ``time.process_time``; the
allreduces: BENCHMARKS.md, "ICI transport"). The TCP link still carries every
header, in order, so the receiver's checks, its mailbox and the order of
additions are unchanged: only where the payload's bytes are read from changes,
and so every result is bit-identical.

One segment per (sender, receiver) link, made by the sender in ``/dev/shm``
(``SEGMENT_PREFIX`` + 32 random hex digits, mode 0600, 1-64 MiB: ``ring_bytes``;
at most ``PORT_BUDGET_BYTES`` for one port's links, and only while the tmpfs and
the machine's available memory keep four times the ring and 1 GiB more free:
past either, links stay on TCP;
its pages reserved with
``posix_fallocate`` so that a full tmpfs is an ``OSError`` here and never a SIGBUS
later) and unlinked by the receiver as soon as it has mapped it (so nothing
outlives the two processes unless the sender dies between making it and the
receiver's first header). Its first page holds the receiver's read position
(int64); the rest is a ring of ``capacity`` bytes in which the sender places
chunks one after another (positions count bytes since the link opened; a chunk
that would wrap starts at the next lap). The receiver releases chunks in any
order and the read position advances over those released in sending order. A
chunk that does not fit (the ring holds unreleased chunks, or it is larger than
half the ring) goes inline over TCP as before: the sender never waits for room.

Used only between ports whose addresses have the same host (one machine: loopback
multi-node clusters included), for payloads of at least ``MIN_SHM_BYTES``.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import re
import secrets
import struct
import threading

import numpy as np

__all__ = ["ShmSender", "ShmReceiver", "SHM_REF", "MIN_SHM_BYTES", "SEGMENT_PREFIX",
           "SHM_FLAG", "PORT_BUDGET_BYTES", "ring_bytes"]

SEGMENT_DIR = "/dev/shm"
SEGMENT_PREFIX = "tpu-pod-ici-"
_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"[0-9a-f]{32}")
#: Set in a chunk header's payload length: the payload is in the link's segment,
#: described by ``SHM_REF`` right after the header.
SHM_FLAG = 1 << 63
#: (position in the ring, bytes since the link opened; the segment's name, ascii 44 bytes)
SHM_REF = struct.Struct("<Q44s")
#: Smaller chunks go inline over TCP (their cost is the header's round, not copies)
MIN_SHM_BYTES = 32 << 10
_PAGE = 4096
_MAX_CAPACITY = 64 << 20  # the largest ring a sender makes
#: The rings one port's links may hold at once (RAM in tmpfs); links past it stay on TCP
PORT_BUDGET_BYTES = 128 << 20
#: A ring is made only if the tmpfs and the machine's available memory keep this many
#: times its size, and _FREE_RESERVE_BYTES more, free afterwards
_FREE_FACTOR = 4
_FREE_RESERVE_BYTES = 1 << 30
_MAX_SEGMENT = 1 << 31  # the largest segment a receiver maps


def ring_bytes(largest_payload: int) -> int:
    """A ring for a link whose largest chunk (in the run that opens the segment) is
    ``largest_payload`` bytes: room for four such chunks (a chip of a ring allreduce
    sends a phase's chunk only after it took the previous phase's), at least 1 MiB,
    at most 64 MiB. Its pages are reserved (RAM in tmpfs) for the link's life; a
    later run's larger chunks go inline."""
    want = max(1 << 20, 4 * largest_payload)
    return min(_MAX_CAPACITY, -(-want // _PAGE) * _PAGE)


def _free_bytes() -> int:
    """The smaller of the tmpfs's free bytes and the machine's MemAvailable (tmpfs pages
    are RAM)."""
    fs = os.statvfs(SEGMENT_DIR)
    free = fs.f_bavail * fs.f_frsize
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                free = min(free, int(line.split()[1]) * 1024)
                break
    return free


def _unmap(segment: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it
        segment.close()


class ShmSender:
    """The sending end of one link's segment (the sender's thread only).

    Raises:
        OSError: the segment could not be made (no ``/dev/shm``, a full tmpfs).
    """

    def __init__(self, largest_payload: int) -> None:
        self.capacity = ring_bytes(largest_payload)
        if _free_bytes() < (_FREE_FACTOR + 1) * (_PAGE + self.capacity) + _FREE_RESERVE_BYTES:
            raise OSError(f"too little free memory for a {self.capacity:,}-byte ring")
        self.name = SEGMENT_PREFIX + secrets.token_hex(16)
        path = os.path.join(SEGMENT_DIR, self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, _PAGE + self.capacity)
            self._map = mmap.mmap(fd, _PAGE + self.capacity)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._read = np.frombuffer(self._map, np.int64, 1, 0)  # the receiver's position
        self._data = np.frombuffer(self._map, np.uint8, self.capacity, _PAGE)
        self._write = 0
        self._ref_name = self.name.encode("ascii")

    def place(self, payload: memoryview) -> bytes | None:
        """Copy ``payload`` into the ring; the ``SHM_REF`` to send after the header, or
        None if it does not fit now (send it inline)."""
        n = len(payload)
        if n > self.capacity // 2:
            return None
        pos = self._write
        if pos % self.capacity + n > self.capacity:
            pos += self.capacity - pos % self.capacity  # the next lap
        if pos + n - int(self._read[0]) > self.capacity:
            return None
        at = pos % self.capacity
        self._data[at:at + n] = np.frombuffer(payload, np.uint8)
        self._write = pos + n
        return SHM_REF.pack(pos, self._ref_name)

    def close(self) -> None:
        """Unmap (and unlink, if the receiver never mapped it)."""
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SEGMENT_DIR, self.name))
        _unmap(self._map)


class ShmReceiver:
    """The receiving end of one link's segment: float32 views into it, released in
    any order (reader threads take, the actor's thread releases).

    Raises:
        ValueError: the name is not one a sender makes, or the segment's size is
            outside the bounds.
        OSError: the segment cannot be opened (another machine's name, say).
    """

    def __init__(self, name: str) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"a shared-memory chunk names segment {name!r}, not a link segment")
        self.name = name
        path = os.path.join(SEGMENT_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if not _PAGE < size <= _MAX_SEGMENT or size % _PAGE:
                raise ValueError(f"shared-memory segment {name} has {size:,} bytes")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        os.unlink(path)  # mapped by both ends: nothing left behind when they exit
        self.capacity = size - _PAGE
        self._read = np.frombuffer(self._map, np.int64, 1, 0)
        self._lock = threading.Lock()
        self._pending: collections.OrderedDict[int, bool] = collections.OrderedDict()
        self._last_end = 0

    def view(self, pos: int, nbytes: int) -> np.ndarray:
        """The float32 chunk at ring position ``pos`` (read-only), after checking it is
        whole within the ring and after the link's previous chunk.

        Raises:
            ValueError: a position that is not the sender's next one.
        """
        at = pos % self.capacity
        if (pos < self._last_end or nbytes <= 0 or at + nbytes > self.capacity
                or nbytes > self.capacity // 2):
            raise ValueError(f"a shared-memory chunk of {nbytes:,} bytes at position {pos:,} "
                             f"does not follow the link's last one (ends at {self._last_end:,}) "
                             f"within its {self.capacity:,}-byte ring")
        self._last_end = pos + nbytes
        with self._lock:
            self._pending[pos + nbytes] = False
        data = np.frombuffer(self._map, np.float32, nbytes // 4, _PAGE + at)
        data.flags.writeable = False
        return data

    def release(self, end: int) -> None:
        """The chunk that ends at ring position ``end`` is applied: free its room, and
        every earlier released chunk's."""
        with self._lock:
            self._pending[end] = True
            read = None
            while self._pending:
                first, done = next(iter(self._pending.items()))
                if not done:
                    break
                del self._pending[first]
                read = first
            if read is not None:
                self._read[0] = read

    def close(self) -> None:
        """Unmap (once the views still in use are gone: the GC unmaps it then)."""
        _unmap(self._map)
