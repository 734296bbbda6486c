"""Direct chip-to-chip links for the functional allreduce: one TCP connection per
(sender, receiver) pair, opened by the sending chip actor itself.

Each chip actor owns one ``IciPort``: a listening socket on its Ray node's
address and a reader thread per incoming connection that files every chunk it
receives into a mailbox, keyed by (run, phase, sender, sequence). The actor's
own thread runs its rank's part of a schedule (``IciPort.run``): per phase it
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

Wire format: on connect the sender sends its rank and the pod's 16-byte link
key (``<I16s``); a receiver closes a connection whose key is not its own, so
only chips of the same pod can write into its buffer (the key is a random
secret the coordinator hands every chip; it is not encryption: run on a
trusted network). Then per chunk a header ``<QIIIQ`` (run id, phase, sender
rank, sequence, payload bytes) and the raw float32 bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
import time
from typing import Sequence

import numpy as np

from pod.errors import IciError

__all__ = ["IciPort", "IciError", "RankPlan"]

_HELLO = struct.Struct("<I16s")
_HEADER = struct.Struct("<QIIIQ")
_SOCKET_BUFFER = 4 << 20

#: One rank's part of a schedule: per non-empty phase (phase index,
#: sends [(dst, chunk, seq)], receives [(src, seq, dst_chunk, reduce)] in the
#: schedule's transfer order).
RankPlan = list[tuple[int, list[tuple[int, int, int]], list[tuple[int, int, int, bool]]]]


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
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
        except OSError:  # pragma: no cover - kernel limit
            pass


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on a clean end of stream before any byte."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError("connection closed in the middle of a message")
        got += n
    return True


class IciPort:
    """The receiving port and outgoing links of one chip.

    Args:
        rank: this chip's rank (sent to peers when connecting).
        key: the pod's link secret (any bytes; the same on every chip of a pod).
    """

    def __init__(self, rank: int, key: bytes = b"") -> None:
        self.rank = rank
        self._key = hashlib.sha256(b"tpu-pod-ici:" + bytes(key)).digest()[:16]
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host = _node_address()
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.address = (host, self._listener.getsockname()[1])
        self._cond = threading.Condition()
        self._mailbox: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._lost: set[int] = set()
        self._free: dict[int, list[np.ndarray]] = {}
        self._links: dict[tuple[str, int], socket.socket] = {}
        threading.Thread(target=self._accept, name="ici-accept", daemon=True).start()

    # -- receiving (reader threads) ---------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            _tune(conn)
            threading.Thread(target=self._read, args=(conn,), name="ici-read", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        hello = bytearray(_HELLO.size)
        src = None
        try:
            if not _recv_exact(conn, memoryview(hello)):
                return
            src, key = _HELLO.unpack(hello)
            if not hmac.compare_digest(key, self._key):
                src = None  # not a chip of this pod: drop the connection, unseen
                return
            with self._cond:
                self._lost.discard(src)
            header = bytearray(_HEADER.size)
            while _recv_exact(conn, memoryview(header)):
                run_id, phase, sender, seq, nbytes = _HEADER.unpack(header)
                data = self._buffer(nbytes // 4)
                if nbytes:
                    _recv_exact(conn, memoryview(data).cast("B"))
                with self._cond:
                    self._mailbox[(run_id, phase, sender, seq)] = data
                    self._cond.notify_all()
        except OSError:
            pass
        finally:
            conn.close()
            if src is not None:
                with self._cond:
                    self._lost.add(src)
                    self._cond.notify_all()

    def _buffer(self, count: int) -> np.ndarray:
        """A receive buffer of ``count`` float32, reused (fresh pages fault: slow)."""
        with self._cond:
            free = self._free.get(count)
            if free:
                return free.pop()
        return np.empty(count, dtype=np.float32)

    def _release(self, data: np.ndarray) -> None:
        with self._cond:
            free = self._free.setdefault(data.size, [])
            if len(free) < 4:
                free.append(data)

    def _take(self, key: tuple[int, int, int, int], deadline: float) -> np.ndarray:
        with self._cond:
            while key not in self._mailbox:
                src = key[2]
                if src in self._lost:
                    raise IciError(f"chip {self.rank}: the link from chip {src} closed before "
                                   f"phase {key[1]}'s chunk arrived (chip {src} died?)")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise IciError(f"chip {self.rank}: no chunk from chip {src} in phase {key[1]} "
                                   f"within the collective's timeout")
                self._cond.wait(min(left, 1.0))
            return self._mailbox.pop(key)

    # -- sending (the actor's own thread) ---------------------------------------

    def _link(self, address: tuple[str, int]) -> socket.socket:
        sock = self._links.get(address)
        if sock is None:
            sock = socket.create_connection(address)
            _tune(sock)
            sock.sendall(_HELLO.pack(self.rank, self._key))
            self._links[address] = sock
        return sock

    def _send(self, address: tuple[str, int], header: bytes, payload: memoryview) -> None:
        for attempt in (0, 1):
            sock = self._link(address)
            try:
                sock.sendall(header)
                if len(payload):
                    sock.sendall(payload)
                return
            except OSError:
                # a stale link to a peer that restarted on this address: reconnect once
                self._links.pop(address, None)
                sock.close()
                if attempt:
                    raise

    # -- one rank's collective ---------------------------------------------------

    def run(self, run_id: int, plan: RankPlan, addresses: dict[int, tuple[str, int]],
            buffer: np.ndarray, bounds: Sequence[tuple[int, int]], timeout: float = 600.0) -> None:
        """Run this rank's part of a schedule on ``buffer`` in place.

        Per phase: send every outgoing chunk as the buffer holds it at the
        start of the phase, then take the incoming chunks and, in the
        schedule's order, reduce (``dst = dst + incoming``) or copy them: the
        semantics of ``interconnect.execute``, so the results are bit-identical.

        Args:
            run_id: identifies this collective (the same on every rank).
            plan: this rank's phases (``RankPlan``).
            addresses: (host, port) of every rank this one sends to.
            buffer: this chip's flat float32 gradient buffer.
            bounds: the schedule's chunk element ranges.
            timeout: seconds to wait for the whole collective's chunks.

        Raises:
            IciError: a peer died or a chunk did not arrive in time.
        """
        try:
            self._run(run_id, plan, addresses, buffer, bounds, time.monotonic() + timeout)
        except BaseException:
            with self._cond:  # drop what this failed run left behind
                for key in [k for k in self._mailbox if k[0] == run_id]:
                    del self._mailbox[key]
            raise

    def _run(self, run_id: int, plan: RankPlan, addresses: dict[int, tuple[str, int]],
             buffer: np.ndarray, bounds: Sequence[tuple[int, int]], deadline: float) -> None:
        raw = memoryview(buffer).cast("B")
        for phase, sends, receives in plan:
            for dst, chunk, seq in sends:
                start, stop = bounds[chunk]
                header = _HEADER.pack(run_id, phase, self.rank, seq, (stop - start) * 4)
                self._send(addresses[dst], header, raw[start * 4:stop * 4])
            for src, seq, dst_chunk, reduce in receives:
                data = self._take((run_id, phase, src, seq), deadline)
                start, stop = bounds[dst_chunk]
                target = buffer[start:stop]
                if reduce:
                    np.add(target, data, out=target)
                else:
                    target[...] = data
                self._release(data)

    def close(self) -> None:
        """Close the listener and every outgoing link."""
        self._listener.close()
        for sock in self._links.values():
            sock.close()
        self._links.clear()
