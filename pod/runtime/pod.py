"""``Pod``: a training plan's device program on Ray chip actors, one actor per chip.

One step (docs/ARCHITECTURE.md, "One training step"): the driver cuts the
global batch into each device's examples, picks the step's first collective
run id (above every id used before) and makes one call per chip
(``ChipActor.step``); every device runs the program's whole step, its
collectives device to device over its ``IciPort`` (``pod.runtime.ici``); the
driver never holds a parameter or gradient byte. It waits for every chip (a
dead chip's error is the cause if one died) and combines the reports with
the one clock (``pod.runtime.base.PodBase.step``).

The pod decides nothing: the program, the collective costs at every step and
the fault plan come from the ``TrainingPlan`` (``pod.config.plan``).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from pod.config.faults import host_of
from pod.config.plan import TrainingPlan
from pod.errors import USER_ERRORS, ChipFailureError, ClusterError
from pod.programs import EvalSums
from pod.report.clock import DeviceReport
from pod.runtime.actor import ChipActor
from pod.runtime.admission import ACTOR_CPUS, admit_joined
from pod.runtime.base import PodBase, chip_devices
from pod.runtime.cluster import ensure_ray, kill_actors, shutdown_ray

__all__ = ["Pod", "RUNS_PER_STEP"]

_ACTOR_CPUS = ACTOR_CPUS  # a token CPU share per chip actor; admission checks it
_PLACEMENT_TIMEOUT_S = 60.0
#: run ids per step: a step may issue at most this many collectives per device
RUNS_PER_STEP = 1 << 20
#: how long a failed step waits for the other chips' calls to end (they hold the error
#: of a peer that died: the ICI link closes at once, so this is rarely reached)
_SETTLE_TIMEOUT_S = 5.0


class Pod(PodBase):
    """An emulated TPU pod running one training plan on Ray.

    Use as a context manager, or call ``start`` and ``shutdown``.

    Args:
        plan: the checked training plan (``pod.config.plan.build_plan``).
        ray_address: a cluster to join; defaults to the scenario's
            ``ray.address``, then ``RAY_ADDRESS``, then a local cluster.

    Raises:
        ClusterError: Ray could not start, or a chip actor died.
    """

    def __init__(self, plan: TrainingPlan, *, ray_address: str | None = None) -> None:
        super().__init__(plan)
        self.ray_address = ray_address or plan.scenario.ray.address
        self.actors: list[Any] = []
        self.placement: Any = None
        # the secret every device of this pod presents on its ICI links (pod/runtime/ici.py)
        self.ici_key = secrets.token_bytes(16)
        self._owns_ray = False
        self._run_base = RUNS_PER_STEP  # run ids of the next step start here
        self._devices = chip_devices(plan)
        # chip actors are named chip-<rank> (``ray list actors``) in a namespace of this
        # pod's own, so two pods on one cluster never collide; a replacement actor is
        # chip-<rank>-restart-<n> (the dead one's name may not be released yet)
        self.namespace = f"tpu-pod-{plan.scenario.name}-{secrets.token_hex(4)}"
        self._restarts: dict[int, int] = {}
        # calls of a failed step still running on stuck chips: read once their actors are
        # replaced, so Ray never prints them as "Unhandled error" stack dumps
        self._unsettled: list[Any] = []

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Pod:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def start(self, check: Callable[[], None] | None = None) -> float:
        """Start (or join) Ray and create one actor per chip.

        Args:
            check: called once Ray is up and once the hosts are placed: a run's
                interrupt check, so a SIGTERM during start-up stops it there
                rather than after every actor is up.

        Returns:
            Wall seconds the actors took to come up.
        """
        check = check or (lambda: None)
        self._owns_ray = ensure_ray(self.ray_address, dashboard=self.plan.scenario.ray.dashboard)
        check()
        if not self._owns_ray:  # a joined cluster: does it hold the pod? (a local one: admit)
            admit_joined(self.plan, str(self.ray_address or "RAY_ADDRESS"),
                         ray.available_resources())
        t0 = time.perf_counter()
        self.placement = self._place_hosts()
        check()
        self.actors = [self._new_actor(rank) for rank in range(self.plan.topology.chips)]
        self._connect()
        self._slowdowns = {}
        return time.perf_counter() - t0

    def _connect(self) -> None:
        """Tell every chip every device's ICI address (once; again after replacements)."""
        lists = self._get([a.ici_addresses.remote(self.ici_key) for a in self.actors])
        addresses = {d: tuple(addr) for devices, addrs in zip(self._devices, lists, strict=False)
                     for (d, _), addr in zip(devices, addrs, strict=False)}
        self._get([a.set_peers.remote(addresses) for a in self.actors])

    def host_of(self, rank: int) -> int:
        """The TPU host a chip belongs to (``pod.config.faults.host_of``: blocks of the
        chip's chips_per_host, never across two slices)."""
        pod = self.plan.topology
        return host_of(rank, pod.chip.chips_per_host, pod.torus.num_chips)

    def _place_hosts(self) -> Any:
        """One placement-group bundle per TPU host, spread over the Ray nodes.

        A bundle lives on one node, so the chips of a host share a node (as the
        chips of a real TPU host share its PCIe and DCN); SPREAD puts hosts on
        different nodes where the cluster has them.
        """
        from ray.util.placement_group import placement_group

        hosts = self.host_of(self.plan.topology.chips - 1) + 1
        per_host = [sum(1 for r in range(self.plan.topology.chips) if self.host_of(r) == h)
                    for h in range(hosts)]
        group = placement_group([{"CPU": _ACTOR_CPUS * n} for n in per_host], strategy="SPREAD")
        try:
            ray.get(group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"ray: could not place {hosts} TPU hosts of "
                f"{self.plan.topology.chip.chips_per_host} "
                f"chips within {_PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                f"{ray.cluster_resources().get('CPU', 0):g} CPUs") from None
        return group

    def _new_actor(self, rank: int) -> Any:
        """Start the chip actor of one rank in its host's bundle, named ``chip-<rank>``
        (``chip-<rank>-restart-<n>`` for its n-th replacement) in this pod's namespace."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement,
                                                    placement_group_bundle_index=self.host_of(rank))
        restarts = self._restarts.get(rank, 0)
        name = f"chip-{rank}" + (f"-restart-{restarts}" if restarts else "")
        remote = ray.remote(ChipActor).options(num_cpus=_ACTOR_CPUS, max_concurrency=1,
                                               scheduling_strategy=strategy, name=name,
                                               namespace=self.namespace)
        plan, training = self.plan, self.plan.training
        return remote.remote(plan.topology.chip, rank, self._devices[rank], self.program,
                             training.seed, devices_per_chip=plan.mesh.devices_per_chip,
                             precision=training.precision, mxu_model=plan.scenario.pod.mxu_model,
                             activation_bytes=int(plan.memory.get("activations", 0)))

    def shutdown(self) -> None:
        """Stop the actors, and the local Ray cluster if this pod started it."""
        kill_actors(self.actors)
        self.actors = []
        self._settle()
        if self.placement is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.placement)
            except Exception:  # noqa: BLE001 - cluster already gone
                pass
            self.placement = None
        if self._owns_ray:
            shutdown_ray()
            self._owns_ray = False

    # -- the back-end of PodBase ----------------------------------------------------------

    def _next_runs(self) -> int:
        base = self._run_base
        self._run_base += RUNS_PER_STEP
        return base

    def _per_chip(self, values: Sequence[Any]) -> list[list[Any]]:
        return [[values[d] for d, _ in devices] for devices in self._devices]

    def _step_devices(self, step: int, xs: list[np.ndarray], ys: list[np.ndarray],
                      trace: bool) -> list[DeviceReport]:
        base, seed = self._next_runs(), self.plan.training.seed
        refs = [actor.step.remote(step, cx, cy, seed, base, trace)
                for actor, cx, cy in zip(self.actors, self._per_chip(xs), self._per_chip(ys),
                                         strict=False)]
        return [r for chip in self._get_all(refs) for r in chip]

    def _evaluate_devices(self, xs: list[np.ndarray], ys: list[np.ndarray]) -> list[EvalSums]:
        base = self._next_runs()
        refs = [actor.evaluate.remote(cx, cy, base)
                for actor, cx, cy in zip(self.actors, self._per_chip(xs), self._per_chip(ys),
                                         strict=False)]
        return [s for chip in self._get_all(refs) for s in chip]

    def _snapshot(self, full: Sequence[bool]) -> list[Any]:
        refs = [a.snapshot.remote(f)
                for a, f in zip(self.actors, self._per_chip(full), strict=False)]
        return [s for chip in self._get_all(refs) for s in chip]

    def _load(self, params: dict, opt_state: dict, model_states: Sequence[dict | None]
              ) -> list[tuple[str, str]]:
        refs = (ray.put(params), ray.put(opt_state))
        calls = [a.load.remote(*refs, states)
                 for a, states in zip(self.actors, self._per_chip(model_states), strict=False)]
        return [d for chip in self._get_all(calls) for d in chip]

    def _digests(self) -> list[tuple[str, str]]:
        return [tuple(d) for chip in self._get_all([a.digests.remote() for a in self.actors])
                for d in chip]

    def _set_slowdowns(self, factors: dict[int, float]) -> None:
        self._get_all([self.actors[r].set_compute_slowdown.remote(f) for r, f in factors.items()])

    def shards(self) -> list[Any]:
        """Every device's state (the program's ``DeviceShard``), by device id."""
        return [s for chip in self._get_all([a.shards.remote() for a in self.actors]) for s in chip]

    def node_ids(self) -> list[str]:
        """The Ray node of each chip actor, by rank."""
        return self._get([a.node_id.remote() for a in self.actors])

    # -- faults --------------------------------------------------------------------------

    def kill_chips(self, ranks: Any) -> None:
        """Kill these chips' actors (``ray.kill``, no restart): an injected fault."""
        for r in ranks:
            ray.kill(self.actors[r], no_restart=True)

    def failed_chips(self, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
        """Which chips a failed step left unusable: a cheap call to each.

        Returns:
            (dead, hung): ranks whose actor is gone (a Ray actor error), and
            ranks that did not answer within ``timeout_s`` (alive but stuck, e.g.
            in a collective waiting for a dead peer's chunks); both need a new
            actor.
        """
        refs = [a.node_id.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        answered = set(ready)
        dead, hung = [], []
        for rank, ref in enumerate(refs):
            if ref not in answered:
                hung.append(rank)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(rank)
        return dead, hung

    def replace_chips(self, ranks: Any) -> float:
        """Start new actors for these ranks, each in its host's placement-group bundle;
        their state is the initial one until ``restore``.

        Returns:
            Wall seconds until the new actors answered.
        """
        t0 = time.perf_counter()
        for r in ranks:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self.actors[r], no_restart=True)
            self._restarts[r] = self._restarts.get(r, 0) + 1
            self.actors[r] = self._new_actor(r)
            self._slowdowns.pop(r, None)
        self._settle()  # the failed step's calls on the actors just killed
        self._connect()  # the new chips' addresses, to every chip
        return time.perf_counter() - t0

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _get(refs: Any) -> Any:
        """``ray.get`` with a chip's failure turned into one clear error."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as err:
            raise _chip_error(err) from None

    def _get_all(self, refs: list[Any]) -> list[Any]:
        """Wait for every ref; on a failure, raise once every ref has settled or
        its chip is gone, so no error is left unread and no chip is still
        mid-step: the first dead chip's error if a chip died (its peers' link
        errors follow from it), else the first error in the refs' order."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as err:
            first = err
        dead = None
        for i, ref in enumerate(refs):  # settle the rest (a chip waiting on a dead peer ends
            try:                        # with its IciError)
                ray.get(ref, timeout=_SETTLE_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                self._unsettled.extend(refs[i:])  # stuck: read once recovery kills them
                break
            except ray.exceptions.RayActorError as err:
                dead = dead or err
            except ray.exceptions.RayError:
                pass  # read, so Ray does not report it as unhandled
        raise _chip_error(dead or first) from None

    def _settle(self) -> None:
        """Read the calls a failed step left running, once their actors are killed (they
        end at once with the actor's error): an error never read is printed by Ray, when
        its reference goes, as an "Unhandled error" stack dump."""
        for ref in self._unsettled:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(ref, timeout=_SETTLE_TIMEOUT_S)
        self._unsettled = []


def _chip_error(err: Exception) -> Exception:
    """The error a chip's failed call stands for, one line with its cause.

    A user error raised inside an actor (a scenario, chip or interconnect
    error) is itself; a dead actor is a ``ChipFailureError``; any other
    exception keeps its type name and message: ``chip actor failed:
    IciError: chip 2: ...``.
    """
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, USER_ERRORS):
            return cause
        if cause is not None:
            text = (str(cause).strip().splitlines() or [""])[0]
            return ClusterError(f"a chip actor failed: {type(cause).__name__}: {text}")
    if isinstance(err, ray.exceptions.RayActorError):
        return ChipFailureError(f"a chip actor died: {_first_line(err)}")
    return ClusterError(f"a chip actor call failed: {_first_line(err)}")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
