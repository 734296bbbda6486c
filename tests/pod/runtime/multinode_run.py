"""Run a short 8-chip v4 training on a multi-node Ray cluster on this machine,
then on a single-node cluster, and write both results as JSON to the file named by
the first argument (used by tests/pod/runtime/test_multinode.py in a subprocess: a
process can only join one Ray cluster).

The result goes to a file, not stdout: Ray forwards its workers' log lines (glog
headers such as "(pid=...) Log file created at: ...") to the driver's stdout, before
and between anything this script prints.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback multi-node (pitfalls.md)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from pod.runtime.pod import Pod  # noqa: E402
from pod.state.checkpoint import params_digest  # noqa: E402
from pod.config.plan import build_plan  # noqa: E402
from pod.config.scenario import parse_scenario  # noqa: E402

STEPS = 3


def train() -> dict:
    plan = build_plan(parse_scenario({
        "name": "multinode",
        "pod": {"chip": "v4", "chips": 8},  # 2 TPU hosts of 4 chips
        "model": {"name": "mlp", "options": {"hidden": [16], "dropout": False}},
        "data": {"name": "digits"},
        "training": {"global_batch": 64, "steps": STEPS,
                     "optimizer": {"name": "adam", "learning_rate": 0.01}},
        "metrics": {"port": 0},
    }))
    with Pod(plan) as pod:
        stats = [pod.step(s) for s in range(STEPS)]
        return {"nodes": pod.node_ids(), "hosts": [pod.host_of(r) for r in range(plan.topology.chips)],
                "digests": [params_digest(dict(s.params)) for s in pod.shards()],
                "step_seconds": [s.step_seconds for s in stats],
                "losses": [s.loss for s in stats]}


def main(result_path: Path) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    multi = train()
    multi["cluster_nodes"] = len([n for n in ray.nodes() if n["Alive"]])
    ray.shutdown()
    cluster.shutdown()
    ray.init(num_cpus=2, include_dashboard=False)
    single = train()
    ray.shutdown()
    partial = result_path.with_name(result_path.name + ".partial")
    partial.write_text(json.dumps({"multi": multi, "single": single}))
    partial.replace(result_path)  # the file exists only once complete


if __name__ == "__main__":
    main(Path(sys.argv[1]))
