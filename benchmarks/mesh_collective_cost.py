"""Wall time of one mesh-axis collective's cost over every group at pod scale (issue 23).

``pod.config.sharding.MeshCollectiveCosts.cost`` for each axis of a mesh and
each op, as the sharded clock asks for it once per distinct (axis, op,
bytes) and caches it: the "torus" algorithm, XLA's (every torus axis of the
axis's block at once, both directions) beside the "ring" one (one ring per
group), both priced by ``interconnect.cost.price``. Wall seconds,
a fresh (uncached) cost each repeat, median of the repeats; the simulated
seconds of each cost are printed beside them.

Run: python benchmarks/mesh_collective_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chip import get_chip_spec  # noqa: E402
from interconnect import Torus, calibrated_link  # noqa: E402
from pod.config.mesh import layout_mesh  # noqa: E402
from pod.config.sharding import MeshCollectiveCosts  # noqa: E402

#: name -> (chip, torus shape, mesh): the 2,048-chip v5p torus of the timing-only
#: benchmark and the 8,960-chip v5p pod of the gpt3 scenario (two layouts).
POINTS = {
    "v5p-2048chips-fsdp512-tensor4": ("v5p", (8, 16, 16), {"fsdp": 512, "tensor": 4}),
    "gpt3-8960-data140-fsdp8-tensor8": ("v5p", (16, 20, 28), {"data": 140, "fsdp": 8, "tensor": 8}),
    "gpt3-8960-fsdp1120-tensor8": ("v5p", (16, 20, 28), {"fsdp": 1120, "tensor": 8}),
}

NBYTES = 64 << 20  # per device, bf16 bytes (a few layers' worth of a large model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{'point':<34} {'axis':<7} {'size':>5} {'block':<10} {'op':<15} "
          f"{'torus wall s':>10} {'ring wall s':>11} {'torus sim ms':>10} {'ring sim ms':>11}")
    for name, (chip, shape, axes) in POINTS.items():
        spec = get_chip_spec(chip)
        mesh = layout_mesh(axes, Torus(shape, True))
        link = calibrated_link(chip, spec.ici_link_bandwidth_bytes_per_s, spec.ici_latency_s)
        for axis in mesh.axis_names:
            for op in ("all_gather", "reduce_scatter", "allreduce"):
                row = {}
                for algorithm in ("torus", "ring"):
                    walls = []
                    for _ in range(args.repeats):
                        costs = MeshCollectiveCosts(mesh, link,
                                                    axis_algorithms={axis: algorithm})
                        t = time.perf_counter()
                        seconds = costs.seconds(axis, op, NBYTES)
                        walls.append(time.perf_counter() - t)
                    row[algorithm] = (statistics.median(walls), seconds)
                block = MeshCollectiveCosts(mesh, link).group_torus(axis).name
                print(f"{name:<34} {axis:<7} {mesh.axis_size(axis):>5} {block:<10} {op:<15} "
                      f"{row['torus'][0]:>10.3f} {row['ring'][0]:>11.3f} "
                      f"{row['torus'][1] * 1e3:>10.3f} {row['ring'][1] * 1e3:>11.3f}", flush=True)


if __name__ == "__main__":
    main()
