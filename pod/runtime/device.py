"""``Device``: one device of a mesh running its program, on any back-end. No Ray.

A device is a chip on v4 / v5p (its two TensorCores as one megacore device),
v5e and v6e (one TensorCore), and one TensorCore on v2 / v3
(``pod.config.sharding.device_chip_spec``). It holds its own ``chip.TensorCore``
(what executes and costs every op), its part of the model (the program's
``DeviceShard``) and its groups on the mesh. One step:

1. take the core's earlier records (the step's records count from 0);
2. allocate the step's activations on its HBM;
3. run the program's ``train_step`` with the collectives of the back-end
   (the ICI transport of a chip actor, ``LocalMesh`` threads, or the
   timing-only ``ShapeCollectives``);
4. return a :class:`pod.report.clock.DeviceReport`.

The chip actor (``pod.runtime.actor``), the in-process pod
(``pod.runtime.local``) and the timing-only pod (``pod.runtime.timing``) all
hold ``Device`` objects: one step's code for every back-end.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np

from chip import Chip, ChipSpec
from pod.config.sharding import DeviceGroups, device_chip_spec
from pod.programs import AXES, DeviceCoords, DeviceProgram, EvalSums
from pod.report.clock import HOST_IN, HOST_OUT, DeviceReport
from pod.report.stats import op_bound
from pod.state.checkpoint import params_digest

__all__ = ["Device", "RecordSummary", "device_coords", "allocate_shard_hbm", "trace_rows",
           "record_bound"]


def device_coords(groups: DeviceGroups) -> DeviceCoords:
    """A device's ``DeviceCoords``: its ring position along each axis (what its
    collectives' ``axis_index`` reports, so its shard is the one it exchanges)."""
    return DeviceCoords(**{a: groups.ring_index(a) for a in AXES})


def allocate_shard_hbm(core: Any, shard: Any) -> None:
    """Allocate on ``core``'s HBM what a device keeps between steps: its parameters,
    as many bytes of gradients, and its optimizer state (as stored: float32, or bf16
    under ``weight_dtype: bfloat16``).

    Raises:
        HBMOutOfMemoryError: they do not fit (the plan refuses such a mesh first).
    """
    params = int(sum(np.asarray(v).nbytes for v in shard.params.values()))
    core.hbm.allocate("params", params)
    core.hbm.allocate("grads", params)
    core.hbm.allocate("optimizer_state",
                      int(sum(np.asarray(v).nbytes for v in shard.opt_state.values())))


def trace_rows(records: Any) -> tuple[tuple[Any, ...], ...]:
    """Op records as plain tuples (name, unit, seconds, flops, hbm_bytes, bound)."""
    return tuple((r.name, r.unit, r.seconds, r.flops, r.hbm_bytes, r.bound) for r in records)


_SECONDS = operator.attrgetter("seconds")


def record_bound(record: Any) -> str:
    """What bounds a record (``op_bound``); a host-link transfer says its direction
    (the clock runs them beside the compute: ``pod.report.clock.HOST_OUT`` / ``HOST_IN``)."""
    if record.unit == "host":
        return HOST_IN if "/reload/" in record.name else HOST_OUT
    return op_bound(record)


class RecordSummary:
    """What a ``DeviceReport`` says of a step's op records, kept for the next step.

    A core hands out the same ``OpRecord`` objects for the same ops every step
    (``chip.TensorCore`` caches one record per op and figures), so a step whose
    records are the very objects of the step before has the same seconds, bounds and
    MXU FLOPs: those tuples are reused instead of walking the records again (about
    0.2 ms of a quick-start device's step; and the driver's ``StatsMemo`` then sees
    equal tuples). Records that are not all the same objects (another program path,
    a straggler's stretched copies) are summarised afresh.
    """

    def __init__(self) -> None:
        self._records: list[Any] = []
        self._summary: tuple[tuple[float, ...], tuple[str, ...], int] = ((), (), 0)

    def of(self, records: list[Any]) -> tuple[tuple[float, ...], tuple[str, ...], int]:
        """(each record's seconds, what bounds each (``record_bound``), the MXU FLOPs)."""
        last = self._records
        if len(last) != len(records) or not all(map(operator.is_, last, records)):
            self._records = list(records)  # held: the identities stay these records'
            self._summary = (tuple(map(float, map(_SECONDS, records))),
                             tuple(map(record_bound, records)),
                             int(sum(r.flops for r in records if r.unit == "mxu")))
        return self._summary


