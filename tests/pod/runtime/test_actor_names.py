"""Chip actors named chip-<rank> (so `ray list actors` reads well) in a namespace of
their pod's own: two pods on one cluster never collide, and a replacement actor after
a chip failure takes a name of its own. And Ray's dashboard, asked for without its
packages, is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pod.config.plan import build_plan
from tests.pod.runtime.test_pod import mlp_scenario

ROOT = Path(__file__).resolve().parents[3]


def _names(namespace: str) -> set[str]:
    """Named actors alive in a namespace (Ray's GCS; `ray list actors` shows the same
    names, through the dashboard's state API)."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace}


@pytest.mark.slow
def test_chip_actors_are_named_by_rank_and_never_collide(ray_cluster):
    import ray

    from pod.runtime.pod import Pod

    plan = build_plan(mlp_scenario(global_batch=16))
    with Pod(plan) as first, Pod(plan) as second:       # two pods of one scenario at once
        assert first.namespace != second.namespace
        assert _names(first.namespace) == {"chip-0", "chip-1", "chip-2", "chip-3"}
        ray.get(ray.get_actor("chip-2", namespace=first.namespace).node_id.remote())
        first.replace_chips([2])
        first.replace_chips([2])
        assert _names(first.namespace) == {"chip-0", "chip-1", "chip-3", "chip-2-restart-2"}
        first.step(0)                                     # the pod still trains
        assert _names(second.namespace) == {"chip-0", "chip-1", "chip-2", "chip-3"}


@pytest.mark.slow
@pytest.mark.skipif("RAY_ADDRESS" in os.environ, reason="joins a cluster: no local dashboard")
def test_ray_dashboard_without_its_packages_is_one_line(tmp_path):
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("ray[default] is installed: the dashboard would start")
    out = subprocess.run([sys.executable, "-m", "pod", "run", "scenarios/quickstart.yaml",
                          "--steps", "1", "--metrics-port", "0", "--ray-dashboard",
                          "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "ray.dashboard: Ray's dashboard needs" in lines[0], out.stderr
    assert "tpu-pod-emulator[dashboard]" in lines[0]
