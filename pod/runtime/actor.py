"""``ChipActor``: one emulated TPU chip, the thin Ray shell around its devices.

The class is plain Python so it can be exercised in-process; the pod wraps it
with ``ray.remote``. A chip holds its devices (``pod.runtime.device.Device``):
one on a megacore chip (v4, v5p: its two TensorCores as one device) and on
v5e / v6e, its two TensorCores on v2 / v3. Each device owns an ``IciPort``
(``pod.runtime.ici``) and runs its collectives device to device over it
(``pod.runtime.mesh_collectives``); two devices of one chip exchange their
bytes over their ports like any pair (the clock charges their ring steps as
on-chip copies).

One step is one actor call: every device runs the program's whole step (its
devices in threads, since they exchange with each other), and the call
returns one ``DeviceReport`` per device. What crosses the actor boundary is
typed (``DeviceReport``, ``EvalSums``, ``DeviceSnapshot``), never a dict read
back by key.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from chip import ChipSpec
from pod.config.sharding import DeviceGroups
from pod.programs import DeviceProgram, DeviceShard, EvalSums
from pod.report.clock import DeviceReport
from pod.runtime.blas import one_blas_thread
from pod.runtime.cpus import pin_to_cpu
from pod.runtime.device import Device
from pod.runtime.heap import keep_freed_memory

__all__ = ["ChipActor", "DeviceSnapshot"]


@dataclass(frozen=True)
class DeviceSnapshot:
    """What a checkpoint needs from one device.

    Attributes:
        device: the device id.
        digests: (parameters sha256, optimizer state sha256).
        model_state: a copy of its model state (BatchNorm running averages; {}).
        shard: its whole state, when asked for (the devices of data replica 0).
    """

    device: int
    digests: tuple[str, str]
    model_state: dict[str, np.ndarray]
    shard: DeviceShard | None = None


class ChipActor:
    """One chip: its devices, their ports and their program (module docstring).

    Args:
        spec: the chip preset.
        rank: the chip's rank in the pod (its torus rank).
        devices: (device id, its groups) of each device on this chip.
        program: the device program every device runs.
        seed: the scenario seed.
        devices_per_chip: devices per chip of the mesh (2 on v2 / v3).
        numerics, precision, mxu_model, activation_bytes: as ``Device``.
        limit_threads: pin BLAS to one thread for the process's life
            (``pod.runtime.blas.one_blas_thread``: the bits of every back-end, and
            several actors share few cores) and keep the heap a step frees
            (``pod.runtime.heap.keep_freed_memory``); False only where the caller
            pins BLAS (chips run in threads of one process, under ``one_blas_thread()``).
        cpu_slot: (the chip's index among its host's chips, the host's chips): the
            process keeps one CPU when the host's chips are at least as many as its
            CPUs (``pod.runtime.cpus.pin_to_cpu``); None: never pinned.
    """

    def __init__(self, spec: ChipSpec, rank: int, devices: Sequence[tuple[int, DeviceGroups]],
                 program: DeviceProgram, seed: int, *, devices_per_chip: int = 1,
                 numerics: bool = True, precision: str = "bf16", mxu_model: str = "pipelined",
                 activation_bytes: int = 0, limit_threads: bool = True,
                 cpu_slot: tuple[int, int] | None = None) -> None:
        if limit_threads:
            one_blas_thread()  # pod.runtime.blas: the bits and the speed of every back-end
            keep_freed_memory()  # pod.runtime.heap: no page faults for each step's temporaries
        if cpu_slot is not None:
            pin_to_cpu(*cpu_slot)  # pod.runtime.cpus: one CPU each when they fill the host
        self.rank = rank
        self.devices = [Device(spec, d, groups, program, seed, devices_per_chip=devices_per_chip,
                               numerics=numerics, precision=precision, mxu_model=mxu_model,
                               activation_bytes=activation_bytes)
                        for d, groups in devices]
        self.addresses: dict[int, tuple[str, int]] = {}
        self._ports: dict[int, Any] = {}
        self._pool = (ThreadPoolExecutor(len(self.devices), thread_name_prefix="device")
                      if len(self.devices) > 1 else None)

    # -- set-up ----------------------------------------------------------------------

    def node_id(self) -> str:
        """The Ray node this actor runs on ("" outside Ray)."""
        try:
            import ray
            return ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside a Ray worker
            return ""

    def ici_addresses(self, key: bytes = b"") -> list[tuple[str, int]]:
        """(host, port) of each device's ``IciPort`` (opened on first use with the pod's
        link ``key``), in the order of the devices."""
        return [self._port(d.device, key).address for d in self.devices]

    def _port(self, device: int, key: bytes = b"") -> Any:
        port = self._ports.get(device)
        if port is None:
            from pod.runtime.ici import IciPort
            port = self._ports[device] = IciPort(device, key)
        return port

    def set_peers(self, addresses: dict[int, tuple[str, int]]) -> None:
        """The ``ici_addresses`` of every device of the pod (given once per start)."""
        self.addresses = {int(d): (host, port) for d, (host, port) in addresses.items()}

    def set_compute_slowdown(self, factor: float) -> None:
        """A straggler: every device of the chip runs ``factor`` >= 1 times slower.

        Raises:
            ValueError: factor < 1 or not finite.
        """
        for d in self.devices:
            d.set_compute_slowdown(factor)

    # -- a step ----------------------------------------------------------------------

    def _each(self, work: Callable[[Device], Any]) -> list[Any]:
        """``work`` on every device, in threads when the chip has several (they
        exchange with each other inside the call)."""
        if self._pool is None:
            return [work(d) for d in self.devices]
        return list(self._pool.map(work, self.devices))

    def _comm(self, device: Device, run_base: int) -> Any:
        from pod.runtime.mesh_collectives import GroupTransport, RuntimeCollectives

        return RuntimeCollectives(GroupTransport(self._port(device.device), device.groups,
                                                 self.addresses, run_base))

    def step(self, step: int, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray], seed: int,
             run_base: int, trace: bool = False) -> list[DeviceReport]:
        """One training step of every device of the chip.

        Args:
            step: zero-based step number.
            xs, ys: each device's examples of the batch, in device order.
            seed: the scenario seed.
            run_base: the run id of the step's first collective (the same on every
                device, above every id used before).
            trace: also return the op rows.

        Raises:
            IciError: a collective failed (a peer died, a link closed, a chunk did
                not come); recovery restores a checkpoint.
        """
        inputs = {d.device: (x, y) for d, x, y in zip(self.devices, xs, ys, strict=False)}
        return self._each(lambda d: d.step(self._comm(d, run_base), *inputs[d.device], step,
                                           seed, trace))

    def step_packed(self, packed: bytes) -> bytes:
        """``step`` with its arguments and its reports each pickled into one bytes object
        (what the pod sends every step): Ray then serialises one bytes argument and one
        bytes result instead of six arguments and a list of reports: a round of 4 such
        calls took 1.0-1.3 ms of the driver's CPU and 1.5-4 ms of wall less
        (``benchmarks/profile_step.py``'s machine, 2026-11-29, calls alternated).

        Args:
            packed: ``pickle.dumps((step, xs, ys, seed, run_base, trace))``.

        Returns:
            ``pickle.dumps`` of the ``step``'s list of ``DeviceReport``.

        Raises:
            IciError: as ``step``.
        """
        return pickle.dumps(self.step(*pickle.loads(packed)), protocol=pickle.HIGHEST_PROTOCOL)

    def evaluate(self, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray],
                 run_base: int) -> list[EvalSums]:
        """Every device's eval-mode sums over its examples (its collectives run like a
        step's, from ``run_base``)."""
        inputs = {d.device: (x, y) for d, x, y in zip(self.devices, xs, ys, strict=False)}
        return self._each(lambda d: d.evaluate(self._comm(d, run_base), *inputs[d.device]))

    # -- state -----------------------------------------------------------------------

    def snapshot(self, full: Sequence[bool]) -> list[DeviceSnapshot]:
        """Each device's digests and model state; its whole shard where ``full``."""
        return [DeviceSnapshot(d.device, d.digests(),
                               {k: np.array(v, copy=True) for k, v in d.state.model_state.items()},
                               d.state if want else None)
                for d, want in zip(self.devices, full, strict=False)]

    def load(self, params: dict[str, np.ndarray], opt_state: dict[str, np.ndarray],
             model_states: Sequence[dict[str, np.ndarray] | None]) -> list[tuple[str, str]]:
        """Every device takes its shard of whole-model arrays (a checkpoint's) and its
        own model state; returns their digests.

        Raises:
            KeyError, ValueError: the arrays do not fit the program's model.
        """
        return [d.load(params, opt_state, state)
                for d, state in zip(self.devices, model_states, strict=False)]

    def digests(self) -> list[tuple[str, str]]:
        """Each device's (parameters, optimizer state) digests."""
        return [d.digests() for d in self.devices]

    def shards(self) -> list[DeviceShard]:
        """Each device's state."""
        return [d.state for d in self.devices]