class Device:
    """One device of a mesh (module docstring).

    Args:
        spec: the chip preset (its device is ``device_chip_spec(spec)``).
        device: the device id (chip rank x devices per chip + core).
        groups: its groups per mesh axis (``pod.config.sharding.device_groups``).
        program: the device program (``pod.programs``).
        seed: the scenario seed (parameters start from ``program.init_local``).
        devices_per_chip: 2 on v2 / v3, else 1 (the dropout streams are per chip
            and TensorCore, ``default_rng([seed, step, chip, core])``).
        numerics: TPU numerics (MXU inputs per ``precision``).
        precision: MXU precision, "bf16", "fp32" or "int8".
        mxu_model: "pipelined" or "scalesim".
        activation_bytes: HBM the step's activations take (the plan's).
        execute: False: a timing-only device (shapes only, zero views).

    Raises:
        HBMOutOfMemoryError: its state does not fit its HBM.
    """

    def __init__(self, spec: ChipSpec, device: int, groups: DeviceGroups, program: DeviceProgram,
                 seed: int, *, devices_per_chip: int = 1, numerics: bool = True,
                 precision: str = "bf16", mxu_model: str = "pipelined",
                 activation_bytes: int = 0, execute: bool = True) -> None:
        self.chip = Chip(device_chip_spec(spec), device, numerics=numerics, precision=precision,
                         mxu_model=mxu_model, sustained=True)  # a training step: steady state
        self.core = self.chip.cores[0]
        self.core.execute = execute
        self.device = device
        self.chip_rank, self.core_index = divmod(device, devices_per_chip)
        self.groups = groups
        self.program = program
        self.coords = device_coords(groups)
        self.state = (program.init_local(seed, self.coords) if execute
                      else program.shape_shard(self.coords))
        allocate_shard_hbm(self.core, self.state)
        self.activation_bytes = int(activation_bytes)
        self.compute_slowdown = 1.0
        self._summary = RecordSummary()

    def set_compute_slowdown(self, factor: float) -> None:
        """A straggler: its forward + backward op records take ``factor`` >= 1 times
        longer (``slow_chip``: the chip's simulated forward + backward seconds x factor).

        Raises:
            ValueError: factor < 1 or not finite.
        """
        if not (np.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"compute slowdown must be a finite factor >= 1, got {factor!r}")
        self.compute_slowdown = float(factor)

    def step(self, comm: Any, x: np.ndarray, y: np.ndarray, step: int, seed: int,
             trace: bool = False) -> DeviceReport:
        """One training step of this device.

        Args:
            comm: its collectives for this step.
            x, y: its examples of the batch (``program.batch_slice``).
            step: zero-based step number.
            seed: the scenario seed (dropout streams).
            trace: also return the op rows.

        Raises:
            IciError: a collective failed (the state is then a failed step's;
                recovery restores a checkpoint).
        """
        rng = np.random.default_rng([seed, step, self.chip_rank, self.core_index])
        self.core.take_records()
        self.core.hbm.allocate("activations", self.activation_bytes)
        try:
            result = self.program.train_step(self.core, comm, self.state, x, y, step + 1, rng=rng)
        finally:
            self.core.hbm.free("activations")
        self.state = result.shard
        records = self.core.take_records()
        f = self.compute_slowdown
        if f != 1.0:  # a straggler's forward + backward (``slow_chip``), not its update
            cut = len(records) if result.update_start is None else result.update_start
            records = [dataclasses.replace(r, seconds=r.seconds * f,
                                           compute_seconds=r.compute_seconds * f,
                                           memory_seconds=r.memory_seconds * f)
                       for r in records[:cut]] + records[cut:]
        hbm = self.core.hbm
        seconds, bounds, mxu_flops = self._summary.of(records)
        return DeviceReport(
            device=self.device, loss=float(result.loss),
            record_seconds=seconds, record_bounds=bounds,
            update_start=result.update_start, calls=tuple(comm.calls),
            mxu_flops=mxu_flops,
            router_loads=tuple(getattr(result, "router_loads", ())),
            hbm_used_bytes=hbm.used_bytes, hbm_peak_bytes=hbm.peak_bytes,
            hbm_capacity_bytes=hbm.capacity_bytes,
            trace=trace_rows(records) if trace else (),
            stage_group=self.groups.ring["stage"] if self.groups.axis_size("stage") > 1 else ())

    def evaluate(self, comm: Any, x: np.ndarray, y: np.ndarray) -> EvalSums:
        """The program's eval-mode sums over this device's examples; its op records
        are dropped (evaluation is not training time)."""
        self.core.take_records()
        sums = self.program.evaluate(self.core, comm, self.state, x, y)
        self.core.take_records()
        return sums

    def load(self, params: dict[str, np.ndarray], opt_state: dict[str, np.ndarray],
             model_state: dict[str, np.ndarray] | None = None) -> tuple[str, str]:
        """Replace this device's state by its shard of whole-model arrays (a
        checkpoint's); returns :meth:`digests`.

        Raises:
            KeyError, ValueError: the arrays do not fit the program's model.
        """
        self.state = self.program.load_local(params, opt_state, self.coords, model_state)
        return self.digests()

    def digests(self) -> tuple[str, str]:
        """SHA-256 of this device's parameters and of its optimizer state."""
        return params_digest(dict(self.state.params)), params_digest(dict(self.state.opt_state))
