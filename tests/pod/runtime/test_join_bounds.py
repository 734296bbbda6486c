"""Probe 4 of issue 26: a `ray.address` that accepts TCP and never answers hung for more
than 300 s with 30 lines of Ray's C++ warnings (the earlier fix covered only a refused
connection). The address must now answer as a gRPC server (the GCS) within the bound.
No Ray cluster: the probe fails before ``ray.init``."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

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


def test_an_http2_server_passes_the_probe():
    """What a GCS is: a gRPC server, which answers HTTP/2's preface with a SETTINGS
    frame at once (fast tier: a stand-in that does only that)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(2)

    def answer() -> None:
        for _ in range(2):
            conn, _ = server.accept()
            conn.recv(64)
            conn.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))  # an empty SETTINGS frame
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    port = server.getsockname()[1]
    _check_reachable(f"127.0.0.1:{port}", timeout_s=5.0)
    _check_reachable(f"ray://127.0.0.1:{port}", timeout_s=5.0)
    server.close()


def test_a_real_gcs_passes_the_probe(ray_cluster):
    _check_reachable(ray_cluster, timeout_s=10.0)


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
