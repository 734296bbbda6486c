"""Direct chip-to-chip links for the functional allreduce: one TCP connection per
(sender, receiver) pair, opened by the sending chip actor itself.

Each chip actor owns one ``IciPort``: a listening socket on its Ray node's
address and a reader thread per incoming connection that files every chunk it
receives into a mailbox, keyed by (phase, sender, sequence). The actor's own
thread runs its rank's part of a schedule (``IciPort.run``): per phase it
sends its chunks straight from its gradient buffer to the receivers' ports,
then waits for the chunks addressed to it and applies them in the schedule's
order. The driver is never on the data path; it only starts one call per chip
(see ``pod.runtime.collective.run_schedule``).

Why sockets and not Ray calls between the actors: a chip actor runs one task
at a time (``max_concurrency=1``: compute, collective and apply must keep their
order), so a peer cannot call into it while it runs the collective, and a
Ray concurrency group would have to be declared wherever the actor class is
made remote (an actor without it crashes when called in that group). A reader
thread beside the actor's task thread needs neither. It also costs tens of
microseconds per hop instead of the ~0.5 ms of an actor call.

Wire format (little-endian, ``struct`` notation):

* hello, once per connection: ``<I16s`` (sender rank, the pod's 16-byte link
  key). The key is a random secret the coordinator hands every chip, so only
  chips of the same pod can write into a buffer; it is not encryption (run on
  a trusted network).
* then per chunk a header ``<QIIIQ`` (run id, phase, sender rank, sequence,
  payload bytes) and the payload: the chunk's float32 values, raw. Between ports
  of one machine a chunk of at least ``ici_shm.MIN_SHM_BYTES`` travels through
  shared memory instead (``pod.runtime.ici_shm``): the payload length has bit 63
  set (``SHM_FLAG``) and the header is followed by ``ici_shm.SHM_REF`` (the
  chunk's position in the link's segment, the segment's name) instead of the
  payload; the receiver adds it to its buffer straight from the segment.
* a heartbeat link (the driver's: ``pod.runtime.heartbeat``) says ``PING_RANK`` in
  its hello, with the same key; then each byte it sends is echoed by the
  port's reader thread. A reader thread runs while the actor's own thread is
  busy (a step, a collective waiting for a peer), so only a process that no
  longer runs at all (stopped, a frozen host, a paused VM) leaves a ping
  unanswered.

What a receiver checks, and what it does when a check fails:

* An accepted connection has ``IciLimits.handshake_timeout_s`` to send its
  hello; at most ``IciLimits.max_pending_handshakes`` connections may wait for
  theirs at once (one thread each), more are closed at once. A wrong key or a
  short hello closes the connection. The hello's rank is the link's sender.
* Each header, before a byte of its payload is read or allocated: the sender
  field must be the hello's rank, the length a multiple of 4 and at most
  ``IciLimits.max_chunk_bytes``; then (phase, sender, sequence) must be a
  receive of the current run's plan not yet received, its length exactly
  that chunk's bounds, and the mailbox must have room (``max_mailbox_chunks``,
  ``max_mailbox_bytes``). A failed check is a protocol violation: the
  connection is dropped, the reason is kept (``IciPort.dropped_reasons``) and
  the run it names fails with an ``IciError`` naming the chip, the phase and
  the reason. So is a link that closes mid-header or mid-chunk.
* A payload is read into a receive buffer of its own and applied to the
  gradient buffer only once complete: a failed chunk never touches it.

Chunks of a run this chip has not started: ``IciPort.run`` registers its plan
before it sends anything, but a peer may start (and send) first. The reader
does not hold such chunks: it stops on the header, reading nothing more from
that link, until the run is registered (TCP flow control then makes the
sender wait once the socket buffers are full).

Plain runs (the data-parallel allreduce: ``IciPort.run``). A chip runs one collective at
a time and a peer cannot be more than one collective ahead of it (no chip
ends an allreduce before every chip has sent), and a link carries its
sender's runs in order. So the waiting chunk is of a run that is over (a
failed one) if this chip registers a different run first, or if the run it
is in still expects chunks from that sender (a later run's chunks would come
after them). Such a chunk is read into a small scratch buffer and discarded,
the link kept.

Sequenced runs (``IciPort.run(..., sequenced=True)``: the sharded step, where a
device program issues many sub-group collectives in one actor task). Run ids
increase in program order on every device (the same id for the same
collective on every member of its group), but a peer may be several runs
ahead: it may have finished collectives over other groups this chip is not
in. So the rule is by order, not by "the run in progress": a chunk of a run
id above the last sequenced run this chip registered waits (the reader stops
on its header, as above); a chunk of an id at or below it, other than the
run in progress, is of a run that is over and is discarded. Every check of a
plain run (the key, the header checks, the caps, the plan's receives and
lengths) applies unchanged once the chunk's run is registered. A chip
registers sequenced ids strictly increasing (``run`` refuses others); a
plain run in between leaves sequenced mode.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pod.errors import IciError
from pod.runtime.ici_shm import (
    MIN_SHM_BYTES,
    PORT_BUDGET_BYTES,
    SHM_FLAG,
    SHM_REF,
    ShmReceiver,
    ShmSender,
    ring_bytes,
)

__all__ = ["IciPort", "IciError", "IciLimits", "RankPlan", "PING_RANK", "hello"]

_HELLO = struct.Struct("<I16s")
#: The sender rank of a heartbeat link's hello (no chip has it: ranks are below 2**32 - 1)
PING_RANK = 0xFFFFFFFF
_HEADER = struct.Struct("<QIIIQ")
_SOCKET_BUFFER = 4 << 20
_DRAIN_BYTES = 1 << 20  # scratch buffer for discarding a stale chunk's payload
_KEPT_REASONS = 64  # drop reasons kept for inspection (``dropped_reasons``)
_KEPT_FAULTS = 16  # runs whose first protocol fault is kept until the run reads it

#: One rank's part of a schedule: per non-empty phase (phase index,
#: sends [(dst, chunk, seq)], receives [(src, seq, dst_chunk, reduce)] in the
#: schedule's transfer order).
RankPlan = list[tuple[int, list[tuple[int, int, int]], list[tuple[int, int, int, bool]]]]


@dataclass(frozen=True)
class IciLimits:
    """What one port accepts from the network before it refuses.

    Attributes:
        handshake_timeout_s: seconds an accepted connection has to send a
            valid hello before it is closed.
        max_pending_handshakes: accepted connections waiting for their hello
            at once (each holds a thread); more are closed at once.
        max_chunk_bytes: the largest payload a header may declare (1 GiB:
            a 256 Mi-parameter float32 chunk).
        max_mailbox_chunks: chunks received and not yet applied, at most.
        max_mailbox_bytes: their payload bytes, at most.

    Raises:
        ValueError: a limit that is not positive.
    """

    handshake_timeout_s: float = 5.0
    max_pending_handshakes: int = 32
    max_chunk_bytes: int = 1 << 30
    max_mailbox_chunks: int = 4096
    max_mailbox_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        for name in ("handshake_timeout_s", "max_pending_handshakes", "max_chunk_bytes",
                     "max_mailbox_chunks", "max_mailbox_bytes"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"IciLimits.{name} must be positive, got {value!r}")


class _Violation(Exception):
    """A link broke the protocol (or closed mid-message): drop it, fail the run."""

    def __init__(self, run_id: int | None, phase: int | None, reason: str) -> None:
        super().__init__(reason)
        self.run_id, self.phase, self.reason = run_id, phase, reason


def link_key(key: bytes) -> bytes:
    """The 16 bytes a hello presents for the pod's link secret ``key``."""
    return hashlib.sha256(b"tpu-pod-ici:" + bytes(key)).digest()[:16]


