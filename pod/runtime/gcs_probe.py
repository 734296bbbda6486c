"""``ask_gcs``: is a Ray GCS answering at host:port? One gRPC request, bounded in time.

``ray.init(address=...)`` waits for minutes, printing C++ log lines, where
nothing answers, where a port accepts and never answers, and where an HTTP/2
or gRPC server that is not a Ray GCS answers (issue 34); Ray's own GCS client
(``InnerGcsClient.standalone``) also retries its connection for tens of
seconds whatever timeout it is given. So before ``ray.init`` the address is
asked once, over one TCP connection, within a bound: the HTTP/2 connection
preface, then the GCS's cheapest request, ``NodeInfoGcsService/GetClusterId``
(an empty message), with this process's Ray token when it has one.

A Ray GCS that accepts the request answers with a DATA frame holding the
reply (the cluster id, protobuf field 1); one that refuses it (a wrong token),
and any gRPC server without that method, answer with trailers only (a
``grpc-status`` in a HEADERS frame that ends the stream) or reset the
stream; other HTTP/2 servers answer with a non-gRPC response. Only the frame
layout is read, never the compressed (HPACK) headers: a DATA frame with a
gRPC message on the request's stream is the GCS's yes; anything else is a no.

Wire format: RFC 9113 (HTTP/2) frames, RFC 7541 (HPACK) literal header fields
without indexing, and gRPC's length-prefixed messages over HTTP/2.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["GcsAnswer", "ask_gcs", "GCS_METHOD"]

#: The request sent: the GCS's cheapest method (an empty request, a 28-byte reply).
GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY = 0, 1, 3, 4, 6, 7
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1
_STREAM = 1


@dataclass(frozen=True)
class GcsAnswer:
    """What the address said.

    Attributes:
        kind: "gcs" (a Ray GCS answered the request), "refused" (an HTTP/2 server
            answered it without a reply: not a GCS, or a GCS that refuses this
            process's token), "not_http2" (something answered, not in HTTP/2),
            "silent" (no answer within the bound), "closed" (the connection was
            closed before an answer).
        detail: a few words on what came, for the message.
    """

    kind: str
    detail: str = ""


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541, 5.1) with ``prefix_bits`` in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing, new name, no Huffman (6.2.2)."""
    raw_name, raw_value = name.encode(), value.encode()
    return (b"\x00" + _hpack_int(len(raw_name), 7) + raw_name
            + _hpack_int(len(raw_value), 7) + raw_value)


def request_bytes(authority: str, headers: Mapping[str, str] = {}) -> bytes:
    """The client's whole side: preface, SETTINGS, the request's HEADERS and its DATA
    (an empty gRPC message) that ends the stream."""
    block = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", GCS_METHOD),
        (":authority", authority), ("content-type", "application/grpc"), ("te", "trailers"),
        *((k.lower(), v) for k, v in headers.items())))
    return (_PREFACE + _frame(_SETTINGS, 0, 0)
            + _frame(_HEADERS, _END_HEADERS, _STREAM, block)
            + _frame(_DATA, _END_STREAM, _STREAM, b"\x00\x00\x00\x00\x00"))


def ask_gcs(host: str, port: int, timeout_s: float,
            headers: Mapping[str, str] = {}) -> GcsAnswer:
    """Send ``GCS_METHOD`` to ``host:port`` and read what comes back, all within
    ``timeout_s`` wall seconds (module docstring).

    Args:
        host, port: the address.
        timeout_s: the bound for the connection, the request and the answer.
        headers: extra request headers (Ray's ``authorization: Bearer <token>``).

    Returns:
        A ``GcsAnswer``; never raises for what the network does.
    """
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(request_bytes(f"{host}:{port}", headers))
            return _read_answer(sock, deadline, timeout_s)
    except TimeoutError:
        return GcsAnswer("silent", f"the port accepts connections but nothing answered within "
                                   f"{timeout_s:g} s")
    except OSError as err:
        return GcsAnswer("closed", err.strerror or str(err))


def _read_answer(sock: socket.socket, deadline: float, timeout_s: float) -> GcsAnswer:
    buffer = b""
    saw_http2 = False
    while True:
        if len(buffer) >= 9 and not saw_http2 and buffer[3] != _SETTINGS:
            return GcsAnswer("not_http2", "an answer that is not HTTP/2")
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, flags = buffer[3], buffer[4]
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            payload, buffer = buffer[9:9 + length], buffer[9 + length:]
            saw_http2 = True
            if kind == _SETTINGS and not flags & _ACK:
                sock.sendall(_frame(_SETTINGS, _ACK, 0))
            elif kind == _PING and not flags & _ACK:
                sock.sendall(_frame(_PING, _ACK, 0, payload))
            elif stream == _STREAM and kind == _DATA and payload[:1] == b"\x00" \
                    and payload[5:6] == b"\x0a":  # a gRPC message: field 1, the cluster id
                return GcsAnswer("gcs", "a gRPC reply")
            elif stream == _STREAM and kind == _HEADERS and flags & _END_STREAM:
                return GcsAnswer("refused", "a gRPC error status, no reply")
            elif stream == _STREAM and kind == _RST_STREAM:
                return GcsAnswer("refused", "the request's stream was reset")
            elif kind == _GOAWAY:
                return GcsAnswer("refused", "the server closed the connection (GOAWAY)")
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk = sock.recv(65536)
        except TimeoutError:
            if not saw_http2:
                raise
            return GcsAnswer("silent", f"something answers HTTP/2 there, but no Ray GCS answered "
                                       f"within {timeout_s:g} s")
        if not chunk:
            if not saw_http2 and buffer:
                return GcsAnswer("not_http2", "an answer that is not HTTP/2")
            return GcsAnswer("closed", "the connection was closed before an answer")
        buffer += chunk
