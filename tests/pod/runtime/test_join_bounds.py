"""Probe 4 of issue 26: a `ray.address` that accepts TCP and never answers hung for more
than 300 s with 30 lines of Ray's C++ warnings (the earlier fix covered only a refused
connection). The address must now answer as a gRPC server (the GCS) within the bound.
No Ray cluster: the probe fails before ``ray.init``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from pod.errors import ClusterError
from pod.runtime.cluster import _check_reachable


@pytest.fixture
def black_hole():
    """A port that accepts connections and never says a word."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held, stop = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_port_that_accepts_and_never_answers_fails_within_the_bound(black_hole):
    with pytest.raises(ClusterError) as err:
        _check_reachable(black_hole, timeout_s=1.0)
    text = str(err.value)
    assert text.startswith(f"ray.address: no Ray cluster answers at {black_hole!r} (the port "
                           "accepts connections but nothing answered within 1 s, after ")
    assert float(text.split("after ")[1].split(" s)")[0]) < 5


def test_something_that_is_not_a_ray_cluster_is_named(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(64)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    with pytest.raises(ClusterError, match="something answers there, but not a Ray cluster"):
        _check_reachable(address, timeout_s=5.0)
    server.close()


def _http2_server(frames_after_request: bytes | None):
    """An HTTP/2 server that is not a Ray GCS: it answers the connection preface with a
    SETTINGS frame, then sends ``frames_after_request`` once the request came (None:
    nothing, keeping the connection open). Returns (address, stop)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held, stop = [], threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn = server.accept()[0]
            except OSError:
                continue
            held.append(conn)
            conn.recv(4096)
            conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # an empty SETTINGS frame
            if frames_after_request is not None:
                conn.sendall(frames_after_request)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close() -> None:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()

    return f"127.0.0.1:{server.getsockname()[1]}", close


def test_an_http2_server_that_never_answers_the_request_fails_within_the_bound():
    """Issue 34: an address where a non-Ray HTTP/2 server answers hung for minutes in
    ``ray.init``; the GCS request now has to be answered within the bound."""
    address, close = _http2_server(None)
    try:
        with pytest.raises(ClusterError) as err:
            _check_reachable(address, timeout_s=1.0)
    finally:
        close()
    text = str(err.value)
    assert text.startswith(f"ray.address: no Ray cluster answers at {address!r} (something "
                           "answers HTTP/2 there, but no Ray GCS answered within 1 s, after ")
    assert "\n" not in text


def test_a_grpc_server_that_refuses_the_gcs_request_is_named():
    """A gRPC server without the GCS's method (or a GCS refusing the token) answers with
    trailers only: a HEADERS frame that ends the request's stream."""
    trailers = bytes([0, 0, 1, 1, 0x5, 0, 0, 0, 1, 0x88])  # HEADERS, END_STREAM|END_HEADERS
    address, close = _http2_server(trailers)
    try:
        with pytest.raises(ClusterError, match=r"^ray\.address: the server at '127\.0\.0\.1:\d+' "
                           r"refused a Ray GCS request \(a gRPC error status, no reply\): .*"
                           r"or it is not a Ray cluster$"):
            _check_reachable(address, timeout_s=5.0)
    finally:
        close()


def test_a_ray_client_address_needs_only_an_http2_answer():
    """``ray://`` is Ray Client's server, not the GCS: any gRPC answer will do."""
    trailers = bytes([0, 0, 1, 1, 0x5, 0, 0, 0, 1, 0x88])
    address, close = _http2_server(trailers)
    try:
        _check_reachable(f"ray://{address}", timeout_s=5.0)
    finally:
        close()


def test_auto_with_no_cluster_is_one_line(monkeypatch):
    """``ray.address: auto`` (or ``RAY_ADDRESS=auto``) where Ray finds no cluster: one line,
    before any connection (Ray's lookup: ``ray start``'s record, then GCS processes)."""
    from ray._private import services

    from pod.runtime.cluster import _resolve

    monkeypatch.setattr(services, "find_gcs_addresses", lambda: set())
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    with pytest.raises(ClusterError) as err:
        _resolve("auto", "RAY_ADDRESS")
    assert str(err.value) == ("RAY_ADDRESS: 'auto' finds no Ray cluster to join on this machine "
                              "(Could not find any running Ray instance); start one (`ray start "
                              "--head`), or remove ray.address and RAY_ADDRESS to run on a local "
                              "cluster")
    assert _resolve("10.0.0.1:6379", "ray.address") == "10.0.0.1:6379"


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_a_real_gcs_passes_the_probe(ray_cluster):
    _check_reachable(ray_cluster, timeout_s=10.0)


@pytest.mark.slow  # several seconds: the slow tier (make test stays under 3 minutes)
def test_the_cli_run_joining_a_black_hole_is_one_line(tmp_path, black_hole):
    path = tmp_path / "s.yaml"
    path.write_text("name: join\npod: {slice: v2-8}\nmodel: {name: mlp}\n"
                    f"training: {{global_batch: 64, steps: 1}}\nmetrics: {{port: 0}}\n"
                    f"ray: {{address: '{black_hole}'}}\n")
    out = subprocess.run([sys.executable, "-m", "pod", "run", str(path), "--output-dir",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(f"error: ray.address: no Ray cluster answers at {black_hole!r} "
                               "(the port accepts connections but nothing answered within 10 s")


def _run_joining(tmp_path, *, address: str | None = None, env_address: str | None = None,
                 found: str | None = "none"):
    """``tpu-pod run`` of a small scenario joining ``address`` (the scenario's ray.address)
    or ``env_address`` (RAY_ADDRESS), in a fresh process; with ``found``, Ray's lookup of
    "auto" finds that GCS address ("none": nothing), as on a machine with no cluster of
    the user's (the shared test machine has other users' clusters)."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: join\npod: {slice: v2-8}\nmodel: {name: mlp}\n"
                        "training: {global_batch: 64, steps: 1}\nmetrics: {port: 0}\n"
                        + (f"ray: {{address: '{address}'}}\n" if address else ""))
    found_set = "set()" if found == "none" else repr({found})
    script = (f"from ray._private import services\n"
              f"def found(): return {found_set}\n"
              f"found.cache_clear = lambda: None\n"
              f"services.find_gcs_addresses = found\n"
              f"services.find_bootstrap_address = lambda temp_dir: None\n"
              f"from pod.cli import main\n"
              f"main(['run', {str(scenario)!r}, '--output-dir', {str(tmp_path / 'out')!r}])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    if env_address:
        env["RAY_ADDRESS"] = env_address
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env=env)
    return out, time.monotonic() - t0


def _one_error_line(out) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-3000:])
    assert "rpc_client" not in out.stderr and "gcs_client" not in out.stderr
    return lines[0]


@pytest.mark.slow
def test_the_cli_with_ray_address_auto_and_no_cluster_is_one_line(tmp_path):
    out, _ = _run_joining(tmp_path, env_address="auto")
    assert _one_error_line(out).startswith("error: RAY_ADDRESS: 'auto' finds no Ray cluster to "
                                           "join on this machine")


@pytest.mark.slow
def test_the_cli_with_auto_finding_a_cluster_that_does_not_answer_is_one_line(tmp_path,
                                                                               black_hole):
    """What issue 34 saw: "auto" found another run's GCS at an address where it does not
    answer (Ray rewrites 127.0.0.1 to the machine's address), and waited for minutes
    printing Ray's C++ lines. Here it finds a port that never answers, which Ray may name by
    the machine's address (then nothing listens there: refused)."""
    out, _ = _run_joining(tmp_path, address="auto", found=black_hole)
    port = black_hole.rsplit(":", 1)[1]
    line = _one_error_line(out)
    assert re.match(rf"error: ray\.address: no Ray cluster answers at 'auto' \(found [\d.]+:{port}"
                    r"\) \((the port accepts connections but nothing answered within 10 s|"
                    r"Connection refused), after [\d.]+ s\); start one there", line), line


@pytest.mark.slow
def test_the_cli_joining_a_non_ray_http2_server_is_one_line(tmp_path):
    address, close = _http2_server(None)
    try:
        out, _ = _run_joining(tmp_path, address=address)
    finally:
        close()
    assert _one_error_line(out).startswith(
        f"error: ray.address: no Ray cluster answers at {address!r} (something answers HTTP/2 "
        "there, but no Ray GCS answered within 10 s, after ")


@pytest.mark.slow
def test_a_real_gcs_refuses_a_process_without_its_token(ray_cluster, tmp_path):
    """The test cluster's GCS, asked by a process without its token (and a home of its own,
    so no ~/.ray/auth_token): one line saying so, within the bound."""
    code = ("from pod.runtime.cluster import _check_reachable\n"
            f"_check_reachable({ray_cluster!r}, 10.0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode != 0
    assert (f"ClusterError: ray.address: the server at {ray_cluster!r} refused a Ray GCS request "
            "(a gRPC error status, no reply): this process has no Ray token") in out.stderr


def test_the_gcs_request_is_http2_with_hpack_literals():
    """The request's bytes: RFC 7541's integer example (C.1.2: 1337 with a 5-bit prefix is
    1f 9a 0a), and a header block whose literals decode back to the request's headers."""
    from pod.runtime.gcs_probe import GCS_METHOD, _hpack_int, request_bytes

    assert _hpack_int(1337, 5) == bytes([0x1F, 0x9A, 0x0A]) and _hpack_int(10, 5) == b"\x0a"
    raw = request_bytes("h:1", {"Authorization": "Bearer " + "t" * 200})
    assert raw.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    frames, rest = [], raw[24:]
    while rest:
        length = int.from_bytes(rest[:3], "big")
        frames.append((rest[3], rest[4], int.from_bytes(rest[5:9], "big"), rest[9:9 + length]))
        rest = rest[9 + length:]
    assert [(k, f, s) for k, f, s, _ in frames] == [(4, 0, 0), (1, 4, 1), (0, 1, 1)]
    assert frames[2][3] == b"\x00\x00\x00\x00\x00"  # an empty gRPC message

    def decode(block: bytes) -> list[tuple[str, str]]:
        out = []
        while block:
            assert block[0] == 0  # literal without indexing, new name
            block = block[1:]
            pair = []
            for _ in range(2):
                n, i = block[0] & 0x7F, 1
                if n == 0x7F:
                    n, shift = 0x7F, 0
                    while True:
                        n += (block[i] & 0x7F) << shift
                        shift += 7
                        i += 1
                        if not block[i - 1] & 0x80:
                            break
                pair.append(block[i:i + n].decode())
                block = block[i + n:]
            out.append((pair[0], pair[1]))
        return out

    headers = dict(decode(frames[1][3]))
    assert headers[":path"] == GCS_METHOD and headers[":authority"] == "h:1"
    assert headers["content-type"] == "application/grpc" and headers["te"] == "trailers"
    assert headers["authorization"] == "Bearer " + "t" * 200