def hello(rank: int, key: bytes) -> bytes:
    """A link's first message: the sender's ``rank`` (``PING_RANK`` for a heartbeat
    link) and the pod's link secret ``key``."""
    return _HELLO.pack(rank, link_key(key))


def _node_address() -> str:
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker
        pass
    return "127.0.0.1"


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):  # pragma: no cover - kernel limit
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)


def _recv_into(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from ``sock``; return the bytes received (fewer than
    ``len(view)`` only if the peer closed the connection first)."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            break
        got += n
    return got


class IciPort:
    """The receiving port and outgoing links of one chip.

    Args:
        rank: this chip's rank (sent to peers when connecting).
        key: the pod's link secret (any bytes; the same on every chip of a pod).
        limits: what the port accepts from the network (``IciLimits``).
        shared_memory: send chunks to ports of the same host through shared memory
            (``pod.runtime.ici_shm``; the same bits, fewer copies); False: every
            payload over TCP. An attribute: it may be changed between runs.
    """

    def __init__(self, rank: int, key: bytes = b"", limits: IciLimits = IciLimits(),
                 shared_memory: bool = True) -> None:
        self.rank = rank
        self.limits = limits
        self.shared_memory = shared_memory
        self._key = link_key(key)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host = _node_address()
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.address = (host, self._listener.getsockname()[1])
        self._handshakes = threading.BoundedSemaphore(limits.max_pending_handshakes)
        # one lock, two conditions: reader threads wait on ``_cond`` for their chunk's run
        # to be registered, the actor's thread on ``_arrived`` for a chunk; a chunk filed
        # wakes only the actor's thread (waking every reader for each chunk made the
        # readers and the actor's thread take turns at the GIL on busy cores)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._arrived = threading.Condition(lock)
        self._closed = False
        self._conns: set[socket.socket] = set()
        # the current run (None between runs); ``_generation`` counts registrations
        self._run_id: int | None = None
        self._generation = 0
        # sequenced mode (module docstring): the last sequenced run id registered, or None
        self._sequence_last: int | None = None
        self._expected: dict[tuple[int, int, int], int] = {}  # (phase, src, seq) -> bytes
        self._expected_from: collections.Counter[int] = collections.Counter()  # src -> chunks
        self._mailbox: dict[tuple[int, int, int], np.ndarray] = {}
        self._mailbox_bytes = 0  # admitted chunks' bytes (being read or waiting to apply)
        self._mailbox_chunks = 0
        self._faults: collections.OrderedDict[int, tuple[int | None, str]] = (
            collections.OrderedDict())
        self._dropped: collections.deque[str] = collections.deque(maxlen=_KEPT_REASONS)
        self._lost: set[int] = set()
        self._free: dict[int, list[np.ndarray]] = {}
        self._links: dict[tuple[str, int], socket.socket] = {}
        self._shm_out: dict[tuple[str, int], ShmSender | None] = {}  # None: TCP only
        self._largest: dict[tuple[str, int], int] = {}  # the run's largest chunk per link
        self._shm_views: dict[int, tuple[ShmReceiver, int]] = {}  # id(view) -> (segment, end)
        threading.Thread(target=self._accept, name="ici-accept", daemon=True).start()

    @property
    def dropped_reasons(self) -> tuple[str, ...]:
        """Why this port dropped connections or chunks, oldest first (the last 64)."""
        with self._cond:
            return tuple(self._dropped)

    # -- receiving (reader threads) ---------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                conn.close()
                self._note(f"closed a connection: {self.limits.max_pending_handshakes} "
                           "connections already wait for their hello")
                continue
            with self._cond:
                self._conns.add(conn)
            _tune(conn)
            conn.settimeout(self.limits.handshake_timeout_s)
            threading.Thread(target=self._serve, args=(conn,), name="ici-read", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        src = None
        try:
            src = self._handshake(conn)
            if src == PING_RANK:
                src = None  # not a chip: nothing is lost when it closes
                self._answer_pings(conn)
            elif src is not None:
                self._read_chunks(conn, src)
        except _Violation as violation:
            self._fault(violation)
        except OSError:
            pass
        finally:
            conn.close()
            with self._cond:
                self._conns.discard(conn)
                if src is not None:
                    self._lost.add(src)
                self._cond.notify_all()
                self._arrived.notify_all()

    def _handshake(self, conn: socket.socket) -> int | None:
        """The hello's rank, or None (connection to drop) for a bad or missing hello."""
        hello = bytearray(_HELLO.size)
        try:
            got = _recv_into(conn, memoryview(hello))
        except TimeoutError:
            self._note(f"closed a connection that sent no hello within "
                       f"{self.limits.handshake_timeout_s:g} s")
            return None
        finally:
            self._handshakes.release()
        if got < _HELLO.size:
            self._note(f"a connection closed after {got} of {_HELLO.size} hello bytes")
            return None
        src, key = _HELLO.unpack(hello)
        if not hmac.compare_digest(key, self._key):
            self._note(f"closed a connection claiming chip {src}: wrong link key")
            return None
        conn.settimeout(None)
        with self._cond:
            self._lost.discard(src)
        return src

    @staticmethod
    def _answer_pings(conn: socket.socket) -> None:
        """A heartbeat link: echo every byte until the driver closes it."""
        while True:
            data = conn.recv(64)
            if not data:
                return
            conn.sendall(data)

    def _read_chunks(self, conn: socket.socket, src: int) -> None:
        header = bytearray(_HEADER.size)
        segments: dict[bytes, ShmReceiver] = {}  # this link's shared-memory segments
        try:
            while self._read_chunk(conn, src, header, segments):
                pass
        finally:
            for segment in segments.values():
                segment.close()

    def _read_chunk(self, conn: socket.socket, src: int, header: bytearray,
                    segments: dict[bytes, ShmReceiver]) -> bool:
        """Read one chunk into the mailbox (or discard it); False when the link closed
        between chunks (``_take`` names it if a chunk is missing)."""
        got = _recv_into(conn, memoryview(header))
        if got == 0:
            return False
        if got < _HEADER.size:
            raise _Violation(None, None, f"the link from chip {src} closed mid-header "
                                         f"(got {got} of {_HEADER.size} bytes)")
        run_id, phase, sender, seq, nbytes = _HEADER.unpack(header)
        shared = bool(nbytes & SHM_FLAG)
        nbytes &= ~SHM_FLAG
        self._check_header(src, run_id, phase, sender, nbytes)
        if shared:
            return self._read_shared(conn, src, (run_id, phase, seq), nbytes, segments)
        if not self._admit(src, run_id, phase, seq, nbytes):
            self._drain(conn, src, run_id, phase, nbytes)
            return True
        data = self._buffer(nbytes // 4)
        got = _recv_into(conn, data.data.cast("B")) if nbytes else 0
        if got < nbytes:
            self._release(data)
            raise _Violation(run_id, phase, f"the link from chip {src} closed mid-chunk "
                                            f"(got {got:,} of {nbytes:,} bytes)")
        self._file(src, run_id, phase, seq, data)
        return True

    def _read_shared(self, conn: socket.socket, src: int, chunk: tuple[int, int, int],
                     nbytes: int, segments: dict[bytes, ShmReceiver]) -> bool:
        """A chunk whose payload is in the link's shared-memory segment: its reference
        after the header, then a read-only view of it into the mailbox."""
        run_id, phase, seq = chunk
        ref = bytearray(SHM_REF.size)
        if _recv_into(conn, memoryview(ref)) < SHM_REF.size:
            raise _Violation(run_id, phase, f"the link from chip {src} closed mid-header")
        pos, name = SHM_REF.unpack(ref)
        try:
            segment = segments.get(name)
            if segment is None:
                segment = segments[name] = ShmReceiver(name.decode("ascii", "replace"))
            data = segment.view(pos, nbytes)
        except (OSError, ValueError) as err:
            raise _Violation(run_id, phase, f"the shared-memory chunk from chip {src}: "
                                            f"{err}") from None
        with self._cond:
            self._shm_views[id(data)] = (segment, pos + nbytes)
        if not self._admit(src, run_id, phase, seq, nbytes):
            self._note(f"discarded a chunk of phase {phase} from chip {src} of run {run_id}, "
                       "which is over")
            self._release(data)
            return True
        self._file(src, run_id, phase, seq, data)
        return True

    def _file(self, src: int, run_id: int, phase: int, seq: int, data: np.ndarray) -> None:
        """Put a received chunk into the mailbox, unless its run ended meanwhile."""
        with self._cond:
            if self._run_id == run_id:
                self._mailbox[(phase, src, seq)] = data
                self._arrived.notify()  # the actor's thread, in ``_take``
                return
        self._release(data)  # the run ended (failed) while the payload came in

    def _check_header(self, src: int, run_id: int, phase: int, sender: int, nbytes: int) -> None:
        """The checks that need no plan: sender, whole float32, the per-chunk cap."""
        if sender != src:
            raise _Violation(run_id, phase, f"a header from the link of chip {src} names chip "
                                            f"{sender} as its sender")
        if nbytes % 4:
            raise _Violation(run_id, phase, f"the chunk from chip {src} declares {nbytes:,} bytes, "
                                            "not a whole number of float32")
        if nbytes > self.limits.max_chunk_bytes:
            raise _Violation(run_id, phase, f"the chunk from chip {src} declares {nbytes:,} bytes, "
                                            f"more than the {self.limits.max_chunk_bytes:,}-byte "
                                            "cap on a chunk")

    def _admit(self, src: int, run_id: int, phase: int, seq: int, nbytes: int) -> bool:
        """Wait until ``run_id`` is the registered run, then check the chunk against its
        plan and reserve its room in the mailbox.

        Returns:
            False if the chunk is of a run that is over: this chip has registered
            another run since the header came (a peer is never more than one run
            ahead), or the registered run still expects chunks from ``src`` (a
            later run's chunks would come after those on this link).

        Raises:
            _Violation: the plan does not expect the chunk, its length is not
                the plan's, or the mailbox is full.
        """
        with self._cond:
            generation = self._generation
            while self._run_id != run_id:
                if self._closed:
                    raise OSError("port closed")
                if self._sequence_last is not None:
                    if run_id <= self._sequence_last:
                        return False  # sequenced: a run at or below the last registered is over
                elif self._run_id is not None and (self._generation != generation
                                                   or self._expected_from[src]):
                    return False
                self._cond.wait()
            expected = self._expected.pop((phase, src, seq), None)
            if expected is None:
                raise _Violation(run_id, phase, f"chip {src} sent chunk {seq} of phase {phase}, "
                                                "which this chip's plan does not expect (or "
                                                "already received)")
            self._expected_from[src] -= 1
            if nbytes != expected:
                raise _Violation(run_id, phase, f"the chunk from chip {src} declares {nbytes:,} "
                                                f"bytes, the plan expects {expected:,}")
            limits = self.limits
            if (self._mailbox_chunks >= limits.max_mailbox_chunks
                    or self._mailbox_bytes + nbytes > limits.max_mailbox_bytes):
                raise _Violation(run_id, phase, f"no room in the mailbox for the chunk from chip "
                                                f"{src} ({nbytes:,} bytes): it holds "
                                                f"{self._mailbox_chunks} of "
                                                f"{limits.max_mailbox_chunks} chunks, "
                                                f"{self._mailbox_bytes:,} of "
                                                f"{limits.max_mailbox_bytes:,} bytes")
            self._mailbox_chunks += 1
            self._mailbox_bytes += nbytes
            return True

    def _drain(self, conn: socket.socket, src: int, run_id: int, phase: int, nbytes: int) -> None:
        """Read and discard a stale chunk's payload (``nbytes`` is within the cap)."""
        self._note(f"discarded a chunk of phase {phase} from chip {src} of run {run_id}, "
                   "which is over")
        scratch = memoryview(bytearray(min(nbytes, _DRAIN_BYTES)))
        left = nbytes
        while left:
            step = min(left, len(scratch))
            if _recv_into(conn, scratch[:step]) < step:
                raise OSError("closed mid-chunk")  # nothing waits for this run: just drop
            left -= step

    def _note(self, reason: str) -> None:
        with self._cond:
            self._dropped.append(reason)

    def _fault(self, violation: _Violation) -> None:
        """Keep a violation's reason for the run it names (``_take`` raises it)."""
        with self._cond:
            self._dropped.append(violation.reason)
            if violation.run_id is not None and violation.run_id not in self._faults:
                self._faults[violation.run_id] = (violation.phase, violation.reason)
                while len(self._faults) > _KEPT_FAULTS:
                    self._faults.popitem(last=False)
            self._cond.notify_all()
            self._arrived.notify_all()

    def _buffer(self, count: int) -> np.ndarray:
        """A receive buffer of ``count`` float32, reused (fresh pages fault: slow)."""
        with self._cond:
            free = self._free.get(count)
            if free:
                return free.pop()
        return np.empty(count, dtype=np.float32)

    def _release(self, data: np.ndarray) -> None:
        with self._cond:
            shared = self._shm_views.pop(id(data), None)
            if shared is not None:  # a view into a link's segment: free its room
                segment, end = shared
                segment.release(end)
                return
            free = self._free.setdefault(data.size, [])
            if len(free) < 4:
                free.append(data)

    def _take(self, run_id: int, key: tuple[int, int, int], deadline: float) -> np.ndarray:
        phase, src, _ = key
        with self._cond:
            while True:
                if run_id in self._faults:
                    fault_phase, reason = self._faults[run_id]
                    raise IciError(f"chip {self.rank}: phase "
                                   f"{phase if fault_phase is None else fault_phase}: {reason}")
                if key in self._mailbox:
                    break
                if src in self._lost:
                    raise IciError(f"chip {self.rank}: phase {phase}: the link from chip {src} "
                                   f"closed before its chunk arrived (chip {src} died?)")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise IciError(f"chip {self.rank}: phase {phase}: no chunk from chip {src} "
                                   "within the collective's timeout")
                self._arrived.wait(min(left, 1.0))
            data = self._mailbox.pop(key)
            self._mailbox_chunks -= 1
            self._mailbox_bytes -= data.nbytes
            return data

    # -- sending (the actor's own thread) ---------------------------------------

    def _link(self, address: tuple[str, int]) -> socket.socket:
        sock = self._links.get(address)
        if sock is None:
            sock = socket.create_connection(address)
            _tune(sock)
            sock.sendall(_HELLO.pack(self.rank, self._key))
            self._links[address] = sock
        return sock

    def _segment(self, address: tuple[str, int], nbytes: int) -> ShmSender | None:
        """The shared-memory segment of the link to ``address``, or None: another host,
        shared memory off, a small chunk, or no segment could be made."""
        if not self.shared_memory or nbytes < MIN_SHM_BYTES or address[0] != self.address[0]:
            return None
        if address not in self._shm_out:
            largest = max(nbytes, self._largest.get(address, 0))  # the run's, on this link
            held = sum(s.capacity for s in self._shm_out.values() if s is not None)
            try:
                if held + ring_bytes(largest) > PORT_BUDGET_BYTES:
                    raise OSError("the port's rings are at their budget")
                self._shm_out[address] = ShmSender(largest)
            except OSError:  # the budget, no /dev/shm, a full tmpfs: the link stays on TCP
                self._shm_out[address] = None
        return self._shm_out[address]

    def _send(self, address: tuple[str, int], chunk: tuple[int, int, int],
              payload: memoryview) -> None:
        run_id, phase, seq = chunk
        for attempt in (0, 1):
            sock = self._link(address)
            segment = self._segment(address, len(payload))
            ref = segment.place(payload) if segment is not None else None
            try:
                if ref is not None:
                    sock.sendall(_HEADER.pack(run_id, phase, self.rank, seq,
                                              len(payload) | SHM_FLAG) + ref)
                    return
                sock.sendall(_HEADER.pack(run_id, phase, self.rank, seq, len(payload)))
                if len(payload):
                    sock.sendall(payload)
                return
            except OSError:
                # a stale link to a peer that restarted on this address: reconnect once
                # (with a new segment: the peer's new reader has not mapped the old one)
                self._links.pop(address, None)
                sock.close()
                self._drop_segment(address)
                if attempt:
                    raise

    def _drop_segment(self, address: tuple[str, int]) -> None:
        segment = self._shm_out.pop(address, None)
        if segment is not None:
            segment.close()

    # -- one rank's collective ---------------------------------------------------

    def run(self, run_id: int, plan: RankPlan, addresses: dict[int, tuple[str, int]],
            buffer: np.ndarray, bounds: Sequence[tuple[int, int]], timeout: float = 600.0,
            sequenced: bool = False,
            after_phase: Callable[[int], None] | None = None) -> None:
        """Run this rank's part of a schedule on ``buffer`` in place.

        Per phase: send every outgoing chunk as the buffer holds it at the
        start of the phase, then take the incoming chunks and, in the
        schedule's order, reduce (``dst = dst + incoming``) or copy them: the
        semantics of ``interconnect.execute``, so the results are bit-identical.
        The plan is registered with the reader threads before anything is
        sent: they accept exactly its receives.

        Args:
            run_id: identifies this collective (the same on every rank).
            plan: this rank's phases (``RankPlan``).
            addresses: (host, port) of every rank this one sends to.
            buffer: this chip's flat float32 gradient buffer, (P,).
            bounds: the schedule's chunk element ranges [(start, stop), ...].
            timeout: seconds to wait for the whole collective's chunks.
            sequenced: a run of a sequence (module docstring, "Sequenced
                runs"): ``run_id`` must exceed every sequenced id this port
                registered before; chunks of later ids wait, of earlier ones
                are discarded. False (a plain run) leaves sequenced mode.
            after_phase: called with each phase's index once its receives are applied,
                before the next phase sends (local arithmetic between two phases:
                ``pod.runtime.mesh_collectives``' direct allreduce).

        Raises:
            IciError: a peer died, its link closed (mid-chunk or before its
                chunk), it broke the protocol (a chunk the plan does not
                expect, of the wrong length, from the wrong sender), or a
                chunk did not arrive in time. Chunks are applied only whole,
                but earlier chunks of the run have been: the buffer holds a
                partial result.
            RuntimeError: another run is in progress on this port, or a
                sequenced ``run_id`` does not exceed the last one.
        """
        expected = {(phase, src, seq): (bounds[dst_chunk][1] - bounds[dst_chunk][0]) * 4
                    for phase, _, receives in plan for src, seq, dst_chunk, _ in receives}
        with self._cond:
            if self._run_id is not None:
                raise RuntimeError(f"chip {self.rank}: run {run_id} started while run "
                                   f"{self._run_id} is in progress")
            if sequenced:
                last = self._sequence_last
                if last is not None and run_id <= last:
                    raise RuntimeError(f"chip {self.rank}: sequenced run {run_id} does not "
                                       f"follow run {last}: sequenced run ids must increase")
                self._sequence_last = run_id
            else:
                self._sequence_last = None
            self._run_id, self._expected = run_id, expected
            self._expected_from = collections.Counter(src for _, src, _ in expected)
            self._generation += 1
            self._cond.notify_all()
        try:
            self._run(run_id, plan, addresses, buffer, bounds, time.monotonic() + timeout,
                      after_phase)
        finally:
            with self._cond:  # forget the run: what it left behind is never applied
                for data in self._mailbox.values():
                    self._release(data)
                self._mailbox.clear()
                self._mailbox_chunks = self._mailbox_bytes = 0
                self._run_id, self._expected = None, {}
                self._expected_from.clear()
                self._faults.pop(run_id, None)
                self._cond.notify_all()

    def _run(self, run_id: int, plan: RankPlan, addresses: dict[int, tuple[str, int]],
             buffer: np.ndarray, bounds: Sequence[tuple[int, int]], deadline: float,
             after_phase: Callable[[int], None] | None) -> None:
        raw = buffer.data.cast("B")
        self._largest = {}
        for _, sends, _ in plan:
            for dst, chunk, _ in sends:
                nbytes = (bounds[chunk][1] - bounds[chunk][0]) * 4
                self._largest[addresses[dst]] = max(self._largest.get(addresses[dst], 0), nbytes)
        for phase, sends, receives in plan:
            for dst, chunk, seq in sends:
                start, stop = bounds[chunk]
                try:
                    self._send(addresses[dst], (run_id, phase, seq), raw[start * 4:stop * 4])
                except OSError as err:  # ConnectionError, BrokenPipeError, a timeout ...
                    raise IciError(f"chip {self.rank}: phase {phase}: the link to chip {dst} "
                                   f"failed while sending ({type(err).__name__}: {err})") from None
            for src, seq, dst_chunk, reduce in receives:
                data = self._take(run_id, (phase, src, seq), deadline)
                start, stop = bounds[dst_chunk]
                target = buffer[start:stop]
                if reduce:
                    np.add(target, data, out=target)
                else:
                    target[...] = data
                self._release(data)
            if after_phase is not None:
                after_phase(phase)

    def close(self) -> None:
        """Close the listener, every incoming connection and every outgoing link."""
        with self._cond:
            self._closed = True
            conns = list(self._conns)
            self._cond.notify_all()
            self._arrived.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (Linux)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for sock in self._links.values():
            sock.close()
        self._links.clear()
        for address in list(self._shm_out):
            self._drop_segment(address)
