"""Chip actors on a multi-node Ray cluster: placed by TPU host, same results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.mark.slow
def test_hosts_land_on_one_node_each_and_results_match_a_single_node_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Cluster(temp_dir=...) crashes (pitfalls.md); RAY_TMPDIR must stay short (AF_UNIX
    # socket paths are limited to 107 bytes)
    tmp = tempfile.mkdtemp(prefix="tpu-mn-", dir="/tmp")
    env["RAY_TMPDIR"] = tmp
    # the result comes back in a file: the subprocess's stdout carries the Ray workers'
    # forwarded log lines (glog headers) as well as anything the script prints
    result_path = tmp_path / "result.json"
    try:
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("multinode_run.py")),
                              str(result_path)],
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert result_path.is_file(), (out.stdout[-2000:], out.stderr[-2000:])
        result = json.loads(result_path.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    multi, single = result["multi"], result["single"]
    assert multi["cluster_nodes"] == 3
    by_host: dict[int, set[str]] = {}
    for node, host in zip(multi["nodes"], multi["hosts"]):
        by_host.setdefault(host, set()).add(node)
    assert sorted(by_host) == [0, 1]
    assert all(len(nodes) == 1 for nodes in by_host.values()), by_host  # a host on one node
    assert len(set(multi["nodes"])) == 2  # SPREAD: the two hosts on different nodes
    assert multi["digests"] == single["digests"]  # bit-identical parameters
    assert multi["step_seconds"] == single["step_seconds"]
    assert multi["losses"] == single["losses"]
    assert len(multi["digests"]) == 8 and len(set(multi["digests"])) == 1  # a device per v4 chip
