"""What bounds a simulated step: MXU, VPU, HBM, ICI (which torus axis), latency, host,
the pipeline bubble.

A step's simulated time is its critical path (``StepStats.step_seconds``):
dispatch + exposed infeed + compute + exposed collectives + the pipeline
bubble + update, from the
one clock of every mesh (``pod.report.clock``). Each part is split by what
bounds it, from figures the step already carries:

- compute and update: each op's seconds go to what bounds that op
  (``stats.op_bound``: its MXU or VPU cycles, its HBM traffic, or the scalar
  unit's issue cycles, counted as "latency": a small op's fixed cost);
- exposed collectives, per mesh axis: the axis's exposed seconds split
  between bandwidth ("ICI", the busiest link's busy time) and "latency"
  (per-hop latency and the fixed cost per collective: the rest), in the
  proportions of that axis's collectives in the step (their
  ``ScheduleCost``s);
- dispatch and exposed infeed: "host";
- the waits for other pipeline stages: "bubble" (a mesh with a stage axis).

The bound of the step is the category with the most seconds; the ICI label
names the torus axes of the busiest links ("ICI x", "ICI x+y").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BOUND_CATEGORIES", "StepBounds", "step_bounds", "busiest_axes"]

#: The categories a step's critical path is split into, in plot order.
BOUND_CATEGORIES = ("mxu", "vpu", "hbm", "ici", "latency", "host", "bubble")

AXIS_NAMES = "xyz"
_OP_CATEGORY = {"mxu": "mxu", "vpu": "vpu", "hbm": "hbm", "scalar": "latency"}


@dataclass(frozen=True)
class StepBounds:
    """A step's critical path split by what bounds it.

    Attributes:
        seconds: simulated seconds per category (``BOUND_CATEGORIES``); they
            sum to the step's simulated seconds.
        ici_axes: the torus axes of the busiest ICI links ("x", "x+y"; "" when
            no link carries traffic).
    """

    seconds: dict[str, float]
    ici_axes: str = ""

    @property
    def bound(self) -> str:
        """The category with the most seconds ("" for an empty step)."""
        if not any(self.seconds.values()):
            return ""
        return max(BOUND_CATEGORIES, key=lambda c: self.seconds.get(c, 0.0))

    @property
    def fraction(self) -> float:
        """The bound's share of the step, 0..1."""
        total = sum(self.seconds.values())
        return self.seconds[self.bound] / total if total > 0 else 0.0

    @property
    def label(self) -> str:
        """The bound as people say it: "MXU", "HBM", "ICI x+y", "latency", "host",
        "pipeline bubble"."""
        bound = self.bound
        if bound == "ici" and self.ici_axes:
            return f"ICI {self.ici_axes}"
        if bound == "bubble":
            return "pipeline bubble"
        return bound.upper() if bound in ("mxu", "vpu", "hbm", "ici") else bound


def busiest_axes(link_bytes: dict[tuple[int, int], int], torus: Any, *,
                 tolerance: float = 0.01) -> str:
    """The torus axes ("x", "y", "z") of the links carrying within ``tolerance``
    of the most bytes, joined by "+" in axis order; "" when no link carries any.

    Args:
        link_bytes: bytes per directed link (src, dst), as ``ScheduleCost.link_bytes``.
        torus: the ``interconnect.Torus`` (its ``coords``).
        tolerance: relative slack below the maximum, 0..1.
    """
    top = max(link_bytes.values(), default=0)
    if top <= 0:
        return ""
    axes: set[int] = set()
    for (src, dst), nbytes in link_bytes.items():
        if nbytes >= top * (1.0 - tolerance):
            a, b = torus.coords(src), torus.coords(dst)
            axes.update(i for i in range(len(a)) if a[i] != b[i])
    return "+".join(AXIS_NAMES[i] if i < len(AXIS_NAMES) else str(i) for i in sorted(axes))


def _split(seconds: float, by: dict[str, float], into: dict[str, float]) -> None:
    """Add ``seconds`` to ``into`` in the proportions of ``by`` (op bounds)."""
    total = sum(by.values())
    if seconds <= 0:
        return
    if total <= 0:
        into["hbm"] += seconds  # no breakdown carried: count it as memory traffic
        return
    for bound, part in by.items():
        into[_OP_CATEGORY.get(bound, bound)] += seconds * part / total


def step_bounds(stats: Any, costs: Any, torus: Any) -> StepBounds:
    """Split one step's critical path by what bounds it (see the module docstring).

    Args:
        stats: the step's ``StepStats`` (its ``collective_spans``, per-axis exposed
            seconds and per-op bounds).
        costs: the plan's ``MeshCollectiveCosts`` in force at the step (each
            span's ``ScheduleCost``: its busiest link's share).
        torus: the pod's ``interconnect.Torus``.

    Returns:
        The ``StepBounds``; its seconds sum to ``stats.step_seconds``.
    """
    out = dict.fromkeys(BOUND_CATEGORIES, 0.0)
    out["host"] += (stats.dispatch_seconds + stats.exposed_infeed_seconds
                    + getattr(stats, "exposed_host_offload_seconds", 0.0))
    out["bubble"] += getattr(stats, "pipeline_bubble_seconds", 0.0)
    _split(stats.compute_seconds, stats.compute_bound_seconds, out)
    _split(stats.update_seconds, stats.update_bound_seconds, out)
    busy: dict[str, float] = {}
    total: dict[str, float] = {}
    link_bytes: dict[tuple[int, int], int] = {}
    for span in stats.collective_spans:
        c = costs.cost(span.axis, span.op, span.nbytes)
        busy[span.axis] = busy.get(span.axis, 0.0) + min(c.busiest_link_seconds, c.seconds)
        total[span.axis] = total.get(span.axis, 0.0) + c.seconds
    for axis, exposed in stats.axis_exposed_seconds.items():
        bandwidth = busy.get(axis, 0.0) / total[axis] if total.get(axis) else 0.0
        out["ici"] += exposed * bandwidth
        out["latency"] += exposed * (1.0 - bandwidth)
    for key, nbytes in stats.ici_link_bytes.items():
        src, dst = (int(v) for v in key.split("->"))
        link_bytes[(src, dst)] = nbytes
    return StepBounds(out, busiest_axes(link_bytes, torus))
