"""``ShardedChipActor``: one chip hosting one device of a sharded mesh.

A sharded step is one actor task per device: the device program
(``pod.workloads.sharded``, or any object with the same methods, see
:class:`ShardedChipActor`) runs forward, backward and the optimizer on the
device's shards, calling its collectives through a ``RuntimeCollectives``
(``pod.runtime.mesh_collectives``) that runs each one over the device's group
of the named axis, device to device over the chip's ``IciPort``. The driver
only hands out the batch and the step's first run id; no parameter or
gradient byte goes through it.

An actor per device (``device_chip_spec``): a chip on v4 / v5p (megacore),
v5e and v6e (one TensorCore); on v2 / v3 each TensorCore is a device, so a
chip is two actors, each with its own core, HBM share and ``IciPort``. The
two exchange real bytes over their ports like any pair; the clock charges
their ring steps as on-chip copies (``MeshCollectiveCosts``).

What a step returns is a frozen :class:`ShardedReport`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from chip import Chip, ChipSpec
from pod.config.sharding import DeviceGroups, device_chip_spec
from pod.workloads.collectives import AXES, CollectiveCall
from pod.workloads.sharded import DeviceCoords
from pod.report.stats import RecordTotals
from pod.runtime.actor import HbmUsage, TraceRow, _trace_rows
from pod.state.checkpoint import params_digest

__all__ = ["ShardedChipActor", "ShardedReport", "device_coords", "allocate_shard_hbm"]


@dataclass(frozen=True)
class ShardedReport:
    """What one device's sharded step returns (simulated seconds).

    Attributes:
        device: the device id.
        loss: the training loss on its shard of the batch (the program's).
        record_seconds: each op record's simulated seconds, in issue order.
        update_start: index of the optimizer's first record (None: the clock's
            default, after the last grad_reduce).
        calls: its collectives in issue order.
        mxu_flops: MXU FLOPs it executed.
        hbm: its HBM.
        trace: its op rows (empty unless traced).
    """

    device: int
    loss: float
    record_seconds: tuple[float, ...]
    update_start: int | None
    calls: tuple[CollectiveCall, ...]
    mxu_flops: int
    hbm: HbmUsage
    trace: tuple[TraceRow, ...] = ()


@dataclass(frozen=True)
class _Seconds:
    seconds: float


class ShardedChipActor:
    """One chip as one device of a sharded mesh (plain Python; ``ray.remote`` where made).

    The device program is ``pod.workloads.sharded.ShardedTransformer``, or any
    object with its methods:

    - ``init_local(seed, coords) -> shard``: this device's parameter and
      optimizer shards (``coords``: its ``DeviceCoords``, ring positions);
      the shard has ``params`` (name -> array);
    - ``train_step(core, comm, shard, x, y, step) -> StepResult`` (``loss``,
      ``shard``, ``update_start``): one step on the device's batch shard
      (``batch_slice``), collectives through ``comm`` (``DeviceCollectives``),
      ops on ``core``; ``step`` is the optimizer step, 1 for the first;
      ``update_start`` the index of the optimizer's first op record, or None;
    - ``evaluate(core, comm, shard, x, y) -> float`` (optional): the eval loss;
    - ``load_local(params, opt_state, coords) -> shard`` (optional, for
      ``load``): this device's shard of a whole model's arrays.

    Args:
        spec: the chip preset (``device_chip_spec``: v4 / v5p run as one
            megacore device, v2 / v3 as a device per TensorCore).
        device: the device id (``Mesh``: chip rank x devices per chip + core).
        groups: its groups per mesh axis.
        program: the device program.
        seed: the scenario seed.
        numerics, limit_threads, precision, mxu_model: as ``ChipActor``.
        activation_bytes: HBM its activations take during a step (the plan's
            ``memory["activations"]``, as ``ChipActor`` allocates its own).
    """

    def __init__(self, spec: ChipSpec, device: int, groups: DeviceGroups, program: Any,
                 seed: int, numerics: bool = True, limit_threads: bool = True,
                 precision: str = "bf16", mxu_model: str = "pipelined",
                 activation_bytes: int = 0) -> None:
        if limit_threads:
            from threadpoolctl import threadpool_limits
            threadpool_limits(1)
        self.chip = Chip(device_chip_spec(spec), device, numerics=numerics, precision=precision,
                         mxu_model=mxu_model)
        self.core = self.chip.cores[0]
        self.device = device
        self.groups = groups
        self.program = program
        self.coords = device_coords(groups)
        self.state = program.init_local(seed, self.coords)
        allocate_shard_hbm(self.core, self.state)
        self.activation_bytes = int(activation_bytes)
        self.addresses: dict[int, tuple[str, int]] = {}
        self.compute_slowdown = 1.0

    # -- set-up ---------------------------------------------------------------------

    def node_id(self) -> str:
        """The Ray node this actor runs on ("" outside Ray)."""
        try:
            import ray
            return ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside a Ray worker
            return ""

    def ici_address(self, key: bytes = b"") -> tuple[str, int]:
        """(host, port) of this device's ``IciPort`` (opened on first use with ``key``)."""
        return self._ici_port(key).address

    def _ici_port(self, key: bytes = b"") -> Any:
        port = getattr(self, "_ici", None)
        if port is None:
            from pod.runtime.ici import IciPort
            port = self._ici = IciPort(self.device, key)
        return port

    def set_peers(self, addresses: dict[int, tuple[str, int]]) -> None:
        """The ``ici_address`` of every device of its groups (given once per run)."""
        self.addresses = {int(d): tuple(a) for d, a in addresses.items()}

    def set_compute_slowdown(self, factor: float) -> None:
        """A straggler: its op records take ``factor`` >= 1 times longer.

        Raises:
            ValueError: factor < 1 or not finite.
        """
        if not (np.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"compute slowdown must be a finite factor >= 1, got {factor!r}")
        self.compute_slowdown = float(factor)

    # -- one step -------------------------------------------------------------------

    def step(self, step: int, x: np.ndarray, y: np.ndarray, seed: int, run_base: int,
             trace: bool = False) -> ShardedReport:
        """One sharded step of this device.

        Args:
            step: zero-based step number.
            x, y: this device's shard of the batch.
            seed: the scenario seed.
            run_base: the run id of the step's first collective (the same on
                every device, above every id used before).
            trace: also return the op rows.

        Raises:
            IciError: a collective failed (a peer died, a link closed, a chunk
                did not come); the device's state is then that of a failed step
                (recovery restores a checkpoint).
        """
        from pod.runtime.mesh_collectives import GroupTransport, RuntimeCollectives

        transport = GroupTransport(self._ici_port(), self.groups, self.addresses, run_base)
        comm = RuntimeCollectives(transport)
        self.core.take_records()
        self.core.hbm.allocate("activations", self.activation_bytes)
        try:
            result = self.program.train_step(self.core, comm, self.state, x, y, step + 1)
        finally:
            self.core.hbm.free("activations")
        loss, self.state, update_start = result.loss, result.shard, result.update_start
        records = self.core.take_records()
        f = self.compute_slowdown
        if f != 1.0:
            records = [dataclasses.replace(r, seconds=r.seconds * f) for r in records]
        hbm = self.core.hbm
        return ShardedReport(
            device=self.device, loss=float(loss),
            record_seconds=tuple(float(r.seconds) for r in records),
            update_start=update_start, calls=tuple(comm.calls),
            mxu_flops=RecordTotals.of(records).mxu_flops,
            hbm=HbmUsage(hbm.used_bytes, hbm.peak_bytes, hbm.capacity_bytes),
            trace=_trace_rows(records) if trace else ())

    # -- state ----------------------------------------------------------------------

    def evaluate(self, x: np.ndarray, y: np.ndarray, run_base: int) -> float:
        """The program's eval-mode loss on this device's shard of an eval batch
        (its collectives run like a step's, from ``run_base``); its op records
        are dropped (evaluation is not training time)."""
        from pod.runtime.mesh_collectives import GroupTransport, RuntimeCollectives

        comm = RuntimeCollectives(GroupTransport(self._ici_port(), self.groups, self.addresses,
                                                 run_base))
        self.core.take_records()
        loss = self.program.evaluate(self.core, comm, self.state, x, y)
        self.core.take_records()
        return float(loss)

    def shard(self) -> Any:
        """This device's state (the program's shard: ``DeviceShard``), for ``assemble``."""
        return self.state

    def load(self, params: dict[str, np.ndarray], opt_state: dict[str, np.ndarray]) -> str:
        """Replace this device's state by its shard of whole-model arrays (a checkpoint's
        parameters and optimizer state, ``program.load_local``); returns ``digest``.

        Raises:
            KeyError, ValueError: the arrays do not fit the program's model.
        """
        self.state = self.program.load_local(params, opt_state, self.coords)
        return self.digest()

    def local_params(self) -> dict[str, np.ndarray]:
        """A copy of this device's parameter shards."""
        return {k: np.array(v, copy=True) for k, v in self.state.params.items()}

    def digest(self) -> str:
        """SHA-256 of this device's parameter shards (``params_digest``)."""
        return params_digest(dict(self.state.params))


def allocate_shard_hbm(core: Any, shard: Any) -> None:
    """Allocate on ``core``'s HBM what a device keeps between steps: its parameter
    chunks, as many bytes of gradient chunks, and its optimizer state (``shard``: a
    ``DeviceShard``; bytes of its float32 arrays).

    Raises:
        HBMOutOfMemoryError: they do not fit (the plan refuses such a mesh first).
    """
    params = int(sum(v.nbytes for v in shard.params.values()))
    core.hbm.allocate("params", params)
    core.hbm.allocate("grads", params)
    core.hbm.allocate("optimizer_state", int(sum(v.nbytes for v in shard.opt_state.values())))


def device_coords(groups: DeviceGroups) -> DeviceCoords:
    """A device's ``DeviceCoords``: its ring position along each axis (what its
    ``RuntimeCollectives.axis_index`` reports, so its shard is the one it exchanges)."""
    return DeviceCoords(*(groups.ring_index(a) for a in AXES))


def record_stand_ins(report: ShardedReport) -> list[_Seconds]:
    """The report's record seconds as objects with ``.seconds`` (the clock's input)."""
    return [_Seconds(s) for s in report.record_seconds]
