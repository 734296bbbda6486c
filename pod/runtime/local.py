"""``LocalPod``: a training plan's device program in this process, one thread per device.

The same program, the same ``Device`` and the same clock as the Ray pod
(``pod.runtime.pod.Pod``), with the collectives of
``pod.programs.collectives.LocalMesh`` (the devices meet at a barrier per group)
instead of actors and the ICI transport. No Ray, no sockets: the Run-level
tests (epochs, checkpoints and resume, the summary, report.html, the trace,
faults) and notebooks that do not need the transport run here in seconds.

Its sums are ``LocalMesh``'s (group order), a ring's are the ring's order:
the two agree to float32 rounding, bit for bit on groups of two.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pod.config.plan import TrainingPlan
from pod.errors import ChipFailureError
from pod.programs import EvalSums, LocalMesh
from pod.report.clock import DeviceReport
from pod.runtime.base import PodBase, chip_devices
from pod.runtime.blas import one_blas_thread
from pod.runtime.device import Device

__all__ = ["LocalPod"]


class LocalPod(PodBase):
    """A pod whose devices run in this process (module docstring); the same interface
    as ``Pod`` (``start``, ``step``, ``evaluate``, faults, checkpoints, ``shutdown``).

    Args:
        plan: the checked training plan.
        timeout_seconds: wall seconds a device waits for its group at a collective.
    """

    def __init__(self, plan: TrainingPlan, *, timeout_seconds: float = 300.0) -> None:
        super().__init__(plan)
        mesh = plan.mesh
        self.local_mesh = LocalMesh.for_mesh(mesh, timeout_seconds=timeout_seconds)
        names = mesh.axis_names
        self._pod_device = [int(mesh.devices[tuple(self.local_mesh.coords(i)[a] for a in names)])
                            for i in range(self.local_mesh.size)]
        self.devices: list[Device] = []
        self._dead: set[int] = set()
        self._blas_limit: Any = None

    def __enter__(self) -> LocalPod:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _new_device(self, device: int, groups: Any) -> Device:
        plan, training = self.plan, self.plan.training
        return Device(plan.topology.chip, device, groups, self.program, training.seed,
                      devices_per_chip=plan.mesh.devices_per_chip, precision=training.precision,
                      mxu_model=plan.scenario.pod.mxu_model,
                      activation_bytes=int(plan.memory.get("activations", 0)))

    def start(self, check: Callable[[], None] | None = None) -> float:
        """Create every device (its initial state); wall seconds it took.

        BLAS runs one thread until ``shutdown``, as in a chip actor
        (``pod.runtime.blas.one_blas_thread``): the same bits as the chip actors,
        and the devices' threads are the parallelism (BLAS threads on top of them
        oversubscribe the cores). Set once, not per step: raising the limit
        again wakes OpenBLAS's pool, whose threads then spin between steps.
        """
        t0 = time.perf_counter()
        if self._blas_limit is None:
            self._blas_limit = one_blas_thread()
        self.devices = [self._new_device(d, groups)
                        for chip in chip_devices(self.plan) for d, groups in chip]
        self._dead = set()
        self._slowdowns = {}
        if check is not None:
            check()
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        """Drop the devices; BLAS gets its threads back."""
        self.devices = []
        if self._blas_limit is not None:
            self._blas_limit.restore_original_limits()
            self._blas_limit = None

    # -- the back-end of PodBase ----------------------------------------------------------

    def _run(self, work: Callable[[Device, Any], Any]) -> list[Any]:
        """``work(device, comm)`` on every device at once (one thread each), results by
        device id.

        Raises:
            ChipFailureError: a chip was killed (``kill_chips``).
        """
        if self._dead:
            raise ChipFailureError(f"a chip actor died: chip(s) {sorted(self._dead)} killed")

        def body(comm: Any) -> Any:
            comm.calls = []
            return work(self.devices[self._pod_device[comm.device]], comm)

        out = self.local_mesh.run(body)
        by_device: list[Any] = [None] * len(out)
        for i, value in enumerate(out):
            by_device[self._pod_device[i]] = value
        return by_device

    def _step_devices(self, step: int, xs: list[np.ndarray], ys: list[np.ndarray],
                      trace: bool) -> list[DeviceReport]:
        seed = self.plan.training.seed
        return self._run(lambda dev, comm: dev.step(comm, xs[dev.device], ys[dev.device], step,
                                                    seed, trace))

    def _evaluate_devices(self, xs: list[np.ndarray], ys: list[np.ndarray]) -> list[EvalSums]:
        return self._run(lambda dev, comm: dev.evaluate(comm, xs[dev.device], ys[dev.device]))

    def _snapshot(self, full: Sequence[bool]) -> list[Any]:
        from pod.runtime.actor import DeviceSnapshot

        return [DeviceSnapshot(d.device, d.digests(),
                               {k: np.array(v, copy=True) for k, v in d.state.model_state.items()},
                               d.state if want else None)
                for d, want in zip(self.devices, full, strict=False)]

    def _load(self, params: dict, opt_state: dict, model_states: Sequence[dict | None]
              ) -> list[tuple[str, str]]:
        return [d.load(params, opt_state, s)
                for d, s in zip(self.devices, model_states, strict=False)]

    def _digests(self) -> list[tuple[str, str]]:
        return [d.digests() for d in self.devices]

    def _set_slowdowns(self, factors: dict[int, float]) -> None:
        per_chip = self.plan.mesh.devices_per_chip
        for d in self.devices:
            if d.device // per_chip in factors:
                d.set_compute_slowdown(factors[d.device // per_chip])

    def shards(self) -> list[Any]:
        """Every device's state, by device id."""
        return [d.state for d in self.devices]

    # -- faults --------------------------------------------------------------------------

    def kill_chips(self, ranks: Any) -> None:
        """Mark these chips dead: the next step fails with ``ChipFailureError``."""
        self._dead.update(int(r) for r in ranks)

    def failed_chips(self, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
        """(dead, hung) chip ranks: the killed ones, none hung."""
        return sorted(self._dead), []

    def replace_chips(self, ranks: Any) -> float:
        """New devices (initial state) for these chips; wall seconds."""
        t0 = time.perf_counter()
        per_chip = self.plan.mesh.devices_per_chip
        chips = chip_devices(self.plan)
        for r in ranks:
            for d, groups in chips[int(r)]:
                self.devices[d] = self._new_device(d, groups)
            self._dead.discard(int(r))
            self._slowdowns.pop(int(r), None)
        del per_chip
        return time.perf_counter() - t0
